"""Who may call: rollout credentials checked against the store's view of the rollout.

A credential (signed, expiring, bound to one rollout and attempt) is verified locally. The
first time the gateway sees an attempt it asks the store whether that attempt is running and
which call sequence number comes next; later calls use that cached session. The store remains
the final judge: it refuses calls for an attempt that has finished, and the gateway then
closes the session, so the key stops working at once.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import grpc

from harnessrl.clients import AsyncStoreClient
from harnessrl.credentials import CredentialSigner, RolloutCredential
from harnessrl.errors import Unauthenticated, Unavailable
from harnessrl.sampling import unmatched
from harnessrl.v1 import common_pb2 as c


class Session:
    __slots__ = ("cred", "next_seq", "closed", "run_model", "sampling", "sampling_problem",
                 "tokens", "adapter")

    def __init__(self, cred: RolloutCredential, next_seq: int) -> None:
        self.cred = cred
        self.next_seq = next_seq
        self.closed = ""
        self.run_model = ""  # RunSpec.model: what any other model name maps to
        self.sampling: c.SamplingPolicy | None = None  # RunSpec.sampling, when set
        self.sampling_problem = ""  # why the trainer cannot match it ("" when it can)
        self.tokens: list[Any] | None = None  # tokens.SegmentState of its latest calls
        self.adapter = ""  # RunSpec.adapter: the LoRA adapter serving its calls (adapters.py)

    def take_seq(self) -> int:
        seq = self.next_seq
        self.next_seq += 1
        return seq


class Sessions:
    def __init__(self, signer: CredentialSigner, store: AsyncStoreClient,
                 max_sessions: int = 100_000
                 ) -> None:
        self.signer = signer
        self.store = store
        self.max_sessions = max_sessions
        self._sessions: dict[tuple[str, int], Session] = {}
        self._verified: dict[str, RolloutCredential] = {}
        self._loading: dict[tuple[str, int], asyncio.Future[Session]] = {}

    async def authenticate(self, authorization: str | None, api_key: str | None = None
                           ) -> Session:
        token = api_key or ""
        if authorization:
            scheme, _, value = authorization.partition(" ")
            if scheme.lower() != "bearer" or not value:
                raise Unauthenticated("Authorization header must be 'Bearer <rollout key>'")
            token = value.strip()
        if not token:
            raise Unauthenticated("missing API key: set OPENAI_API_KEY to the rollout key")
        cred = self._verified.get(token)
        if cred is None:  # HMAC + JSON once per key, not once per call
            cred = self.signer.verify(token)
            if len(self._verified) >= self.max_sessions:
                self._verified.clear()
            self._verified[token] = cred
        key = (cred.rollout_id, cred.attempt)
        session = self._sessions.get(key)
        if session is None:
            session = await self._load(key, cred)
        if session.closed:
            raise Unauthenticated(session.closed)
        if time.time() >= cred.expires_at:
            raise Unauthenticated("API key expired")
        return session

    async def _load(self, key: tuple[str, int], cred: RolloutCredential) -> Session:
        pending = self._loading.get(key)
        if pending is not None:
            return await asyncio.shield(pending)
        fut: asyncio.Future[Session] = asyncio.get_running_loop().create_future()
        self._loading[key] = fut
        try:
            try:
                ro = await self.store.get_rollout(cred.rollout_id)
            except grpc.aio.AioRpcError as err:
                if err.code() == grpc.StatusCode.NOT_FOUND:
                    raise Unauthenticated(f"unknown rollout {cred.rollout_id}") from err
                raise Unavailable(f"store unavailable: {err.details()}") from err
            session = Session(cred, 0)
            att = ro.attempts[-1] if ro.attempts else None
            if ro.attempt != cred.attempt or att is None:
                session.closed = (f"attempt {cred.attempt} of rollout {cred.rollout_id} is not "
                                  "the running attempt")
            elif att.status != c.ROLLOUT_STATUS_RUNNING:
                session.closed = f"rollout {cred.rollout_id} attempt {cred.attempt} has finished"
            else:
                session.next_seq = att.next_seq
                await self._load_run(session, ro.run_id)
            if len(self._sessions) >= self.max_sessions:
                self._evict()
            self._sessions[key] = session
            fut.set_result(session)
            return session
        except BaseException as exc:
            fut.set_exception(exc)
            fut.exception()  # retrieved: waiters re-raise it
            raise
        finally:
            self._loading.pop(key, None)

    async def _load_run(self, session: Session, run_id: str) -> None:
        """The run's model name and sampling policy (rollouts made without a run have none)."""
        try:
            run = await self.store.get_run(run_id)
        except grpc.aio.AioRpcError as err:
            if err.code() == grpc.StatusCode.NOT_FOUND:
                return
            raise Unavailable(f"store unavailable: {err.details()}") from err
        session.run_model, session.adapter = run.spec.model, run.spec.adapter
        if run.spec.HasField("sampling") and run.spec.sampling.ListFields():
            session.sampling = run.spec.sampling
            session.sampling_problem = unmatched(run.spec.sampling, run.spec.stream)

    def close(self, session: Session, why: str) -> None:
        session.closed = why

    def _evict(self) -> None:
        """Drops closed sessions, then the oldest half (they reload from the store)."""
        for k in [k for k, s in self._sessions.items() if s.closed]:
            del self._sessions[k]
        if len(self._sessions) >= self.max_sessions:
            for k in list(self._sessions)[: len(self._sessions) // 2]:
                del self._sessions[k]
