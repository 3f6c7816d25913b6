"""Which run sampling policies the trainer can match: the one definition, used by the
controller (refuses such a run at CreateRun) and the gateway (refuses its calls, 400
`unmatched_sampling`, for runs put in the store by other means).

The trainer's loss computes the policy's logprobs at temperature 1 without truncation, as vLLM
reports them (raw logprobs). Tokens sampled at another temperature or from a nucleus come from
another distribution: their recorded logprobs would not be the behaviour policy's, and the
importance ratios would be skewed without a sign. So a `RunSpec.sampling` that sets temperature
or top_p to anything else is refused, loudly, rather than trained on.
"""

from __future__ import annotations

from harnessrl.v1 import common_pb2 as c

TRAINER_SAMPLING = {"temperature": 1.0, "top_p": 1.0}
"""The settings at which the trainer's loss computes logprobs (services/trainer/loss.py)."""


def unmatched(policy: c.SamplingPolicy) -> str:
    """Why the trainer cannot match `policy` ("" when it can)."""
    for name, value in TRAINER_SAMPLING.items():
        if policy.HasField(name) and getattr(policy, name) != value:  # type: ignore[arg-type]
            return (f"the run's sampling {name}={getattr(policy, name):g} cannot be matched by "
                    f"the trainer, which computes logprobs at {name}={value:g} (as the engine "
                    "reports them); refusing rather than skewing the importance ratios")
    if policy.HasField("max_tokens") and policy.max_tokens < 1:
        return "the run's sampling max_tokens must be >= 1"
    return ""
