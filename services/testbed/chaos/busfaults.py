"""Bus faults at the client boundary: a NATS wire proxy between one component and nats-server.

Each component of the stack campaign (a reconciler, an agent, the watcher) connects to its own
proxy port; the proxy forwards the NATS protocol frame by frame and, under the seed's *weather*,
does to that component's traffic what a real network and a real server do to a client:

- ``delivery_lost``        a JetStream delivery never reaches the client (redelivered after ack-wait)
- ``delivery_duplicated``  a delivery reaches it twice
- ``ack_lost``             the client's ack never reaches the server (redelivery after it was handled)
- ``publish_lost``         a publish (input, log append, command, report) never reaches a stream
                           leader (as in a leader election): not stored, the client times out
- ``publish_response_lost`` a publish (input, log append, command, report, KV) is applied by the
                           server but its answer is lost: the client times out and retries
- ``api_response_lost``    the answer to a JetStream API request is lost (stream/consumer info, gets)
- ``publish_replayed``     a publish is sent again later, after the stream's dedupe window, by a
                           stale copy of the client (a retry that surfaced late)
- ``connection_reset``     the connection is cut at a frame boundary (the client reconnects)
- ``bus_cut``              every connection of the component is cut and reconnects are refused for
                           a while (a host cut off from the bus while its VMs keep running)

The scheduling knob is *jitter*: every frame the server sends may be held 0 to 25 ms, drawn from the
seed, which moves the components' relative order. Every draw comes from one ``random.Random`` per
(seed, component), consumed in frame order, so a frame's fate depends on the seed and its position
in the component's traffic — not on wall time. The traffic itself still depends on the OS's
scheduling of real processes: a run is seed-driven, not bit-for-bit reproducible.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

CONNECT_TIMEOUT_S = 5.0
REPLAY_CONNECT = b'CONNECT {"verbose":false,"pedantic":false,"headers":true,"name":"vmfence-chaos-replayer"}\r\n'


@dataclass(frozen=True)
class Weather:
    """Per-frame fault probabilities for one seed (all zero: calm, only forwarding)."""

    delivery_lost: float = 0.0
    delivery_duplicated: float = 0.0
    ack_lost: float = 0.0
    publish_lost: float = 0.0
    publish_response_lost: float = 0.0
    api_response_lost: float = 0.0
    publish_replayed: float = 0.0
    connection_reset: float = 0.0
    jitter_ms: tuple[int, ...] = (0,)
    replay_after_s: tuple[float, float] = (2.5, 5.0)

    @classmethod
    def draw(cls, rng: random.Random) -> Weather:
        """Some seeds calm, some stormy: each fault is on in about half the seeds, at a low rate."""

        def rate(hi: float) -> float:
            return rng.choice((0.0, 0.0, hi / 4, hi / 2, hi))

        return cls(
            delivery_lost=rate(0.1),
            delivery_duplicated=rate(0.1),
            ack_lost=rate(0.1),
            publish_lost=rate(0.05),
            publish_response_lost=rate(0.08),
            api_response_lost=rate(0.02),
            publish_replayed=rate(0.08),
            connection_reset=rate(0.01),
            jitter_ms=rng.choice(((0,), (0, 0, 0, 1, 5), (0, 1, 5, 25))),
        )


CALM = Weather()


@dataclass(frozen=True)
class Frame:
    op: bytes  # upper-case protocol op: MSG, HMSG, PUB, HPUB, PING, INFO, ...
    line: bytes  # the control line without CRLF
    payload: bytes = b""  # body incl. its trailing CRLF (messages only)

    @property
    def raw(self) -> bytes:
        return self.line + b"\r\n" + self.payload

    def fields(self) -> list[bytes]:
        return self.line.split()


async def read_frame(reader: asyncio.StreamReader) -> Frame:
    """One NATS protocol frame (control line, plus the body for PUB/HPUB/MSG/HMSG)."""
    line = (await reader.readuntil(b"\r\n"))[:-2]
    op = line.split(b" ", 1)[0].split(b"\t", 1)[0].upper()
    if op in (b"PUB", b"HPUB", b"MSG", b"HMSG"):
        size = int(line.split()[-1])
        return Frame(op, line, await reader.readexactly(size + 2))
    return Frame(op, line)


def message_subject_reply(frame: Frame) -> tuple[str, str | None]:
    """(subject, reply-to) of a PUB/HPUB (client) or MSG/HMSG (server) frame."""
    f = frame.fields()
    if frame.op == b"PUB":  # PUB subj [reply] size
        return f[1].decode(), f[2].decode() if len(f) == 4 else None
    if frame.op == b"HPUB":  # HPUB subj [reply] hdr total
        return f[1].decode(), f[2].decode() if len(f) == 5 else None
    if frame.op == b"MSG":  # MSG subj sid [reply] size
        return f[1].decode(), f[3].decode() if len(f) == 5 else None
    return f[1].decode(), f[3].decode() if len(f) == 6 else None  # HMSG subj sid [reply] hdr total


def without_reply(frame: Frame) -> bytes:
    """A client publish re-sent by someone who will not wait for its answer."""
    f = frame.fields()
    if frame.op == b"PUB":
        return b"PUB " + f[1] + b" " + f[-1] + b"\r\n" + frame.payload
    return b"HPUB " + f[1] + b" " + f[-2] + b" " + f[-1] + b"\r\n" + frame.payload


@dataclass
class BusProxy:
    """One component's door to nats-server. ``start()`` returns the URL to give the component."""

    component: str
    upstream: tuple[str, int]
    counts: Counter[str] = field(default_factory=Counter)
    on_fault: Callable[[str, str], None] = lambda component, kind: None

    url: str = field(default="", init=False)
    weather: Weather = field(default=CALM, init=False)
    rng: random.Random = field(default_factory=lambda: random.Random(0), init=False)
    _server: asyncio.Server | None = field(default=None, init=False)
    _conns: set[asyncio.Task[None]] = field(default_factory=set, init=False)
    _writers: set[asyncio.StreamWriter] = field(default_factory=set, init=False)
    _cut_until: float = field(default=0.0, init=False)
    _replays: asyncio.Queue[tuple[float, bytes]] = field(default_factory=asyncio.Queue, init=False)
    _replayer: asyncio.Task[None] | None = field(default=None, init=False)

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self._replayer = asyncio.create_task(self._replay_loop(), name=f"busfaults-replay-{self.component}")
        self.url = f"nats://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        return self.url

    def set_weather(self, seed: int, weather: Weather) -> None:
        self.weather = weather
        self.rng = random.Random(f"{seed}/{self.component}")

    def cut(self, seconds: float) -> None:
        """Drop every connection now and refuse new ones for ``seconds``."""
        self._cut_until = time.monotonic() + seconds
        self._hit("bus_cut")
        self._close_all()

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        self._close_all()
        tasks = [*self._conns, *([self._replayer] if self._replayer else [])]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 5.0)

    # ----------------------------------------------------------------------------- inside
    def _hit(self, kind: str) -> None:
        self.counts[kind] += 1
        self.on_fault(self.component, kind)

    def _close_all(self) -> None:
        for w in list(self._writers):
            w.close()

    def _accept(self, creader: asyncio.StreamReader, cwriter: asyncio.StreamWriter) -> None:
        task = asyncio.create_task(self._connection(creader, cwriter), name=f"busfaults-{self.component}")
        self._conns.add(task)
        task.add_done_callback(self._conns.discard)

    async def _connection(self, creader: asyncio.StreamReader, cwriter: asyncio.StreamWriter) -> None:
        self._writers.add(cwriter)
        swriter: asyncio.StreamWriter | None = None
        try:
            if time.monotonic() < self._cut_until:
                return
            sreader, swriter = await asyncio.wait_for(asyncio.open_connection(*self.upstream), CONNECT_TIMEOUT_S)
            self._writers.add(swriter)
            pending: dict[str, str] = {}  # reply inbox -> "publish" | "api", for the answers in flight
            async with asyncio.TaskGroup() as tg:
                tg.create_task(self._client_to_server(creader, swriter, pending))
                tg.create_task(self._server_to_client(sreader, cwriter, pending))
        except* (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, ValueError):
            pass  # either side went away: the other is closed below and the client reconnects
        finally:
            for w in (cwriter, swriter):
                if w is not None:
                    self._writers.discard(w)
                    w.close()

    async def _client_to_server(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, pending: dict[str, str]
    ) -> None:
        while True:
            frame = await read_frame(reader)
            if frame.op in (b"PUB", b"HPUB"):
                subject, reply = message_subject_reply(frame)
                w = self.weather
                if subject.startswith("$JS.ACK."):
                    if self.rng.random() < w.ack_lost:
                        self._hit("ack_lost")
                        continue
                elif subject.startswith("$JS.API."):
                    if reply is not None and ".CONSUMER.MSG.NEXT." not in subject:
                        pending[reply] = "api"
                elif reply is not None and not subject.startswith("_INBOX."):
                    if self.rng.random() < w.publish_lost:
                        self._hit("publish_lost")
                        continue
                    pending[reply] = "publish"
                    if self.rng.random() < w.publish_replayed:
                        delay = self.rng.uniform(*w.replay_after_s)
                        self._replays.put_nowait((time.monotonic() + delay, without_reply(frame)))
            if self.rng.random() < self.weather.connection_reset:
                self._hit("connection_reset")  # before it is forwarded: the client may retry it
                return
            writer.write(frame.raw)
            await writer.drain()

    async def _server_to_client(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, pending: dict[str, str]
    ) -> None:
        while True:
            frame = await read_frame(reader)
            if frame.op in (b"MSG", b"HMSG"):
                subject, reply = message_subject_reply(frame)
                w, draw = self.weather, self.rng.random()
                if reply is not None and reply.startswith("$JS.ACK."):  # a JetStream delivery
                    if draw < w.delivery_lost:
                        self._hit("delivery_lost")
                        continue
                    if draw < w.delivery_lost + w.delivery_duplicated:
                        self._hit("delivery_duplicated")
                        writer.write(frame.raw)
                elif (kind := pending.pop(subject, None)) is not None:
                    if draw < (w.publish_response_lost if kind == "publish" else w.api_response_lost):
                        self._hit(f"{kind}_response_lost")
                        continue
                jitter = self.rng.choice(w.jitter_ms)
                if jitter:
                    await asyncio.sleep(jitter / 1000)
            writer.write(frame.raw)
            await writer.drain()

    async def _replay_loop(self) -> None:
        """Re-send captured publishes when their time comes, on a connection of their own."""
        writer: asyncio.StreamWriter | None = None
        try:
            while True:
                due, raw = await self._replays.get()
                await asyncio.sleep(max(0.0, due - time.monotonic()))
                try:
                    if writer is None or writer.is_closing():
                        reader, writer = await asyncio.wait_for(
                            asyncio.open_connection(*self.upstream), CONNECT_TIMEOUT_S
                        )
                        await asyncio.wait_for(reader.readuntil(b"\r\n"), CONNECT_TIMEOUT_S)  # INFO
                        writer.write(REPLAY_CONNECT)
                    writer.write(raw)
                    await writer.drain()
                    self._hit("publish_replayed")
                except (OSError, TimeoutError, asyncio.IncompleteReadError):
                    writer = None  # the server is away: this replay is lost, as a real late retry can be
        finally:
            if writer is not None:
                writer.close()
