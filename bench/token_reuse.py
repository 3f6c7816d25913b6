"""What token in, token out costs the gateway per call, in process (no engine, no network).

`services/gateway/tokens.TokenReuse` runs on every chat call: `plan` (canonical messages,
digests, and for a turn that extends the earlier one the spliced prompt), `fields`, and
`recorded` (the new state). Measured here with the stub engine's toy `/tokenize` called in
process (the real one is one engine round trip per extending turn, not counted):

- `new_segment_us`: the request of `bench/gateway_overhead.py` (one user message, the same
  every call: each call starts a new segment), per call;
- `extend_us_<n>`: a turn extending a conversation whose recorded tokens number about n.

    python bench/token_reuse.py [--calls 20000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from harnessrl.testing.stub_engine import render_chat, toy_tokens  # noqa: E402
from harnessrl.v1 import common_pb2 as c  # noqa: E402
from services.gateway.tokens import TokenReuse  # noqa: E402


class _Session:
    def __init__(self) -> None:
        self.tokens = None
        self.next_seq = 0


_TOKENIZED: dict[str, list[int]] = {}


async def _tokenize(request: dict) -> list[int]:  # type: ignore[type-arg]
    """The stub's toy tokenizer, memoised: the engine's /tokenize is not what is measured."""
    text = render_chat(request["messages"], request.get("tools"),
                       bool(request["add_generation_prompt"]))
    if text not in _TOKENIZED:
        _TOKENIZED[text] = toy_tokens(text)
    return _TOKENIZED[text]


async def _call(reuse: TokenReuse, session: _Session, messages: list[dict],  # type: ignore[type-arg]
                prompt: list[int], completion: list[int]) -> list[int]:
    forward = {"model": "m", "messages": messages, "return_token_ids": True, "logprobs": True}
    plan = await reuse.plan(session, forward, "m", _tokenize)
    sent = (forward.get("kv_transfer_params") or {}).get("prompt_token_ids")  # type: ignore[attr-defined]
    prompt = sent or prompt
    call = c.Call(seq=session.next_seq)
    session.next_seq += 1
    reuse.check(plan, prompt)
    reuse.fields(plan, call)
    reuse.recorded(session, plan, call, {"role": "assistant", "content": "ok"}, prompt,
                   completion)
    return prompt


async def main(calls: int) -> dict[str, float]:
    out: dict[str, float] = {}
    reuse = TokenReuse()
    session = _Session()
    hi = [{"role": "user", "content": "hi"}]
    prompt = list(range(100, 132))
    for _ in range(1000):
        await _call(reuse, session, hi, prompt, [1, 2, 3, 4])
    t0 = time.perf_counter()
    for _ in range(calls):
        await _call(reuse, session, hi, prompt, [1, 2, 3, 4])
    out["new_segment_us"] = round((time.perf_counter() - t0) / calls * 1e6, 2)
    for n in (1000, 8000):
        session = _Session()
        history = [{"role": "user", "content": "x" * n}]
        ids = await _call(reuse, session, history, toy_tokens("x" * n), [5] * 16)
        history.append({"role": "assistant", "content": "ok"})
        rounds = max(50, calls // 100)
        t0 = time.perf_counter()
        for _ in range(rounds):
            turn = history + [{"role": "user", "content": "next turn"}]
            saved = session.tokens
            await _call(reuse, session, turn, ids, [5] * 16)
            session.tokens = saved  # every round extends the same n-token conversation
        out[f"extend_us_{n}"] = round((time.perf_counter() - t0) / rounds * 1e6, 2)
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--calls", type=int, default=20000)
    print(json.dumps(asyncio.run(main(ap.parse_args().calls))))
