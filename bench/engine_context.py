"""What serving the tiny model with a long context costs on vLLM: the engine started with each
`--max-model-len`, side by side, on the same model folder.

For each length: seconds from start to `/health` answering 200, the engine's memory (resident
set of the server and its EngineCore process, summed, once healthy), the KV cache vLLM reports
(tokens, and how many full-length requests it holds at once), and, where the length allows it,
the time to answer one prompt of `--prompt-chars` characters of the project's own prose (the
README, repeated) with 8 completion tokens, plus its prompt token count.

Ends with one JSON line of the per-length figures.

    python bench/engine_context.py                          # 1024 and 32768, 40,000 characters
    python bench/engine_context.py --lengths 32768 --model-dir ~/.cache/harnessrl/models/tiny-qwen3
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from harnessrl.local.engine import start_engine  # noqa: E402


def long_prompt(chars: int) -> str:
    """`chars` characters of the project's README, repeated as needed."""
    text = (REPO / "README.md").read_text()
    return (text * (chars // len(text) + 1))[:chars]


def _rss_mib(pid: int) -> float:
    """Resident memory of `pid` and its descendants, MiB."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            status = Path(f"/proc/{p}/status").read_text()
            total += int(re.search(r"VmRSS:\s+(\d+)", status).group(1))  # type: ignore[union-attr]
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError, AttributeError):
            pass
    return total / 1024


def measure(model_dir: Path, length: int, prompt: str, workdir: Path) -> dict[str, object]:
    t0 = time.monotonic()
    engine = start_engine(model_dir, workdir=workdir, max_model_len=length)
    try:
        engine.wait_healthy(timeout=600)
        out: dict[str, object] = {"max_model_len": length,
                                  "start_s": round(time.monotonic() - t0, 1)}
        assert engine.proc is not None
        out["rss_mib"] = round(_rss_mib(engine.proc.pid))
        log = engine.log_path.read_text()
        if m := re.search(r"KV cache size: ([\d,]+) tokens", log):
            out["kv_cache_tokens"] = int(m.group(1).replace(",", ""))
        if m := re.search(r"Maximum concurrency for [\d,]+ tokens per request: ([\d.]+)x", log):
            out["max_concurrency"] = float(m.group(1))
        with httpx.Client(base_url=engine.openai_base_url, timeout=600,
                          headers=engine.headers) as client:  # its key (engine_guard.py)
            n_prompt = len(client.post(engine.base_url + "/tokenize", json={
                "model": engine.model_name, "prompt": prompt}).json()["tokens"])
            out["prompt_tokens"] = n_prompt
            if n_prompt + 8 <= length:
                t1 = time.monotonic()
                r = client.post("/completions", json={
                    "model": engine.model_name, "prompt": prompt, "max_tokens": 8,
                    "temperature": 1.0})
                r.raise_for_status()
                out["long_prompt_s"] = round(time.monotonic() - t1, 2)
                out["rss_after_prompt_mib"] = round(_rss_mib(engine.proc.pid))
        return out
    finally:
        engine.stop(timeout=30)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", default="1024,32768", help="max-model-len values, in order")
    p.add_argument("--prompt-chars", type=int, default=40_000)
    p.add_argument("--model-dir", type=Path, default=None,
                   help="model folder (default: the project's tiny model, built if missing)")
    a = p.parse_args()
    from harnessrl.model import build_tiny_model, default_model_dir  # torch: not for --help

    model_dir = a.model_dir or build_tiny_model(default_model_dir())
    prompt = long_prompt(a.prompt_chars)
    results = []
    with tempfile.TemporaryDirectory(prefix="engine-context-") as tmp:
        for i, length in enumerate(int(x) for x in a.lengths.split(",")):
            r = measure(model_dir, length, prompt, Path(tmp) / str(i))
            print(json.dumps(r), flush=True)
            results.append(r)
    print(json.dumps({"prompt_chars": a.prompt_chars, "results": results}))


if __name__ == "__main__":
    main()
