"""vLLM general plugin (entry point `vllm.general_plugins: harnessrl_gloo`, declared in
pyproject.toml): registers the `gloo` weight-transfer backend, so a vLLM server started with
`--weight-transfer-config '{"backend":"gloo"}'` accepts trainer pushes on CPU.

vLLM calls `register()` in each of its processes, possibly more than once; the engine module
is imported lazily, only where the backend is created (the worker).
"""

from __future__ import annotations

BACKEND = "gloo"


def register() -> None:
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND in WeightTransferEngineFactory._registry:
        return
    WeightTransferEngineFactory.register_engine(
        BACKEND, "harnessrl.weight_transfer.gloo_engine", "GlooWeightTransferEngine")
