"""A trainer's checkpoints folder as its readers find their way in it: the names of its layout
and the newest complete checkpoint. The trainer writes it (services/trainer/checkpoint.py, whose
docstring gives the whole layout and how it is written atomically); `harnessrl up`, `eval` and
`export` read it.
"""

from __future__ import annotations

import re
from pathlib import Path

LATEST = "latest"  # text file naming the newest complete checkpoint ("step-000012")
STATE_FILE = "state.json"  # step, policy version, ...; written last: its checkpoint is complete
ADAPTER_DIR = "adapter"  # a LoRA checkpoint's adapter, a PEFT folder (lora_adapters.py)
STEP_DIR = re.compile(r"^step-(\d+)$")


def step_dir_name(step: int) -> str:
    return f"step-{step:06d}"


def latest_checkpoint(root: str | Path) -> Path | None:
    """The folder `latest` names, or None when there is no checkpoint."""
    pointer = Path(root) / LATEST
    if not pointer.exists():
        return None
    path = Path(root) / pointer.read_text().strip()
    if not (path / STATE_FILE).exists():
        raise FileNotFoundError(f"{pointer} names {path.name}, which is not a complete "
                                "checkpoint")
    return path
