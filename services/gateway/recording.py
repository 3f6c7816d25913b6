"""A generated call made into a `Call` and recorded with what the attempt's later calls need of
it: its token segment (`tokens.py`) and its Responses chain entry, written to the store in the
same RecordCalls batch, so a restarted gateway or another replica continues from them."""

from __future__ import annotations

from typing import TYPE_CHECKING

from harnessrl.v1 import common_pb2 as c
from harnessrl.v1 import store_pb2 as spb
from services.gateway.engines import EngineState
from services.gateway.recorder import CallRecorder, RecordError, SeqConflict
from services.gateway.sessions import Sessions
from services.gateway.streaming import Generated
from services.gateway.tokens import TokenReuse

if TYPE_CHECKING:
    from services.gateway.exchange import Exchange

MAX_CONFLICTS = 3  # seqs taken by other replicas meanwhile, before the call fails


class Recording:
    def __init__(self, recorder: CallRecorder, sessions: Sessions, tokens: TokenReuse) -> None:
        self.recorder = recorder
        self.sessions = sessions
        self.tokens = tokens

    def call(self, ex: Exchange, gen: Generated, engine: EngineState, version: int,
             latency: float, aborted: bool = False) -> c.Call:
        call = gen.call(ex.api, ex.asked, ex.request_json, aborted)
        call.sampling_override_json = ex.override
        call.rollout_id = ex.session.cred.rollout_id
        call.attempt = ex.session.cred.attempt
        call.policy_version = version
        call.engine = engine.name
        call.started_at = ex.started
        call.latency_s = latency
        call.seq = ex.session.take_seq()
        if ex.images is not None:  # hashes, processor settings; the bytes are stored already
            ex.images.fields(call)
        if ex.plan is not None:
            self.tokens.check(ex.plan, gen.prompt_ids)
            self.tokens.fields(ex.plan, call)
            ex.generated = gen
        return call

    async def record(self, ex: Exchange, call: c.Call) -> None:
        """Returns once the store has `call` and its state (RecordError otherwise). A seq that
        another replica gave to another call meanwhile (CONFLICT): the session is read again
        and the call recorded with the next free seq."""
        gen, state = ex.generated, None
        if ex.plan is not None and gen is not None and not call.aborted:
            state = self.tokens.state(ex.session, ex.plan, call, gen.message())
            if ex.chain is not None:
                state = ex.chain.state(state, gen)
        recorded, own = False, -1  # own: a seq the store may hold this call (and state) at
        try:
            for conflicts in range(MAX_CONFLICTS + 1):
                try:
                    own = call.seq
                    await self.recorder.record(call, state)
                    ex.session.seen_next = max(ex.session.seen_next, call.seq + 1)
                    recorded = True
                    break
                except SeqConflict:
                    own = -1  # that seq holds another replica's call
                    if conflicts == MAX_CONFLICTS:
                        ex.session.lost = True
                        raise
                    await self.sessions.refresh(ex.session, force=True)
                    call.seq = ex.session.take_seq()
                    if ex.plan is not None:
                        self.tokens.fields(ex.plan, call)
                except RecordError:
                    ex.session.lost = True  # the seq stays free in the store (sessions.refresh)
                    raise
        finally:
            if not recorded and state is not None:
                self._unsent(ex, state, own)
        if state is not None and state.segment and ex.plan is not None and gen is not None:
            self.tokens.recorded(ex.session, ex.plan, call, state, gen.prompt_ids or [], gen.ids)

    def _unsent(self, ex: Exchange, state: spb.GatewayCallState, own: int) -> None:
        """The call was not recorded, as far as this gateway knows: the states it named are
        let go still, and so is its own at `own` (-1: none), which the store may have (a batch
        in flight when the request went away, an answer that came too late)."""
        self.tokens.unsent(ex.session, state)
        if state.segment and own >= 0 and own not in ex.session.let_go:
            ex.session.let_go.append(own)
