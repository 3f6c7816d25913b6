"""The tiny local model of the tests and the demo: tokenizer, Qwen3 model, supervised warm-up.

`build_tiny_model(out_dir)` builds it (cached by recipe); `python -m harnessrl.model` is the
command-line entry.
"""

from harnessrl.model.build import Recipe, build_tiny_model, default_model_dir, load_tokenizer

__all__ = ["Recipe", "build_tiny_model", "default_model_dir", "load_tokenizer"]
