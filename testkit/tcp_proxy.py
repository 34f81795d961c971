"""A loopback TCP proxy that can cut every connection through it on command (no torch).

``TcpProxy(target_port).start()`` listens on 127.0.0.1 (``.port``) and forwards each accepted
connection to ``127.0.0.1:target_port`` on an asyncio loop of its own thread. ``cut()`` aborts
every open connection on both sides (a RST, as a network that drops a flow looks to both ends)
and ``cut(block_s=S)`` also refuses new ones for S seconds (a partition). Connections made while
the target does not listen are closed at once. For the chaos benchmark (``benchmarks/chaos.py``):
engines publish through it to the collector, so a cut is a network fault, not a process's.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time


class TcpProxy:
    def __init__(
        self, target_port: int, *, target_host: str = "127.0.0.1", listen_port: int = 0
    ) -> None:
        self.target_host = target_host
        self.target_port = target_port
        self._listen_port = listen_port
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.Server | None = None
        self._thread: threading.Thread | None = None
        self._conns: set[tuple[asyncio.StreamWriter, asyncio.StreamWriter]] = set()
        self._blocked_until = 0.0
        self.accepted = 0  # connections forwarded to the target
        self.refused = 0  # connections closed at once (blocked, or the target did not answer)
        self.cuts = 0
        self.connections_cut = 0

    @property
    def port(self) -> int:
        assert self._server is not None, "start() first"
        return int(self._server.sockets[0].getsockname()[1])

    @property
    def open_connections(self) -> int:
        return len(self._conns)

    def start(self) -> TcpProxy:
        ready = threading.Event()
        errors: list[BaseException] = []

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            try:
                self._server = loop.run_until_complete(
                    asyncio.start_server(self._handle, "127.0.0.1", self._listen_port)
                )
            except BaseException as exc:  # reported to start()'s caller
                errors.append(exc)
                ready.set()
                loop.close()
                return
            ready.set()
            loop.run_forever()
            loop.close()

        self._thread = threading.Thread(target=run, name="tcp-proxy", daemon=True)
        self._thread.start()
        ready.wait(30)
        if errors or self._server is None:
            raise RuntimeError(f"the proxy did not start: {errors[:1]}")
        return self

    def _call(self, fn, timeout: float = 30.0):  # type: ignore[no-untyped-def]
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(fn(), self._loop).result(timeout)

    def cut(self, block_s: float = 0.0) -> int:
        """Abort every open connection (both sides); refuse new ones for ``block_s`` seconds.
        Returns how many connections were cut."""

        async def _cut() -> int:
            self._blocked_until = time.monotonic() + block_s
            pairs = list(self._conns)
            self._conns.clear()
            for a, b in pairs:
                for w in (a, b):
                    w.transport.abort()
            return len(pairs)

        n = int(self._call(_cut))
        self.cuts += 1
        self.connections_cut += n
        return n

    def stop(self) -> None:
        if self._loop is None or self._thread is None:
            return

        async def _stop() -> None:
            assert self._server is not None
            self._server.close()
            for a, b in list(self._conns):
                a.transport.abort()
                b.transport.abort()
            self._conns.clear()

        with contextlib.suppress(Exception):
            self._call(_stop, 10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._thread = None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if time.monotonic() < self._blocked_until:
            self.refused += 1
            writer.transport.abort()
            return
        try:
            up_reader, up_writer = await asyncio.wait_for(
                asyncio.open_connection(self.target_host, self.target_port), 5.0
            )
        except (OSError, TimeoutError):
            self.refused += 1
            writer.transport.abort()
            return
        self.accepted += 1
        pair = (writer, up_writer)
        self._conns.add(pair)
        try:
            await asyncio.gather(
                self._pipe(reader, up_writer), self._pipe(up_reader, writer), return_exceptions=True
            )
        finally:
            self._conns.discard(pair)
            for w in pair:
                w.transport.abort()

    @staticmethod
    async def _pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        try:
            while data := await src.read(65536):
                dst.write(data)
                await dst.drain()
        except OSError:  # reset or aborted: reset the other side as well
            dst.transport.abort()
            return
        # one side finished: end the other side's writes (half-close), as TCP would
        with contextlib.suppress(OSError, RuntimeError):
            if dst.can_write_eof():
                dst.write_eof()
