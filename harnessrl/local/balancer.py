"""A TCP balancer for gateway replicas on one machine, as a Kubernetes Service is in front of
a Deployment's pods (`Stack` with `gateway_replicas` > 1; the replica tests): a proxy on port 0
that sends each new connection to the next backend in turn, and to the one after it when a
backend refuses the connection (a replica restarting), so a client that opens a connection per
request reaches the replicas alternately and never a stopped one. Works for HTTP and gRPC
alike (a gRPC channel's connection goes to one backend until it breaks). Runs its own event
loop in a thread.
"""

from __future__ import annotations

import asyncio
import threading
from collections import Counter


class Balancer:
    def __init__(self, backends: list[tuple[str, int]]) -> None:
        self.backends = backends
        self.connections: Counter[int] = Counter()  # backend index -> connections sent there
        self.order: list[int] = []  # backend index of each connection, in order
        self.refused: Counter[int] = Counter()  # backend index -> connections it refused
        self._next = 0
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.port = 0

    def start(self) -> "Balancer":
        self._thread.start()
        self._started.wait(10)
        return self

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        server = self._loop.run_until_complete(
            asyncio.start_server(self._handle, "127.0.0.1", 0))
        self.port = server.sockets[0].getsockname()[1]
        self._started.set()
        self._loop.run_forever()
        server.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        first = self._next
        self._next = (self._next + 1) % len(self.backends)
        for step in range(len(self.backends)):
            index = (first + step) % len(self.backends)
            try:
                up_reader, up_writer = await asyncio.open_connection(*self.backends[index])
                break
            except OSError:
                self.refused[index] += 1
        else:
            writer.close()
            return
        self.connections[index] += 1
        self.order.append(index)

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                dst.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
