"""Who may call: rollout credentials checked against the store's view of the rollout.

A credential (signed, expiring, bound to one rollout and attempt) is verified locally. The
first time the gateway sees an attempt it asks the store whether that attempt is running and
which call sequence number comes next; later calls use that cached session. The store remains
the final judge: it refuses calls for an attempt that has finished, and the gateway then
closes the session, so the key stops working at once.

What a gateway caches of an attempt (next seq, token segments) is also in the store, written
with each call, so `refresh` reads it back when the cache may be behind: after a restart or an
eviction, and once after the set of replicas changed (with peers only the rollout's owner
serves its calls: `ownership.py`).
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
from harnessrl.v1 import store_pb2 as spb


NO_SEGMENTS = 2**31 - 1  # GetGatewayState's known_next_seq for the next seq alone
# a store that answers these is down or restarting: the call is held, not refused
HELD = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


class Session:
    __slots__ = ("cred", "next_seq", "closed", "run_model", "sampling", "sampling_problem",
                 "tokens", "let_go", "evicted", "adapter", "epoch", "seen_next", "lost",
                 "fetch_images", "max_image_bytes")

    def __init__(self, cred: RolloutCredential, next_seq: int) -> None:
        self.cred = cred
        self.next_seq = next_seq
        self.closed = ""
        self.run_model = ""  # RunSpec.model: what any other model name maps to
        self.sampling: c.SamplingPolicy | None = None  # RunSpec.sampling, when set
        self.sampling_problem = ""  # why the trainer cannot match it ("" when it can)
        self.tokens: list[Any] | None = None  # tokens.SegmentState of its latest calls
        self.let_go: list[int] = []  # seqs of states it let go that the store still keeps
        self.evicted = False  # its states left the gateway's memory: read again from the store
        self.adapter = ""  # RunSpec.adapter: the LoRA adapter serving its calls (adapters.py)
        self.epoch = 0  # the replica set's epoch its caches were last read from the store at
        self.seen_next = next_seq  # the store's next seq as far as this replica has seen it
        self.lost = False  # a seq it took was never stored (another replica may record it)
        self.fetch_images = False  # RunSpec.fetch_image_urls: http(s) images are fetched
        self.max_image_bytes = 0  # RunSpec.max_rollout_image_bytes (0: the gateway's)

    def take_seq(self) -> int:
        seq = self.next_seq
        self.next_seq += 1
        return seq


class Sessions:
    def __init__(self, signer: CredentialSigner, store: AsyncStoreClient,
                 max_sessions: int = 100_000, tokens: Any = None, replicas: Any = None,
                 hold_timeout_s: float = 120.0) -> None:
        self.signer = signer
        self.store = store
        self.max_sessions = max_sessions
        self.tokens = tokens  # tokens.TokenReuse: loads segments read from the store
        self.replicas = replicas  # replicas.ReplicaSet (None: this gateway is the only one)
        self.hold_timeout_s = hold_timeout_s
        self._sessions: dict[tuple[str, int], Session] = {}
        self._verified: dict[str, RolloutCredential] = {}
        self._loading: dict[tuple[str, int], asyncio.Future[Session]] = {}

    async def from_headers(self, headers: list[tuple[bytes, bytes]]) -> Session:
        """`authenticate` with a request's `Authorization` or `x-api-key` header."""
        authorization = api_key = None
        for name, value in headers:
            if name == b"authorization":
                authorization = value.decode("latin-1")
            elif name == b"x-api-key":
                api_key = value.decode("latin-1")
        return await self.authenticate(authorization, api_key)

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
                session.next_seq = session.seen_next = att.next_seq
                session.epoch = self.replicas.epoch if self.replicas is not None else 0
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
        session.fetch_images = run.spec.fetch_image_urls
        session.max_image_bytes = run.spec.max_rollout_image_bytes
        if run.spec.HasField("sampling") and run.spec.sampling.ListFields():
            session.sampling = run.spec.sampling
            session.sampling_problem = unmatched(run.spec.sampling, run.spec.stream)

    async def wait_ready(self, deadline: float) -> None:
        """Holds a call while this replica may not take calls (`ReplicaSet.wait_ready`)."""
        if self.replicas is not None:
            await self.replicas.wait_ready(deadline)

    def current(self, session: Session) -> bool:
        """Whether a call may go on without `refresh` (no chain to resolve): this replica takes
        calls, owns the rollout (alone, it owns every one: ownership.py) and the session's
        caches were read since the last change of the replica set."""
        if session.tokens is None and session.next_seq > 0:
            return False
        replicas = self.replicas
        return replicas is None or replicas.owns(session.cred.rollout_id) and \
            session.epoch == replicas.epoch and replicas.ready

    async def refresh(self, session: Session, response_id: str = "", force: bool = False
                      ) -> bytes | None:
        """Brings the session's caches up to the store's when they may be behind (see the
        module); with `response_id`, also resolves that Responses chain: its messages (JSON)
        or None when the store has no such response of this attempt."""
        replicas = self.replicas
        await self.wait_ready(time.monotonic() + self.hold_timeout_s)
        if not force and not response_id and self.current(session):
            return None
        epoch = replicas.epoch if replicas is not None else 0
        cached = session.tokens is not None and not force
        st = await self._state(session, NO_SEGMENTS if cached else -1, response_id)
        # A store whose next seq is past the seqs this replica has given out (now: its calls in
        # flight meanwhile are counted) has calls it did not make, another replica's; below
        # it, the calls are its own (another's call on one of those seqs makes one of the two
        # a CONFLICT, read again with force). Only then are the segments read, or when a seq
        # this replica took was lost (its record failed) and the store is past what it has seen:
        # another replica may have recorded that seq since.
        if cached and (st.next_seq > session.next_seq
                       or session.lost and st.next_seq > session.seen_next):
            segments = await self._state(session, -1, "")
            st.segments_sent, st.next_seq = True, max(st.next_seq, segments.next_seq)
            st.segments.extend(segments.segments)
        if st.segments_sent and self.tokens is not None:
            self.tokens.load(session, st.segments)
        session.next_seq = max(session.next_seq, st.next_seq)
        if st.segments_sent:
            session.seen_next = max(session.seen_next, st.next_seq)
        session.epoch = epoch
        return st.messages_json if st.response_found else None

    async def _state(self, session: Session, known: int, response_id: str) -> spb.GatewayState:
        """The attempt's state in the store; a store that cannot be reached holds the call (as
        the recorder holds a record) up to `hold_timeout_s`, then Unavailable (503)."""
        deadline = time.monotonic() + self.hold_timeout_s
        wait = 0.05
        while True:
            try:
                return await self.store.get_gateway_state(
                    session.cred.rollout_id, session.cred.attempt, known, response_id)
            except grpc.aio.AioRpcError as err:
                left = deadline - time.monotonic()
                if err.code() not in HELD or left <= 0:
                    raise Unavailable(f"store unavailable: {err.details()}") from err
                await asyncio.sleep(min(wait, left))
                wait = min(wait * 2, 1.0)

    def close(self, session: Session, why: str) -> None:
        session.closed = why

    def _evict(self) -> None:
        """Drops closed sessions, then the oldest half (they reload from the store)."""
        for k in [k for k, s in self._sessions.items() if s.closed]:
            del self._sessions[k]
        if len(self._sessions) >= self.max_sessions:
            for k in list(self._sessions)[: len(self._sessions) // 2]:
                del self._sessions[k]
