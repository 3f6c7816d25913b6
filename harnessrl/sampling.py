"""Which run sampling policies the trainer can match: the one definition, used by the
controller (refuses such a run at CreateRun) and the gateway (refuses its calls, 400
`unmatched_sampling`, for runs put in the store by other means).

The trainer's loss computes the policy's logprobs at temperature 1 without truncation, as vLLM
reports them (raw logprobs). Tokens sampled at another temperature or from a nucleus come from
another distribution: their recorded logprobs would not be the behaviour policy's, and the
importance ratios would be skewed without a sign. So a `RunSpec.sampling` that sets temperature
or top_p to anything else is refused, loudly, rather than trained on.

Except for a run that publishes to no stream (`stream` "-", what evaluation runs use,
`harnessrl.evaluation`): its groups reach no trainer, so it may sample as it likes.
"""

from __future__ import annotations

from harnessrl.v1 import common_pb2 as c

TRAINER_SAMPLING = {"temperature": 1.0, "top_p": 1.0}
"""The settings at which the trainer's loss computes logprobs (services/trainer/loss.py)."""


NO_STREAM = "-"
"""`RunSpec.stream` of a run whose groups are published nowhere (never trained on)."""


def unmatched(policy: c.SamplingPolicy, stream: str = "") -> str:
    """Why the trainer cannot match `policy` ("" when it can, or when `stream` is "-": the
    run is never trained on, and any valid setting goes)."""
    if policy.HasField("temperature") and not policy.temperature >= 0:
        return f"the run's sampling temperature={policy.temperature:g} must be >= 0"
    if policy.HasField("top_p") and not 0 < policy.top_p <= 1:
        return f"the run's sampling top_p={policy.top_p:g} must be in (0, 1]"
    if policy.HasField("max_tokens") and policy.max_tokens < 1:
        return "the run's sampling max_tokens must be >= 1"
    if stream == NO_STREAM:
        return ""
    for name, value in TRAINER_SAMPLING.items():
        if policy.HasField(name) and getattr(policy, name) != value:  # type: ignore[arg-type]
            return (f"the run's sampling {name}={getattr(policy, name):g} cannot be matched by "
                    f"the trainer, which computes logprobs at {name}={value:g} (as the engine "
                    "reports them); refusing rather than skewing the importance ratios")
    return ""
