"""An attempt's calls and the gateway's state of them, appended by one Lua script per batch.

Keys (under the store's prefix P; k is the attempt):

- `P calls:{rollout_id}:{k}` HASH seq -> `Call` bytes.
- `P gws:{rollout_id}:{k}` HASH: `next` (1 + the highest seq stored), and `{seq}` ->
  `SegmentRecord` bytes without its ids for the calls a later turn may extend (the ids are the
  call's own prompt and completion ids, read from the call when the state is read). Which
  records the attempt keeps is the gateway's to say, as it holds them in memory: a state may
  name states that earlier calls ended (`drop_seqs`: those a later call extended or pushed out
  of the gateway's `tokens_per_rollout`, a few at a time), deleted with it. A read returns them
  highest seq first, leaving out those that another of them extended.
- `P gw:{rollout_id}:{k}` HASH `r:{response_id}` -> the Responses chain entry (the previous
  response id, a newline, the JSON list of messages it adds), and `P gwr:{rollout_id}:{k}`
  LIST of those response ids, most recent first, trimmed to the gateway's `keep_responses`:
  the state of an attempt is bounded as it is in a gateway's memory.

A call that starts or extends a segment costs four Redis commands (GET, HSETNX, HGET, HSET;
and an HDEL every few calls, when it names the states to end), all in the one script, with no
string work in Lua; the chain's keys and arguments go only with a Responses call. On this
2-core machine Redis spends about 1.1 us per command a script runs beyond the command itself,
and parsing a list of records in Lua cost more than the commands (measured:
docs/gateway-replicas.md).

A call and its state are written together or not at all, only while the attempt runs (the
rollout's `st:` key, kept by `redis_store`), and the gateway keys go when the attempt ends
(`drop`), with an expiry of `ttl_s` from the attempt's first call behind that (an attempt
whose finish never came; attempts run for minutes, `ttl_s` is a week). A seq stored already
with the same bytes is a resend (DUPLICATE); with other bytes it is a CONFLICT: two gateway
replicas gave one seq to two calls, and the second is refused so that the gateway sends it
again with a new one (nothing is dropped as a duplicate). An aborted
copy of a call stored complete is a DUPLICATE too: the gateway sends one when the client went
away while the complete call was being recorded, and the store keeps one version of it.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import redis.asyncio as aioredis

from harnessrl.v1 import common_pb2 as c
from harnessrl.v1 import store_pb2 as spb

_APPEND_LUA = """
-- Per call: KEYS = its rollout's state key, calls hash, segments hash, and with a response
-- its chain hash and response list; ARGV = attempt, seq, call bytes, the bytes of the call
-- not aborted (an aborted one; else ''), segment record ('' none), n, the n seqs of the
-- states it ends, response id ('' none), and with a response its chain entry and
-- keep_responses. ARGV[#ARGV] = ttl seconds of the gateway's keys.
-- Result per call: 1 stored, 0 duplicate, -1 unknown rollout, -2 attempt not running,
-- -3 conflict (its seq holds another call).
local out = {}
local ttl = tonumber(ARGV[#ARGV])
local k, a = 0, 0
while a < #ARGV - 1 do
  local st_key, calls_key, segs = KEYS[k+1], KEYS[k+2], KEYS[k+3]
  local attempt, seq, data, whole, record = ARGV[a+1], ARGV[a+2], ARGV[a+3], ARGV[a+4],
    ARGV[a+5]
  local ends = tonumber(ARGV[a+6])
  local rid = ARGV[a+7+ends]
  local gw, resps, chain, keep = KEYS[k+4], KEYS[k+5], ARGV[a+8+ends], ARGV[a+9+ends]
  local drops = a + 7
  k = k + 3
  a = a + 7 + ends
  if rid ~= '' then k, a = k + 2, a + 2 end
  local st = redis.call('GET', st_key)
  if st ~= ('R' .. attempt) or redis.call('HSETNX', calls_key, seq, data) == 0 then
    local have = redis.call('HGET', calls_key, seq)
    if have then
      if have == data or (whole ~= '' and have == whole) then out[#out + 1] = 0
      else out[#out + 1] = -3 end
    elseif not st then out[#out + 1] = -1
    else out[#out + 1] = -2 end
  else
    local nxt = redis.call('HGET', segs, 'next')
    local set = {}
    if not nxt or tonumber(seq) + 1 > tonumber(nxt) then
      set[1], set[2] = 'next', tonumber(seq) + 1
    end
    if record ~= '' then set[#set + 1], set[#set + 2] = seq, record end
    if #set > 0 then redis.call('HSET', segs, unpack(set)) end
    if not nxt then redis.call('EXPIRE', segs, ttl) end
    if ends > 0 then redis.call('HDEL', segs, unpack(ARGV, drops, drops + ends - 1)) end
    if rid ~= '' then
      redis.call('HSET', gw, 'r:' .. rid, chain)
      local n = redis.call('LPUSH', resps, rid)
      if n == 1 then  -- the attempt's first response (the list is never emptied)
        redis.call('EXPIRE', resps, ttl)
        redis.call('EXPIRE', gw, ttl)
      end
      for _ = 1, n - tonumber(keep) do
        redis.call('HDEL', gw, 'r:' .. redis.call('RPOP', resps))
      end
    end
    out[#out + 1] = 1
  end
end
return out
"""

_CHAIN_LUA = """
-- KEYS[1] gw hash; ARGV[1] response id, ARGV[2] most entries walked.
-- The chain entries from that response back to the first, newest first ({} when unknown).
local out = {}
local id = ARGV[1]
local limit = tonumber(ARGV[2])
while id ~= '' and #out < limit do
  local entry = redis.call('HGET', KEYS[1], 'r:' .. id)
  if not entry then
    if #out == 0 then return {} end
    return {'', 'broken'}
  end
  local nl = string.find(entry, '\\n', 1, true)
  out[#out + 1] = string.sub(entry, nl + 1)
  id = string.sub(entry, 1, nl - 1)
end
return out
"""

_NO_STATE = spb.GatewayCallState()


def _unaborted(call: c.Call) -> bytes:
    """An aborted call's bytes as the complete call it copies would have them; else b""."""
    if not call.aborted:
        return b""
    whole = c.Call()
    whole.CopyFrom(call)
    whole.aborted = False
    return whole.SerializeToString()


def _raw(value: bytes | str) -> bytes:
    """The store's client answers bytes (decode_responses is off); typed as either."""
    return value if isinstance(value, bytes) else value.encode()


def segment_ids(call: c.Call) -> bytes:
    """A segment's ids as SegmentRecord.ids holds them: the call's prompt + completion ids."""
    ids = array("i", call.prompt_token_ids)
    ids.extend(call.completion_token_ids)
    if ids.itemsize != 4 or array("i", [1]).tobytes() != b"\x01\x00\x00\x00":
        raise RuntimeError("the store packs token ids as little-endian int32")
    return ids.tobytes()


class CallLog:
    def __init__(self, redis: aioredis.Redis, prefix: str, ttl_s: int = 7 * 24 * 3600) -> None:
        self.r = redis
        self.p = prefix
        self.ttl_s = ttl_s
        self._append = redis.register_script(_APPEND_LUA)
        self._chain = redis.register_script(_CHAIN_LUA)

    def calls_key(self, rollout_id: str, attempt: int) -> str:
        return self._keys(rollout_id, attempt)[0]

    def _keys(self, rollout_id: str, attempt: int) -> tuple[str, str, str, str]:
        """The attempt's calls hash, segments hash, chain hash and response list."""
        tail = f"{rollout_id}:{attempt}"
        return (f"{self.p}calls:{tail}", f"{self.p}gws:{tail}", f"{self.p}gw:{tail}",
                f"{self.p}gwr:{tail}")

    async def append(self, calls: Sequence[c.Call], states: Sequence[spb.GatewayCallState],
                     data: Sequence[bytes] = ()) -> list[int]:
        """Appends checked calls with their states (one round trip), each stored as its bytes
        in `data` (as received) or else serialised: per call 1 stored, 0 duplicate, -1 unknown
        rollout, -2 attempt not running, -3 conflict."""
        keys: list[str] = []
        args: list[bytes | str | int] = []
        for i, call in enumerate(calls):
            state = states[i] if i < len(states) else _NO_STATE
            calls_key, segs, gw, resps = self._keys(call.rollout_id, call.attempt)
            keys += [f"{self.p}st:{call.rollout_id}", calls_key, segs]
            record = b""
            if state.segment:
                record = spb.SegmentRecord(  # the ids are the call's: not stored twice
                    segment=call.segment, seq=call.seq,
                    n_messages=state.n_messages, digest=state.digest,
                    settings=state.settings).SerializeToString()
            ends = state.drop_seqs
            args += [call.attempt, call.seq, data[i] if data else call.SerializeToString(),
                     _unaborted(call),
                     record, len(ends), *ends, state.response_id]
            if state.response_id:
                keys += [gw, resps]
                args += [state.previous_response_id.encode() + b"\n" + (state.messages_json
                                                                        or b"[]"),
                         max(1, state.keep_responses or 1024)]
        args.append(self.ttl_s)
        return [int(x) for x in await self._append(keys=keys, args=args)]

    async def gateway_state(self, req: spb.GetGatewayStateRequest) -> spb.GatewayState:
        _, segs, gw, _ = self._keys(req.rollout_id, req.attempt)
        fields: dict[bytes | str, bytes | str] = {}
        if req.known_next_seq < 0:  # the segments are wanted: one read gives next with them
            fields = await self.r.hgetall(segs)
            stored_next = fields.get(b"next")
        else:
            stored_next = await self.r.hget(segs, "next")
        if stored_next is not None:
            nxt = int(stored_next)
        else:  # no call stored with its state: older stores' calls, or none
            seqs = await self.r.hkeys(self.calls_key(req.rollout_id, req.attempt))
            nxt = max(int(s) for s in seqs) + 1 if seqs else 0
        out = spb.GatewayState(next_seq=nxt)
        if req.known_next_seq < 0 or out.next_seq > req.known_next_seq:
            out.segments_sent = True
            if req.known_next_seq >= 0:
                fields = await self.r.hgetall(segs)
            records = sorted(((int(k), v) for k, v in fields.items() if _raw(k) != b"next"),
                             reverse=True)
            if records:
                raw = await self.r.hmget(self.calls_key(req.rollout_id, req.attempt),
                                         [seq for seq, _ in records])
                found = [(data, c.Call.FromString(_raw(call)))
                         for (_, data), call in zip(records, raw) if call is not None]
                # a state a later call extended is replaced, whether or not the gateway has
                # named it yet (it names what it let go a few at a time)
                extended = {call.extends_seq for _, call in found
                            if call.segment_start == c.SEGMENT_START_CONTINUED}
                for data, call in found:
                    if call.seq not in extended:
                        seg = out.segments.add()
                        seg.MergeFromString(_raw(data))
                        seg.ids = segment_ids(call)
        if req.response_id:
            deltas = [bytes(d) for d in await self._chain(keys=[gw],
                                                           args=[req.response_id, 100_000])]
            if deltas and deltas[0] == b"":  # an entry it leads to was dropped
                deltas = []
            if deltas:
                out.response_found = True
                parts = [d[1:-1].strip() for d in reversed(deltas)]
                out.messages_json = b"[" + b",".join(p for p in parts if p) + b"]"
        return out

    async def drop(self, rollout_id: str, attempt: int) -> None:
        """The attempt ended: the gateway's state of it goes (its calls stay)."""
        await self.r.delete(*self._keys(rollout_id, attempt)[1:])
