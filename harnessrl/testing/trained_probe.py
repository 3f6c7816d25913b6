"""Evidence of training that the trainer cannot produce alone: the engine's log-probabilities
of a fixed probe text, asked over HTTP, against the base model's and the last checkpoint's,
computed offline with transformers.

A run that trained and pushed serves weights that (1) differ from the base model's and (2) are
the ones in its last checkpoint. A trainer that claims steps it never pushed fails (1); one
whose checkpoint is not what the engine serves fails (2). The chaos test (tests/test_chaos.py)
and the Compose test use it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from harnessrl.engine_guard import ClientKey

PROBE_TEXT = "Q: What is 17 + 25? A: 42. Q: What is 9 * 6? A: 54. Q: What is 8 - 3? A:"
PARITY_TOL = 1e-3  # engine vs transformers on the same weights (tests/test_weight_transfer.py)
MOVED = 10 * PARITY_TOL  # trained weights move some probe logprob by more than this


@dataclass
class Probe:
    ids: list[int]  # the probe text's tokens (the model's tokenizer)
    engine: list[float]  # the engine's logprob of each token after the first
    checkpoint: str  # the run's last checkpoint folder ("" when it wrote none)
    base: str  # the base model's folder (the weights the run started from)


def probe_engine(base_url: str, model_dir: Path, model: str, key: ClientKey,
                 checkpoint: Path | None) -> Probe:
    """The engine at `base_url` (serving `model`) asked for the probe's logprobs."""
    from transformers import AutoTokenizer

    from harnessrl.weight_transfer.devtools import engine_prompt_logprobs
    ids = list(AutoTokenizer.from_pretrained(model_dir)(PROBE_TEXT)["input_ids"])
    lp = engine_prompt_logprobs(base_url, ids, model, key)
    return Probe(ids, [float(x) for x in lp], str(checkpoint) if checkpoint else "",
                 str(model_dir))


def offline(model_dir: str | Path, ids: list[int]) -> torch.Tensor:
    """transformers' logprobs of the probe from the weights in `model_dir`."""
    from transformers import AutoModelForCausalLM

    from harnessrl.weight_transfer.devtools import hf_prompt_logprobs
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    return hf_prompt_logprobs(model.eval(), ids)


def check(probe: Probe) -> list[str]:
    """`problems` of the probe, the base and the checkpoint computed offline."""
    engine = torch.tensor(probe.engine, dtype=torch.float64)
    ckpt = offline(probe.checkpoint, probe.ids) if probe.checkpoint else None
    return problems(engine, offline(probe.base, probe.ids), ckpt)


def problems(engine: torch.Tensor, base: torch.Tensor, checkpoint: torch.Tensor | None
             ) -> list[str]:
    """What the logprobs say against training: empty when the engine serves weights that
    moved from the base model's and equal the last checkpoint's."""
    out = []
    moved = float((engine - base).abs().max())
    if moved <= MOVED:
        out.append(f"the engine serves the base model's weights (probe logprobs within "
                   f"{moved:.2e} of the base model's): nothing trained was pushed")
    if checkpoint is None:
        out.append("no checkpoint to reproduce the engine's logprobs from")
    elif (gap := float((engine - checkpoint).abs().max())) >= PARITY_TOL:
        out.append(f"the last checkpoint is not what the engine serves (probe logprobs "
                   f"{gap:.2e} apart, tolerance {PARITY_TOL})")
    return out
