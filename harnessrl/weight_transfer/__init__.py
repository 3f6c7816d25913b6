"""Weight push from the trainer into running vLLM engines.

- `push`: `WeightPusher` drives vLLM's weight-transfer HTTP protocol for a set of engines.
- `transports`: the data plane, `WeightTransport` with `GlooTransport` (CPU) and
  `NcclTransport` (GPU, vLLM's own helpers).
- `gloo_engine` + `vllm_plugin`: the vLLM side of the gloo backend (loaded inside vLLM).
- `buckets`: the bucket plan both sides derive from the per-round metadata.
- `sharded`: the push from a model sharded over several trainer ranks (FSDP2): rank 0 pushes
  `GatheredWeights` (full tensors gathered bucket by bucket), the others `follow_gathers`.
"""

from harnessrl.weight_transfer.push import (
    EngineFailure,
    EngineRef,
    EngineTiming,
    GatewayHooks,
    PushConfig,
    PushError,
    PushHooks,
    PushReport,
    WeightPusher,
    weights_of,
)
from harnessrl.weight_transfer.transports import (
    GlooTransport,
    NcclTransport,
    WeightTransport,
    make_transport,
    update_info,
)

__all__ = [
    "EngineFailure", "EngineRef", "EngineTiming", "GatewayHooks", "GlooTransport", "NcclTransport",
    "PushConfig", "PushError", "PushHooks", "PushReport", "WeightPusher", "WeightTransport",
    "make_transport", "update_info", "weights_of",
]
