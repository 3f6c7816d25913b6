"""Gateway replicas sharing one store: which are live, whether this one may take calls, and the
engine changes it forwards to the others (docs/gateway-replicas.md).

Each replica announces itself under the store's `replica_namespace` every
`replica_heartbeat_s` (a `GatewayReplica`: its admin address, the peers it knows); one not
renewed for `replica_ttl_s` is gone (it still owns its rollouts for two heartbeats more, their
calls waiting: `beat`). From the announcements each replica knows:

- whether it is alone. Alone, its caches of an attempt (next seq, token segments) are the
  store's, so a call reads nothing from the store. With peers, each rollout has one owner:
  the replica its id hashes highest with among the live replicas that are not draining
  (`owner`, rendezvous hashing, as engines are chosen). Only the owner serves the rollout's
  calls (the others forward them to it: ownership.py), so its caches are the store's too and
  its calls read nothing from the store either. `epoch` counts the changes of the peer set:
  after one, each cached attempt is read from the store once more (its rollout may have moved
  here from a replica that served its last calls). `view` names the set of owners: a
  forwarded call carries the sender's, and is served only where the views agree.
- whether it may take calls (`ready`): a replica that joins waits until every live peer lists
  it (until then a peer may still trust its caches, and does not forward it engine changes),
  then reads the whole registry again (the changes made before its peers listed it); one
  whose own announcement has not been renewed for `replica_ttl_s` (its peers count it gone)
  joins again the same way; one flagged stale (a peer could not forward an engine change to
  it) reads the whole registry again first. Calls wait meanwhile, and readiness says why.

`forward` sends a `Sync` to every live peer after an engine change was saved in the store, and
returns once all have applied it (drained, for a pause). A peer that cannot be reached is
flagged stale (`stale:<name>` in the namespace) and catches up on its next heartbeat; a peer
that answers with an error (its calls did not drain in time) fails the change, as this
replica's own would. The flag of a replica whose record is gone (left, or expired for
10 x `replica_ttl_s`) is removed: if it comes back it joins again, and joining reads the whole
registry anyway.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import socket
import time
from collections.abc import Awaitable, Callable

import grpc

from harnessrl import rpc
from harnessrl.clients import AsyncStoreClient
from harnessrl.errors import Unavailable
from harnessrl.v1 import gateway_pb2 as gpb
from harnessrl.v1 import gateway_pb2_grpc
from services.gateway import rendezvous

log = logging.getLogger("harnessrl.gateway.replicas")

STALE = "stale:"
# a peer that answers otherwise took the request and refused it (e.g. its drain timed out)
UNREACHABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


def _view(owners: list[str]) -> str:
    """A short name of the set of owners, the same on every replica that sees that set."""
    return hashlib.blake2b("\0".join(sorted(owners)).encode(), digest_size=6).hexdigest()


def default_name(grpc_port: int) -> str:
    return f"{socket.gethostname()}:{grpc_port}"


def advertised(grpc_bind: str, grpc_port: int) -> str:
    """`grpc_bind` as a peer reaches it: the bound port, a wildcard host replaced by the
    hostname."""
    host = grpc_bind.rsplit(":", 1)[0]
    if host in ("", "0.0.0.0", "[::]", "::"):
        host = socket.gethostname()
    return f"{host}:{grpc_port}"


class ReplicaSet:
    def __init__(self, store: AsyncStoreClient, namespace: str, name: str, admin_address: str,
                 heartbeat_s: float, ttl_s: float,
                 catch_up: Callable[[], Awaitable[None]],
                 on_peers: Callable[[bool], None], http_address: str = "") -> None:
        self.store = store
        self.namespace = namespace
        self.name = name
        self.admin_address = admin_address
        self.http_address = http_address  # where peers forward the calls it owns
        self.draining = False  # stopping: owns nothing, still takes engine changes
        self.heartbeat_s = heartbeat_s
        self.ttl_s = ttl_s
        self._catch_up = catch_up  # reads the whole engine registry from the store
        self._on_peers = on_peers  # called with `alone` when the peer set changes
        self.started_at = time.time()
        self.peers: dict[str, gpb.GatewayReplica] = {}
        self.alone = True
        self.epoch = 0
        self.joined = False  # every live peer lists this replica
        self.stale = False  # flagged by a peer that could not reach it; catching up
        self.announced_at = 0.0  # monotonic time of its last renewed announcement
        self._ready = asyncio.Event()
        self.owners: list[str] = [name]  # live replicas that own rollouts (not draining)
        self.view = _view(self.owners)
        self._beaten = asyncio.Event()  # set (and replaced) after every heartbeat
        self._renewed: dict[str, float] = {}  # each peer's renewed_at at the last heartbeat
        self._clients: dict[str, gateway_pb2_grpc.GatewayAdminStub] = {}
        self._channels: dict[str, grpc.aio.Channel] = {}

    @property
    def ready(self) -> bool:
        if self._ready.is_set() and self.peers and self.expired():
            self._ready.clear()  # its peers count it gone (a stall): it joins again first
            self.joined = False
        return self._ready.is_set()

    def why_not_ready(self) -> str:
        if self.peers and self.expired():
            return f"its announcement expired (not renewed for {self.ttl_s:g}s): joining again"
        if self.stale:
            return "stale: reading the engine registry again (a peer could not reach it)"
        if not self.joined:
            waiting = sorted(n for n, p in self.peers.items() if self.name not in p.peers)
            return f"joining: waiting for peers {waiting} to list it"
        return ""

    async def wait_ready(self, deadline: float) -> None:
        """Returns at once when ready; else waits, up to `deadline` (monotonic)."""
        if self.ready:
            return
        try:
            await asyncio.wait_for(self._ready.wait(), max(0.0, deadline - time.monotonic()))
        except asyncio.TimeoutError:
            raise Unavailable(f"held past the hold timeout: replica {self.name} "
                              f"{self.why_not_ready()}") from None

    async def beat(self) -> None:
        """Reads the announcements (and catches up when flagged stale), renews this one's."""
        resp = await self.store.list_state(self.namespace)
        now = time.time()
        live: dict[str, gpb.GatewayReplica] = {}
        # Gone within the last two heartbeats, not draining: they still own their rollouts,
        # whose calls wait. One cut off from the store (not from its callers) stops taking
        # calls once its own announcement is `replica_ttl_s` old (`ready`): by the time its
        # peers take its rollouts over it has stopped for two heartbeats, so two replicas
        # never serve one rollout at once.
        lingering: list[str] = []
        grace = self.ttl_s + 2 * self.heartbeat_s
        flags: list[str] = []
        recorded = {self.name}
        for entry in resp.entries:
            if entry.key.startswith(STALE):
                flags.append(entry.key[len(STALE):])
                continue
            if entry.key == self.name:
                continue
            rec = gpb.GatewayReplica.FromString(entry.value)
            if rec.renewed_at >= now - self.ttl_s:
                live[entry.key] = rec
            elif rec.renewed_at != self._renewed.get(entry.key, rec.renewed_at):
                # it renewed since the last heartbeat, and looks expired: its clock is behind
                # this one's by more than replica_ttl_s (neither live nor lingering, as before)
                log.warning("replica %s renews its announcement but its renewed_at is %.1fs "
                            "old: clocks differ by more than replica_ttl_s", entry.key,
                            now - rec.renewed_at)
            elif rec.renewed_at >= now - grace and not rec.draining:
                lingering.append(entry.key)
            self._renewed[entry.key] = rec.renewed_at
            if rec.renewed_at < now - 10 * self.ttl_s:  # long gone: its record goes too
                await self.store.delete_state(self.namespace, entry.key)
            else:
                recorded.add(entry.key)
        self._renewed = {k: v for k, v in self._renewed.items() if k in recorded}
        flagged = self.name in flags
        for name in set(flags) - recorded:  # a flag of a replica gone for good (pod names
            await self.store.delete_state(self.namespace, STALE + name)  # change): it goes
        owners = sorted([*(n for n, p in live.items() if not p.draining),
                         *lingering,
                         *([] if self.draining else [self.name])])
        if set(live) != set(self.peers) or owners != self.owners:
            self.epoch += 1
            log.info("gateway replicas: %s (this one: %s; owners %s)", sorted(live) or
                     "none other", self.name, owners)
        self.peers, self.owners, self.view = live, owners, _view(owners)
        if self.alone != (not live and not lingering):
            self.alone = not live and not lingering
            self._on_peers(self.alone)
        if flagged:
            self.stale = True
            self._ready.clear()
            log.warning("replica %s flagged stale: reading the engine registry again", self.name)
            await self._catch_up()
            self.epoch += 1  # its caches are checked again too
            await self.store.delete_state(self.namespace, STALE + self.name)
            self.stale = False
        me = gpb.GatewayReplica(name=self.name, admin_address=self.admin_address,
                                started_at=self.started_at, renewed_at=time.time(),
                                peers=sorted(live), http_address=self.http_address,
                                draining=self.draining)
        was_joined = self.joined and not self.expired()
        await self.store.put_state(self.namespace, self.name, me.SerializeToString())
        self.announced_at = time.monotonic()
        joined = all(self.name in p.peers for p in live.values())
        if joined and not was_joined:  # peers forward changes from now on: read what came before
            self._ready.clear()
            await self._catch_up()
            self.epoch += 1
        self.joined = joined
        if self.joined and not self.stale:
            self._ready.set()
        else:
            self._ready.clear()
        self._beaten.set()
        self._beaten = asyncio.Event()

    def owner(self, rollout_id: str) -> str:
        """The replica that serves `rollout_id`'s calls (this one's name when alone)."""
        return rendezvous.choose(rollout_id, self.owners) or self.name

    def owns(self, rollout_id: str) -> bool:
        return self.alone or self.owner(rollout_id) == self.name

    async def next_beat(self, timeout_s: float) -> None:
        """Returns after the next heartbeat (the view may have changed), or `timeout_s`."""
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._beaten.wait(), max(0.0, timeout_s))

    def expired(self) -> bool:
        """Its peers count it gone (they stop forwarding changes to it)."""
        return time.monotonic() - self.announced_at >= self.ttl_s

    async def run(self) -> None:
        """Heartbeats until cancelled (a failed one is logged; the last view is kept)."""
        while True:
            await asyncio.sleep(self.heartbeat_s)
            try:
                await self.beat()
            except (grpc.aio.AioRpcError, Unavailable) as err:
                log.warning("replica heartbeat failed: %s", err)

    async def leave(self) -> None:
        """A clean shutdown: peers stop counting on this replica at once."""
        try:
            await self.store.delete_state(self.namespace, self.name)
        except grpc.aio.AioRpcError as err:
            log.warning("could not remove this replica's announcement: %s", err.code().name)
        for ch in self._channels.values():
            await ch.close()

    def _stub(self, address: str) -> gateway_pb2_grpc.GatewayAdminStub:
        if address not in self._clients:
            self._channels[address] = rpc.aio_channel(address, "gateway")
            self._clients[address] = gateway_pb2_grpc.GatewayAdminStub(self._channels[address])
        return self._clients[address]

    async def forward(self, request: gpb.SyncRequest, timeout_s: float) -> None:
        """`Sync` on every live peer, concurrently; a peer that fails is flagged stale."""
        if not self.peers:
            return
        request.origin = self.name
        peers = list(self.peers.values())
        results = await asyncio.gather(
            *(self._stub(p.admin_address).Sync(request, timeout=timeout_s) for p in peers),
            return_exceptions=True)
        refused = []
        for peer, result in zip(peers, results):
            if isinstance(result, grpc.aio.AioRpcError) and result.code() not in UNREACHABLE:
                refused.append(f"replica {peer.name}: {result.details()}")
            elif isinstance(result, BaseException):
                why = result.code().name if isinstance(result, grpc.aio.AioRpcError) else \
                    repr(result)
                log.warning("replica %s did not take the change (%s): flagged stale",
                            peer.name, why)
                try:
                    await self.store.put_state(self.namespace, STALE + peer.name, b"")
                except grpc.aio.AioRpcError as err:
                    raise Unavailable(f"replica {peer.name} did not take the change ({why}) "
                                      f"and the store could not flag it: {err.code().name}"
                                      ) from err
        if refused:
            raise Unavailable("; ".join(refused))
