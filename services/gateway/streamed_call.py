"""A streamed response on its way to the harness: the engine's events relayed as they arrive
(`StreamedCall`, an `http_server.StreamBody`), rendered in the harness's API (`EventRenderer`:
`OpenAIEvents` here, the Messages and Responses renderers in `anthropic.py` and
`responses.py`), the call recorded before the final event."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any, Protocol

import orjson

from harnessrl.v1 import common_pb2 as c
from services.gateway.engines import EngineRegistry, Lease
from services.gateway.exchange import Exchange, HTTPError, engine_refused
from services.gateway.recording import Recording
from services.gateway.streaming import DONE, Generated, SSEDecoder, strip_chunk
from services.gateway.upstream import UpstreamError, UpstreamStream


class CallSink(Protocol):
    """What a stream needs of the data plane (`app.GatewayApp`): making the call, recording
    it, giving the engine back."""

    recording: Recording
    registry: EngineRegistry

    async def record(self, ex: Exchange, call: c.Call) -> None: ...

    def record_later(self, ex: Exchange, call: c.Call) -> None: ...


class EventRenderer(Protocol):
    """Turns the engine's stream (chat or completion chunks) into one API's events."""

    def chunk(self, chunk: dict[str, Any], gen: Generated) -> bytes: ...

    def finish(self, gen: Generated) -> bytes: ...  # after the call is recorded

    def error(self, err: HTTPError) -> bytes: ...


class OpenAIEvents:
    """OpenAI's own stream: the engine's chunks, without what the gateway added, then
    `data: [DONE]` once the call is recorded."""

    def __init__(self, keep_ids: bool, keep_logprobs: bool) -> None:
        self.keep_ids, self.keep_logprobs = keep_ids, keep_logprobs

    def chunk(self, chunk: dict[str, Any], gen: Generated) -> bytes:
        return b"data: " + orjson.dumps(strip_chunk(chunk, self.keep_ids, self.keep_logprobs)) \
            + b"\n\n"

    def finish(self, gen: Generated) -> bytes:
        return b"data: [DONE]\n\n"

    def error(self, err: HTTPError) -> bytes:
        return b"data: " + err.body("openai") + b"\n\n"


class StreamedCall:
    """A streamed response (`http_server.StreamBody`): relays the engine's events as they
    arrive, records the call, then sends the final event. If the stream does not complete (the
    client went away, the engine failed) the call is recorded as aborted."""

    def __init__(self, app: CallSink, ex: Exchange, lease: Lease, version: int,
                 t0: float, upstream: UpstreamStream, events: EventRenderer) -> None:
        self.app, self.ex, self.lease, self.version, self.t0 = app, ex, lease, version, t0
        self.engine = lease.engine
        self.upstream, self.events = upstream, events
        self.gen = Generated(ex.chat)
        self.complete = False  # the engine's stream ended normally
        self.delivered = False  # the call is recorded and the final event sent
        self.closed = False
        self._iter: AsyncIterator[bytes] | None = None
        self.call: c.Call | None = None

    def __aiter__(self) -> AsyncIterator[bytes]:
        self._iter = self._relay()
        return self._iter

    async def _relay(self) -> AsyncIterator[bytes]:
        decoder, gen, events = SSEDecoder(), self.gen, self.events
        try:
            while (data := await self.upstream.read()) is not None:
                out = []
                for payload in decoder.feed(data):
                    if payload == DONE:
                        continue
                    chunk = orjson.loads(payload)
                    if "error" in chunk and "choices" not in chunk:
                        raise engine_refused(self.engine.name, 502, payload)
                    gen.add(chunk)
                    out.append(events.chunk(chunk, gen))
                if out:
                    yield b"".join(out)
        except HTTPError as err:
            yield events.error(err)
            return
        except (UpstreamError, asyncio.TimeoutError, orjson.JSONDecodeError) as err:
            yield events.error(HTTPError(502, f"engine {self.engine.name} failed mid-stream: "
                                              f"{type(err).__name__}: {err}", "server_error",
                                         "engine_error"))
            return
        self.complete = True
        if problem := gen.problem():
            yield events.error(HTTPError(502, problem, "server_error", "engine_error"))
            return
        call = self.app.recording.call(self.ex, gen, self.engine, self.version,
                              time.perf_counter() - self.t0)
        self.call = call
        try:
            await self.app.record(self.ex, call)
        except HTTPError as err:
            yield events.error(err)
            return
        self.delivered = True
        yield events.finish(gen)

    async def aclose(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            if self._iter is not None:
                await self._iter.aclose()  # type: ignore[attr-defined]
        finally:
            self.upstream.close()
            self.app.registry.release(self.lease, self.complete)
            if not self.delivered and self.gen.prompt_ids is not None:
                # Never half-recorded: what the harness may have seen is kept, marked aborted
                # (the trainer skips it); a complete call whose recording was cut short keeps
                # its seq, so the store holds one version of it.
                call = self.call
                if call is None:
                    aborted = self.app.recording.call(self.ex, self.gen, self.engine, self.version,
                                             time.perf_counter() - self.t0, aborted=True)
                else:
                    aborted = c.Call()
                    aborted.CopyFrom(call)
                    aborted.aborted = True
                self.app.record_later(self.ex, aborted)
