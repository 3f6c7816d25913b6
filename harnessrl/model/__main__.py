"""`python -m harnessrl.model [--out DIR] [--untied] [--seed N] [--warmup-steps N]`: builds the
tiny model (returns at once when DIR already holds the same recipe) and prints its folder."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from harnessrl import log
from harnessrl.model.build import RECIPE_FILE, Recipe, build_tiny_model, default_model_dir


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", type=Path, default=None,
                   help="model folder (default: $HARNESSRL_CACHE_DIR/models/tiny-qwen3[-untied])")
    p.add_argument("--untied", action="store_true", help="separate output head")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup-steps", type=int, default=Recipe.warmup_steps)
    a = p.parse_args()
    log.setup("model")
    out = a.out or default_model_dir(not a.untied)
    path = build_tiny_model(out, tie_word_embeddings=not a.untied, seed=a.seed,
                            warmup_steps=a.warmup_steps)
    info = json.loads((path / RECIPE_FILE).read_text())
    print(json.dumps({"model_dir": str(path), "parameters": info["parameters"],
                      "build_seconds": info["build_seconds"]}))


if __name__ == "__main__":
    main()
