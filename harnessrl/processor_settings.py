"""The processor settings of a vision-language model's folder (issue #45), as the gateway records
them with every call that carries images (`Call.processor_json`) and as the trainer checks them
against the processor it loaded (`services/trainer/pixels.py`): the processor files saved in the
folder, and the settings of its config.json that decide how an image becomes placeholder tokens
and pixels. Both sides compute them here, so the same folder gives the same settings.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import json

PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json")

# what of the model's config.json decides how an image becomes placeholders (config.json's
# top level, and its vision_config)
VISION_KEYS = ("scale_factor", "image_token_id", "image_token_index", "image_seq_len")
VISION_CONFIG_KEYS = ("image_size", "patch_size")


def processor_settings(model: str, folder: str | Path) -> bytes:
    """The processor settings recorded with the calls of `model` (Call.processor_json): the
    processor files saved in the model's folder, and the vision settings of its config.json
    (image and patch size, pixel shuffle, image token), as JSON; `folder` holding neither
    processor file is a ValueError."""
    files = {}
    for name in PROCESSOR_FILES:
        path = Path(folder) / name
        if path.is_file():
            files[name] = json.loads(path.read_bytes())
    if not files:
        raise ValueError(f"processor_dirs: {folder} (model {model!r}) holds none of "
                         f"{', '.join(PROCESSOR_FILES)}")
    out: dict[str, Any] = {"model": model, "files": files}
    config = Path(folder) / "config.json"
    if config.is_file():
        data = json.loads(config.read_bytes())
        vision = {k: data[k] for k in VISION_KEYS if k in data}
        sub = data.get("vision_config") or {}
        vision.update({f"vision_config.{k}": sub[k] for k in VISION_CONFIG_KEYS if k in sub})
        out["vision"] = vision
    # the standard library's json (the trainer's image has no orjson), compact and key-sorted
    return json.dumps(out, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
