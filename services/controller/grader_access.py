"""What a grader may read of the store: the `grader` identity and a scope token per job.

A grader (a per-attempt grader job, or a group grader such as the LLM judge) may read its own
rollouts, list its own group and use its run's judge cache, nothing else (harnessrl/authz.py's
SCOPED). The controller hands it the shared `grader` certificate (`grader_tls_dir`), which by
itself is allowed nothing, and a scope token it signs with its own key for that job. Both go
in the job's environment (HARNESSRL_TLS_PEM, HARNESSRL_SCOPE_TOKEN), never the controller's
own identity, which no job inherits.
"""

from __future__ import annotations

import logging
import os

from harnessrl import authz, identity

log = logging.getLogger("harnessrl.controller")


class GraderAccess:
    def __init__(self, grader_tls_dir: str) -> None:
        self.own = identity.resolve()
        self.grader: identity.Identity | None = None
        if self.own is None:  # explicit insecure mode: graders reach the store the same way
            return
        if not grader_tls_dir:
            log.warning("no grader_tls_dir: graders get no store access (a judge cannot "
                        "cache or read its attempt's calls)")
            return
        self.grader = identity.Identity.from_folder(grader_tls_dir)
        if self.grader.name != authz.GRADER:
            raise SystemExit(f"controller: grader_tls_dir {grader_tls_dir} holds identity "
                             f"{self.grader.name!r}, not {authz.GRADER!r}")

    def env(self, run_id: str, group_id: str, rollout_ids: list[str], ttl_s: float
            ) -> dict[str, str]:
        """The environment that lets one grader job read its scope of the store."""
        if self.own is None:
            return {identity.INSECURE_ENV: "1"}
        if self.grader is None:
            return {}
        token = authz.mint_scope(self.own, run_id, group_id, rollout_ids, ttl_s)
        return self.grader.child_env(token)


def without_identity(env: dict[str, str] | os._Environ[str]) -> dict[str, str]:
    """`env` less every variable that carries an identity (and the engine's key)."""
    return {k: v for k, v in env.items()
            if k not in identity.IDENTITY_ENV and not k.startswith("HARNESSRL_ENGINE_")}
