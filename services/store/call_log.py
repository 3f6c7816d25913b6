"""An attempt's calls and the gateway's state of them, appended by one Lua script per batch.

Keys (under the store's prefix P; k is the attempt):

- `P calls:{rollout_id}:{k}` HASH seq -> `Call` bytes.
- `P gw:{rollout_id}:{k}` HASH: `next` (1 + the highest seq stored), `s:{seq}` ->
  `SegmentRecord` bytes without its ids (calls a later turn may extend; the ids are the call's
  own prompt and completion ids, read from the call when the state is read), `o` (those seqs,
  most recent first, comma-separated, at most the gateway's `keep`), `r:{response_id}` -> the
  Responses chain entry (the previous response id, a newline, the JSON list of messages it
  adds).
- `P gwr:{rollout_id}:{k}` LIST of those response ids, most recent first, trimmed to the
  gateway's `keep_responses`: the state of an attempt is bounded as it is in a gateway's memory.

A call that starts or extends a segment costs five Redis commands (GET, HSETNX, HMGET, HSET,
HDEL), all in the one script.

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
-- Per call i: KEYS[4i-3..4i] = its rollout's state key, calls hash, gw hash, response list;
-- ARGV[10i-9..10i] = attempt, seq, call bytes, segment record ('' none), replaced seq ('' none),
-- keep, response id ('' none), chain entry, keep_responses, the bytes of the call not aborted
-- (an aborted one; else ''). ARGV[#ARGV] = ttl seconds of the gw keys.
-- Result per call: 1 stored, 0 duplicate, -1 unknown rollout, -2 attempt not running,
-- -3 conflict (its seq holds another call).
local out = {}
local ttl = tonumber(ARGV[#ARGV])
for i = 1, #KEYS / 4 do
  local st_key, calls_key, gw, resps = KEYS[4*i-3], KEYS[4*i-2], KEYS[4*i-1], KEYS[4*i]
  local a = 10 * (i - 1)
  local attempt, seq, data = ARGV[a+1], ARGV[a+2], ARGV[a+3]
  local st = redis.call('GET', st_key)
  if st ~= ('R' .. attempt) or redis.call('HSETNX', calls_key, seq, data) == 0 then
    local have = redis.call('HGET', calls_key, seq)
    if have then
      if have == data or (ARGV[a+10] ~= '' and have == ARGV[a+10]) then out[i] = 0
      else out[i] = -3 end
    elseif not st then out[i] = -1
    else out[i] = -2 end
  else
    local got = redis.call('HMGET', gw, 'next', 'o')
    local set, drop = {}, {}
    if not got[1] or tonumber(seq) + 1 > tonumber(got[1]) then
      set[#set + 1], set[#set + 2] = 'next', tonumber(seq) + 1
    end
    if ARGV[a+4] ~= '' then
      local replaced, keep, order = ARGV[a+5], tonumber(ARGV[a+6]), {seq}
      if replaced ~= '' then drop[#drop + 1] = 's:' .. replaced end
      for s in string.gmatch(got[2] or '', '[^,]+') do
        if s ~= replaced then
          if #order < keep then order[#order + 1] = s else drop[#drop + 1] = 's:' .. s end
        end
      end
      set[#set + 1], set[#set + 2] = 'o', table.concat(order, ',')
      set[#set + 1], set[#set + 2] = 's:' .. seq, ARGV[a+4]
    end
    if #set > 0 then redis.call('HSET', gw, unpack(set)) end
    if #drop > 0 then redis.call('HDEL', gw, unpack(drop)) end
    if not got[1] then redis.call('EXPIRE', gw, ttl) end
    if ARGV[a+7] ~= '' then
      redis.call('HSET', gw, 'r:' .. ARGV[a+7], ARGV[a+8])
      local n = redis.call('LPUSH', resps, ARGV[a+7])
      if n == 1 then redis.call('EXPIRE', resps, ttl) end
      for _ = 1, n - tonumber(ARGV[a+9]) do
        redis.call('HDEL', gw, 'r:' .. redis.call('RPOP', resps))
      end
    end
    out[i] = 1
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
        return f"{self.p}calls:{rollout_id}:{attempt}"

    def _gw_keys(self, rollout_id: str, attempt: int) -> tuple[str, str]:
        tail = f"{rollout_id}:{attempt}"
        return f"{self.p}gw:{tail}", f"{self.p}gwr:{tail}"

    async def append(self, calls: Sequence[c.Call], states: Sequence[spb.GatewayCallState]
                     ) -> list[int]:
        """Appends checked calls with their states (one round trip): per call 1 stored,
        0 duplicate, -1 unknown rollout, -2 attempt not running, -3 conflict."""
        keys: list[str] = []
        args: list[bytes | str | int] = []
        for i, call in enumerate(calls):
            state = states[i] if i < len(states) else _NO_STATE
            keys += [f"{self.p}st:{call.rollout_id}", self.calls_key(call.rollout_id,
                                                                       call.attempt),
                     *self._gw_keys(call.rollout_id, call.attempt)]
            segment = b""
            if state.segment:
                segment = spb.SegmentRecord(  # the ids are the call's: not stored twice
                    segment=call.segment, seq=call.seq,
                    n_messages=state.n_messages, digest=state.digest,
                    settings=state.settings).SerializeToString()
            args += [call.attempt, call.seq, call.SerializeToString(), segment,
                     state.replaces_seq if state.HasField("replaces_seq") else "",
                     max(1, state.keep), state.response_id,
                     state.previous_response_id.encode() + b"\n" + (state.messages_json or
                                                                     b"[]"),
                     max(1, state.keep_responses or 1024), _unaborted(call)]
        args.append(self.ttl_s)
        return [int(x) for x in await self._append(keys=keys, args=args)]

    async def gateway_state(self, req: spb.GetGatewayStateRequest) -> spb.GatewayState:
        gw = self._gw_keys(req.rollout_id, req.attempt)[0]
        stored_next, segs = await self.r.hmget(gw, ["next", "o"])
        if stored_next is not None:
            nxt = int(stored_next)
        else:  # no call stored with its state: older stores' calls, or none
            seqs = await self.r.hkeys(self.calls_key(req.rollout_id, req.attempt))
            nxt = max(int(s) for s in seqs) + 1 if seqs else 0
        out = spb.GatewayState(next_seq=nxt)
        if req.known_next_seq < 0 or out.next_seq > req.known_next_seq:
            out.segments_sent = True
            order = _raw(segs).decode().split(",") if segs else []
            if order:
                async with self.r.pipeline(transaction=False) as pipe:
                    pipe.hmget(gw, [f"s:{s}" for s in order])
                    pipe.hmget(self.calls_key(req.rollout_id, req.attempt), order)
                    records, calls = await pipe.execute()
                for data, call in zip(records, calls):
                    if data is not None and call is not None:
                        seg = out.segments.add()
                        seg.MergeFromString(_raw(data))
                        if not seg.ids:  # stored without them (they are the call's)
                            seg.ids = segment_ids(c.Call.FromString(_raw(call)))
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
        await self.r.delete(*self._gw_keys(rollout_id, attempt))
