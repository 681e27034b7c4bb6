"""A durable pull consumer kept fed: its pull requests stand on the server ahead of need.

nats-py's ``fetch`` sends a no-wait pull request per call, and the server answers each with the
messages it has and a 404 status; when it has none, a second, lingering request follows and ends in
a 408. At the rate one partition sees, a call returns one or two inputs, so every input paid for about
one request and one status besides its delivery and its ack. A feed asks for a window of messages at
a time, with a long expiry and idle heartbeats, and asks again when half of it has arrived: an input
then costs its delivery and its ack, and an idle consumer one heartbeat a second.

The window bounds what the server may hand us before we take it (requested and not arrived, plus
arrived and not taken), so nothing waits in our buffer long enough for its ack_wait to run out.
Requests lost with a server (a restart, a reconnect to another node, a leader change) are noticed by
the missing heartbeats or a 409 and asked for again.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import deque

import nats.errors
import nats.js.errors
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext, api

log = logging.getLogger(__name__)

PULL_EXPIRES_S = 30.0  # one standing pull request's life on the server
PULL_HEARTBEAT_S = 1.0  # the server's idle heartbeat for a standing request


class PullFeedError(nats.errors.Error):
    """The consumer cannot be pulled from (deleted, no responders, a refused request)."""


async def ensure_durable(js: JetStreamContext, stream: str, config: api.ConsumerConfig) -> None:
    """Create durable consumer ``config.durable_name`` unless it exists (an existing one is kept as it
    is, as nats-py's pull_subscribe does)."""
    assert config.durable_name
    try:
        await js._jsm.consumer_info(stream, config.durable_name)
        return
    except nats.js.errors.NotFoundError:
        pass
    await js._jsm.add_consumer(stream, config=config)


class PullFeed:
    """Messages of durable pull consumer ``consumer`` on ``stream``, in delivery order.

    ``take`` returns what has arrived (at least one message) or raises TimeoutError. The caller acks
    each message as before; the feed only replaces how they are asked for.
    """

    def __init__(self, js: JetStreamContext, stream: str, consumer: str, *, window: int = 256,
                 expires_s: float = PULL_EXPIRES_S, heartbeat_s: float = PULL_HEARTBEAT_S) -> None:
        if window < 1:
            raise ValueError("window must be at least 1")
        if expires_s <= 2 * heartbeat_s:
            raise ValueError("expires_s must exceed twice heartbeat_s (the server refuses otherwise)")
        self._js = js
        self._nc = js._nc
        self._next_subject = f"{js._prefix}.CONSUMER.MSG.NEXT.{stream}.{consumer}"  # honours domains
        self._what = f"{stream}/{consumer}"
        self._window = window
        self._expires_ns = int(expires_s * 1e9)
        self._heartbeat_ns = int(heartbeat_s * 1e9)
        self._silent_s = 3 * heartbeat_s  # nothing heard for this long: our requests are gone
        self._buf: deque[Msg] = deque()
        self._wake = asyncio.Event()
        self._owed = 0  # requested and neither arrived nor ended by a status
        self._heard = time.monotonic()  # any message or status
        self._error: PullFeedError | None = None
        self._inbox = self._nc.new_inbox()
        self._sub: Subscription | None = None
        self.requests = 0  # pull requests sent (tests and metrics)

    async def start(self) -> PullFeed:
        self._sub = await self._nc.subscribe(self._inbox, cb=self._on_msg, pending_msgs_limit=4 * self._window + 64)
        await self._top_up()
        return self

    async def close(self) -> None:
        """Unsubscribe. The server drops a standing request whose reply subject lost its interest."""
        sub, self._sub = self._sub, None
        if sub is not None:
            try:
                await sub.unsubscribe()
            except nats.errors.Error:
                pass

    async def __aenter__(self) -> PullFeed:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def take(self, limit: int, wait_s: float) -> list[Msg]:
        """Up to ``limit`` messages that have arrived, waiting up to ``wait_s`` for the first."""
        deadline = time.monotonic() + wait_s
        while not self._buf:
            if self._error is not None:
                raise self._error
            self._wake.clear()
            await self._top_up()  # a request that ended unfilled is replaced here
            left = deadline - time.monotonic()
            try:
                await asyncio.wait_for(self._wake.wait(), min(left, self._silent_s))
            except TimeoutError:
                if time.monotonic() - self._heard >= self._silent_s:
                    log.debug("pull feed %s: nothing heard for %.1fs; asking again", self._what, self._silent_s)
                    self._owed = 0
                    self._heard = time.monotonic()
                    await self._top_up()
                if time.monotonic() >= deadline:
                    raise TimeoutError from None
        out: list[Msg] = []
        buf = self._buf
        while buf and len(out) < limit:
            out.append(buf.popleft())
        await self._top_up()
        return out

    async def _top_up(self) -> None:
        """Ask for the rest of the window once half of it is spent."""
        if self._sub is None:
            return
        free = self._window - self._owed - len(self._buf)
        if free < max(1, self._window // 2):
            return
        req = {"batch": free, "expires": self._expires_ns, "idle_heartbeat": self._heartbeat_ns}
        self._owed += free
        self.requests += 1
        try:
            await self._nc.publish(self._next_subject, json.dumps(req).encode(), reply=self._inbox)
        except nats.errors.Error:
            self._owed -= free  # not sent (closing, reconnecting): the silence check asks again

    async def _on_msg(self, msg: Msg) -> None:
        self._heard = time.monotonic()
        if msg.reply:  # a stored message
            self._owed = max(0, self._owed - 1)
            self._buf.append(msg)
            self._wake.set()
            return
        headers = msg.headers or {}
        status = headers.get("Status", "")
        if status == "100":  # idle heartbeat: our requests stand
            return
        if status in ("404", "408"):  # a request ended; this many of it were never filled
            unfilled = headers.get("Nats-Pending-Messages")
            self._owed = max(0, self._owed - int(unfilled)) if unfilled and unfilled.isdigit() else 0
            self._wake.set()  # take() tops up
            return
        description = headers.get("Description", "")
        if status == "409" and "Leadership Change" in description:
            self._owed = 0  # the new leader knows none of our requests: ask again
            self._wake.set()
            return
        if status == "409" and "Exceeded MaxWaiting" in description:
            self._owed = 0  # refused, not ended: asked again at the next take (no wake, no storm)
            return
        self._error = PullFeedError(f"pull from {self._what}: {status} {description}".strip())
        self._wake.set()
