"""What an engine's own weight version says, next to the policy version the gateway records.

vLLM keeps a weight version string per server (`GET /weight_info`; set by
`/update_weight_version` or by `/finish_weight_update {"weight_version": ...}`). The trainer's
pusher keeps it honest across failures:

- before it changes any weight of an engine it sets `incomplete:<v>` (`incomplete(v)`);
- only the request that finishes the update sets `<v>` (`complete(v)`).

So an engine whose push was cut off (the trainer killed, the transfer broken) reports
`incomplete:<v>` until a later push completes, and an engine that restarted reports vLLM's
initial `default`: the weights of the checkpoint it loaded, which is policy version 0. The
gateway compares what the engine reports with the policy version it records for it (`matches`)
and routes no call to an engine where they differ (`services/gateway/weightcheck.py`).

Torch-free: the gateway imports it.
"""

from __future__ import annotations

INCOMPLETE_PREFIX = "incomplete:"
ENGINE_INITIAL = "default"  # vLLM's weight version before any update


def incomplete(version: int) -> str:
    """The engine's weight version while a push of `version` may have changed some weights."""
    return f"{INCOMPLETE_PREFIX}{version}"


def complete(version: int) -> str:
    """The engine's weight version once all of `version` is applied."""
    return str(version)


def matches(reported: str, policy_version: int) -> bool:
    """Whether an engine reporting `reported` holds exactly `policy_version`."""
    if reported == ENGINE_INITIAL:
        return policy_version == 0
    return reported == complete(policy_version)


def mismatch_reason(reported: str, policy_version: int) -> str:
    """Why an engine reporting `reported` must not serve as `policy_version`."""
    if reported.startswith(INCOMPLETE_PREFIX):
        return (f"holds an interrupted weight push ({reported!r}): a mix of versions; the gateway "
                f"records version {policy_version}; no traffic until a push completes")
    if reported == ENGINE_INITIAL:
        return (f"serves its checkpoint's weights (weight version {reported!r}, restarted?) but "
                f"the gateway records version {policy_version}; no traffic until a push "
                "completes")
    return (f"reports weight version {reported!r} but the gateway records version "
            f"{policy_version}; no traffic until a push completes")
