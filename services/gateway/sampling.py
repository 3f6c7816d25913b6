"""The run's sampling policy, imposed on every call over what the harness asked for.

A harness may ask for temperature 0 (nothing to learn from), a nucleus, penalties: each makes
the engine sample from a distribution other than the one whose logprobs it reports (vLLM
reports raw logprobs, temperature 1, before any truncation) and the trainer uses (temperature
1, untruncated). A run's `RunSpec.sampling` fixes temperature, top_p and max_tokens; with a
policy in force the settings that reshape the distribution (top_k, min_p, penalties, logit
bias) are removed too. What was overridden is recorded with the call
(`Call.sampling_override_json`: `{"imposed": {...}, "harness": {...}}`).
"""

from __future__ import annotations

from typing import Any

from harnessrl.v1 import common_pb2 as c

# Request fields that change the sampled distribution beyond temperature/top_p.
_RESHAPING = ("top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
              "logit_bias", "bad_words", "allowed_token_ids")
_TRAINER = {"temperature": 1.0, "top_p": 1.0}


def unmatched(policy: c.SamplingPolicy) -> str:
    """Why the trainer cannot match `policy` ("" when it can)."""
    for name, value in _TRAINER.items():
        if policy.HasField(name) and getattr(policy, name) != value:  # type: ignore[arg-type]
            return (f"the run's sampling {name}={getattr(policy, name):g} cannot be matched by "
                    f"the trainer, which computes logprobs at {name}={value:g} (as the engine "
                    "reports them); refusing rather than skewing the importance ratios")
    if policy.HasField("max_tokens") and policy.max_tokens < 1:
        return "the run's sampling max_tokens must be >= 1"
    return ""


def impose(forward: dict[str, Any], policy: c.SamplingPolicy | None) -> dict[str, Any] | None:
    """Applies `policy` to the engine request `forward` (in place); returns what was imposed
    and what the harness had asked for, or None without a policy."""
    if policy is None:
        return None
    imposed: dict[str, Any] = {}
    harness: dict[str, Any] = {}
    for name in ("temperature", "top_p"):
        if policy.HasField(name):
            if name in forward:
                harness[name] = forward[name]
            forward[name] = imposed[name] = getattr(policy, name)
    if policy.HasField("max_tokens"):
        for name in ("max_tokens", "max_completion_tokens"):
            if name in forward:
                harness[name] = forward.pop(name)
        forward["max_tokens"] = imposed["max_tokens"] = policy.max_tokens
    for name in _RESHAPING:
        if name in forward:
            harness[name] = forward.pop(name)
    return {"imposed": imposed, "harness": harness}
