"""Helpers for the weight-transfer tests and benchmark: random Qwen3 model folders of any
size (no tokenizer: the engine runs with `--skip-tokenizer-init` and talks token ids), a vLLM
server started with the gloo weight-transfer backend, and log-probabilities of fixed token
sequences from the engine and from transformers.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import torch

from harnessrl.engine_guard import ClientKey, process_key
from harnessrl.procs import ServiceProcess, free_port


def random_qwen3(path: Path, *, hidden: int = 128, layers: int = 2, intermediate: int = 512,
                 heads: int = 2, kv_heads: int = 1, vocab: int = 1024, tie: bool = True,
                 seed: int = 0) -> Path:
    """Saves a randomly initialised float32 Qwen3 causal LM (head_dim 64) in `path`."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        head_dim=64, max_position_embeddings=1024, tie_word_embeddings=tie,
        torch_dtype="float32", bos_token_id=0, eos_token_id=1, pad_token_id=1)
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config).to(torch.float32)
    with torch.no_grad():  # larger than the default init, so the logits differ visibly
        for p in model.parameters():
            if p.ndim > 1:
                p.normal_(0.0, 0.05)
    model.save_pretrained(path)
    return path


def load_hf(path: Path) -> torch.nn.Module:
    from transformers import Qwen3ForCausalLM

    return Qwen3ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def perturb(model: torch.nn.Module, seed: int, scale: float = 0.05) -> None:
    """Adds noise to every parameter in place (a stand-in for an optimiser step)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)


class VllmServer:
    """`python -m vllm.entrypoints.openai.api_server` on a model folder, with the dev-mode
    weight-transfer routes and our gloo backend, run from `workdir` (a folder that holds no
    `harnessrl` package that could shadow the installed plugin). Without the engine's key guard
    (harnessrl/engine_guard.py), as the weight-transfer benchmarks compare raw transfers: bound
    to 127.0.0.1, for tests and benchmarks only. The helpers below send this process's engine
    key, so they work against guarded engines as well."""

    def __init__(self, model_dir: Path, workdir: Path, *, max_model_len: int = 256,
                 kv_cache_gib: int = 1, extra_args: tuple[str, ...] = (),
                 extra_env: dict[str, str] | None = None, start_timeout: float = 300.0) -> None:
        self.model_dir = Path(model_dir)
        self.start_timeout = start_timeout
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
                "--model", str(self.model_dir), "--served-model-name", "m",
                "--host", "127.0.0.1", "--port", str(self.port), "--dtype", "float32",
                "--max-model-len", str(max_model_len), "--skip-tokenizer-init",
                "--weight-transfer-config", json.dumps({"backend": "gloo"}), *extra_args]
        env = {"VLLM_SERVER_DEV_MODE": "1", "HF_HUB_OFFLINE": "1",
               "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib), "PYTHONUNBUFFERED": "1",
               **(extra_env or {})}
        self.proc = ServiceProcess(f"vllm-{self.port}", argv, Path(workdir), env=env)

    def start(self, timeout: float | None = None) -> "VllmServer":
        timeout = self.start_timeout if timeout is None else timeout
        self.proc.start()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.proc.alive:
                raise RuntimeError(f"vLLM exited before serving:\n{self.proc.log_tail(60)}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"vLLM not healthy after {timeout}s:\n{self.proc.log_tail(60)}")

    def stop(self) -> None:
        self.proc.stop(timeout=20)

    def __enter__(self) -> "VllmServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def prompt_logprobs(self, token_ids: list[int]) -> torch.Tensor:
        return engine_prompt_logprobs(self.base_url, token_ids, "m")

    def transfer_engine(self, op: str, timeout: float = 300.0, **kwargs: str) -> Any:
        """Calls our gloo engine inside the worker (`gloo_engine.GlooWeightTransferEngine.
        __call__`: `stats`, `keep_next`, `apply_kept`) through vLLM's `/collective_rpc`;
        returns the (single) worker's answer."""
        r = httpx.post(f"{self.base_url}/collective_rpc", timeout=timeout, auth=process_key(),
                       json={"method": "weight_transfer_engine",
                             "kwargs": {"op": op, **kwargs}})
        r.raise_for_status()
        return r.json()["results"][0] if r.content else None

    def weight_version(self) -> str | None:
        r = httpx.get(f"{self.base_url}/weight_info", timeout=10, auth=process_key())
        r.raise_for_status()
        return r.json()["weight_version"]


class TrippedWeights:
    """(name, tensor) pairs to push that call `trip()` when the pusher reads tensor number
    `at` (the transport reads them in send order, bucket by bucket): a fault injected at a
    known point in the middle of a push. The metadata (`meta`, what `update_info` and the
    bucket plan read) does not trip it."""

    def __init__(self, params: list[tuple[str, torch.Tensor]], at: int,
                 trip: Callable[[], None]) -> None:
        self.params, self.at, self.trip = params, at, trip
        self.tripped = False
        self.meta = ([n for n, _ in params], [t.dtype for _, t in params],
                     [tuple(t.shape) for _, t in params])

    def __len__(self) -> int:
        return len(self.params)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(self.params)

    def __getitem__(self, i: int) -> tuple[str, torch.Tensor]:
        if i == self.at and not self.tripped:
            self.tripped = True
            self.trip()
        return self.params[i]


def engine_prompt_logprobs(base_url: str, token_ids: list[int], model: str,
                           key: ClientKey | None = None) -> torch.Tensor:
    """The engine's log-probability of each token of `token_ids` given the ones before it
    (positions 1..n-1), from `/v1/completions` with `prompt_logprobs`; `key`: the engine key
    to send (default: this process's)."""
    r = httpx.post(f"{base_url}/v1/completions", timeout=120, auth=key or process_key(), json={
        "model": model, "prompt": token_ids, "max_tokens": 1, "temperature": 0.0,
        "prompt_logprobs": 0})
    r.raise_for_status()
    entries = r.json()["choices"][0]["prompt_logprobs"]
    out = [entries[pos][str(token_ids[pos])]["logprob"] for pos in range(1, len(token_ids))]
    return torch.tensor(out, dtype=torch.float64)


def hf_prompt_logprobs(model: torch.nn.Module, token_ids: list[int]) -> torch.Tensor:
    """transformers' log-probability of each token given the ones before it."""
    with torch.no_grad():
        logits = model(torch.tensor([token_ids])).logits[0].to(torch.float64)
    logp = torch.log_softmax(logits[:-1], dim=-1)
    return logp.gather(1, torch.tensor(token_ids[1:]).unsqueeze(1)).squeeze(1)

