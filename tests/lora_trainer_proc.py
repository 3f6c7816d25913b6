"""The trainer service (`services.trainer.server.serve`, LoRA) in a process of its own for
tests/test_lora_vllm.py, with a test hook. Run it as N ranks with
`services.trainer.launch.RankGroup` (the torchrun environment) or as one process.

    python tests/lora_trainer_proc.py HOOK_JSON [the service's flags ...]

HOOK_JSON, one of:
- {"hang_at_version": N, "signal": PATH}: the push of version N loads the adapter into the
  engines, then writes PATH and hangs before telling the gateway (`SetAdapter`), until the test
  kills the process with SIGKILL: a trainer killed in the middle of its push.
- {"parity": PATH}: after every push, the engine's logprobs with the run's new adapter against
  the trainer's own model (sharded: every rank joins the forward over the same tokens); rank 0
  appends {"version", "diff", "moved"} (moved: against the base weights) to PATH as JSON lines.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from services.trainer import loop  # noqa: E402
from services.trainer.adapter_push import AdapterWeights  # noqa: E402
from services.trainer.config import TrainerConfig  # noqa: E402
from services.trainer.server import serve  # noqa: E402


def hang_after_load(version: int, signal: Path) -> None:
    load_one = AdapterWeights.load_one

    def loaded_then_hang(self: AdapterWeights, engine: Any, name: str, path: str,
                         retry: bool) -> None:
        load_one(self, engine, name, path, retry)
        if f"-v{version}-" in name:
            signal.write_text(name)
            time.sleep(3600)

    AdapterWeights.load_one = loaded_then_hang  # type: ignore[method-assign]


def check_parity_after_push(out: Path) -> None:
    import torch

    from test_lora_vllm import completion_logprobs, engine_logprobs, probe_ids

    push = loop.Trainer._push_weights
    base: list[torch.nn.Module] = []

    def pushed_then_checked(self: loop.Trainer, version: int) -> Any:
        pushed = push(self, version)
        d, comp, row = self.dist, None, None
        ids = probe_ids(self.model.config.vocab_size, version)
        if d.is_main:
            (a,) = [a for e in self.weights.admin.list_engines().engines  # type: ignore
                    for a in e.adapters if a.name == self.state.run_prefix]
            assert a.policy_version == version, (a, version)
            url = self.weights.admin.list_engines().engines[0].base_url  # type: ignore
            comp, logprobs = engine_logprobs(url, ids, a.lora_name)
            row = {"version": version, "lora_name": a.lora_name, "world_size": d.world_size}
        comp = d.agree(comp)
        mine = completion_logprobs(self.model, ids, comp)  # sharded: a collective forward
        if d.is_main:
            if not base:
                from transformers import AutoModelForCausalLM
                base.append(AutoModelForCausalLM.from_pretrained(self.cfg.model_path,
                                                                 dtype=torch.float32))
            theirs = completion_logprobs(base[0], ids, comp)
            assert row is not None
            row |= {"diff": float((mine - logprobs).abs().max()),
                    "moved": float((theirs - logprobs).abs().max())}
            with out.open("a") as f:
                f.write(json.dumps(row) + "\n")
        return pushed

    loop.Trainer._push_weights = pushed_then_checked  # type: ignore[method-assign]


def main() -> None:
    hook = json.loads(sys.argv[1])
    if "hang_at_version" in hook:
        hang_after_load(int(hook["hang_at_version"]), Path(hook["signal"]))
    if "parity" in hook:
        check_parity_after_push(Path(hook["parity"]))
    sys.exit(serve(TrainerConfig.for_service("trainer", sys.argv[2:])))


if __name__ == "__main__":
    main()
