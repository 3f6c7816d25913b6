"""Which replica serves a rollout's calls, and the forward of a call that reached another.

With peers (replicas.py) each rollout has one owner, the replica its id hashes highest with
among the live replicas that are not draining. Only the owner serves the calls that use the
rollout's caches (chat, completions, Messages, Responses): its caches are then the store's,
and a call reads nothing from the store (`Sessions.current`). A call that reaches another
replica is forwarded to the owner's HTTP data plane, streams included, with the rollout's
own key (the owner checks it as any call's) and a mark: `x-harnessrl-forwarded: <view>.<mac>`,
the sender's view of the owners and a MAC of it (the replicas' shared credential secret) over
the rollout and attempt. The owner serves a marked call only when its view is the sender's
(held until the views agree, at most `VIEW_WAIT_HEARTBEATS` heartbeats, then 503); a marked
call is never forwarded again (no loops); a mark that is not a replica's is refused (401).
An owner that cannot be reached (stopping, gone) holds the call until the next heartbeat's
view, then it goes to the new owner, this replica included.
"""

from __future__ import annotations

import hmac
import time
from collections.abc import Awaitable, Callable
from typing import Any

import orjson

from harnessrl.credentials import CredentialSigner
from harnessrl.engine_guard import ClientKey
from harnessrl.errors import Unauthenticated, Unavailable
from services.gateway.config import GatewayConfig
from services.gateway.http_server import Headers
from services.gateway.metrics import FORWARDED
from services.gateway.replicas import ReplicaSet
from services.gateway.upstream import ConnectFailed, UpstreamError, UpstreamPool, UpstreamStream

MARK = b"x-harnessrl-forwarded"
# the request headers a forward carries (the rollout's key; the Messages API's version)
CARRIED = (b"authorization", b"x-api-key", b"anthropic-version", b"anthropic-beta")
VIEW_WAIT_HEARTBEATS = 5  # a marked call waits this many heartbeats for the views to agree


class NotOwner(Exception):
    """The call is another replica's to serve: forward it there."""

    def __init__(self, owner: str, mark: bytes) -> None:
        super().__init__(owner)
        self.owner, self.mark = owner, mark


class Relay:
    """The owner's streamed response, piece by piece (an http_server StreamBody)."""

    def __init__(self, up: UpstreamStream) -> None:
        self.up = up

    def __aiter__(self) -> "Relay":
        return self

    async def __anext__(self) -> bytes:
        piece = await self.up.read()
        if piece is None:
            raise StopAsyncIteration
        return piece

    async def aclose(self) -> None:
        self.up.close()


class Ownership:
    def __init__(self, replicas: ReplicaSet | None, signer: CredentialSigner,
                 cfg: GatewayConfig) -> None:
        self.replicas, self.signer = replicas, signer
        self.hold_timeout_s, self.request_timeout_s = cfg.hold_timeout_s, cfg.request_timeout_s
        self._pools: dict[str, UpstreamPool] = {}

    def _mac(self, view: str, rollout_id: str, attempt: int) -> str:
        return self.signer.tag(f"{view}\0{rollout_id}\0{attempt}")

    async def check(self, rollout_id: str, attempt: int, headers: Headers) -> None:
        """Returns when this replica serves the call; raises NotOwner (forward it), or
        Unauthenticated / Unavailable (see the module docstring)."""
        r = self.replicas
        if r is None:
            return
        mark = next((v for n, v in headers if n == MARK), None)
        if mark is None and r.alone:  # alone: it owns every rollout
            return
        deadline = time.monotonic() + self.hold_timeout_s
        await r.wait_ready(deadline)
        if mark is None:
            owner = r.owner(rollout_id)
            if owner != r.name:
                raise NotOwner(owner, f"{r.view}.{self._mac(r.view, rollout_id, attempt)}"
                               .encode())
            return
        view, _, mac = mark.decode("latin-1").partition(".")
        if not hmac.compare_digest(mac, self._mac(view, rollout_id, attempt)):
            raise Unauthenticated(f"{MARK.decode()}: not a gateway replica's mark")
        agree_by = time.monotonic() + VIEW_WAIT_HEARTBEATS * r.heartbeat_s
        while not (r.alone or r.view == view and r.owner(rollout_id) == r.name):
            if r.view == view:  # the same view names another owner: no replica sends that
                raise Unavailable(f"forwarded to {r.name}, which does not own rollout "
                                  f"{rollout_id} in the same view ({view})")
            left = agree_by - time.monotonic()
            if left <= 0:
                raise Unavailable(f"the replicas' views of the owners disagree ({view} "
                                  f"forwarded, {r.view} here) past {VIEW_WAIT_HEARTBEATS} "
                                  "heartbeats")
            await r.next_beat(left)
            await r.wait_ready(deadline)

    async def serve(self, handler: Callable[[Headers, bytes], Awaitable[Any]], path: str,
                    headers: Headers, body: bytes) -> Any:
        """`handler`'s answer, or the owner's when the call is another replica's."""
        try:
            return await handler(headers, body)
        except NotOwner as first:
            moved = first
        deadline = time.monotonic() + self.hold_timeout_s
        while True:
            answer = await self._forward(moved, path, headers, body)
            if answer is not None:
                return answer
            assert self.replicas is not None
            if time.monotonic() >= deadline:
                raise Unavailable("the rollout's owner replica could not be reached within "
                                  f"hold_timeout_s ({self.hold_timeout_s:g}s)")
            await self.replicas.next_beat(deadline - time.monotonic())
            try:
                return await handler(headers, body)
            except NotOwner as again:
                moved = again

    async def _forward(self, moved: NotOwner, path: str, headers: Headers, body: bytes
                       ) -> tuple[int, Any] | None:
        """The owner's (status, body or stream); None when it could not be reached (nothing
        reached it: try again on the next view)."""
        assert self.replicas is not None
        peer = self.replicas.peers.get(moved.owner)
        if peer is None or not peer.http_address:
            return None
        pool = self._pools.get(peer.http_address)
        if pool is None:
            pool = self._pools[peer.http_address] = UpstreamPool(
                f"http://{peer.http_address}", key=ClientKey(""))
        extra = b"".join(b"\r\n%b: %b" % (n, v) for n, v in headers if n in CARRIED)
        extra += b"\r\n%b: %b" % (MARK, moved.mark)
        stream = b'"stream"' in body and bool(orjson.loads(body).get("stream"))
        try:
            if not stream:
                answer = await pool.post(path, body, self.request_timeout_s, extra)
                FORWARDED.inc()
                return answer
            up = await pool.stream(path, body, self.request_timeout_s, extra)
        except ConnectFailed:
            return None
        except (UpstreamError, TimeoutError) as err:
            raise Unavailable(f"forward to replica {moved.owner} failed: {err}") from err
        FORWARDED.inc()
        if up.status != 200:
            return up.status, await up.read_all()
        return 200, Relay(up)

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
