"""The NATS client every service connects with: nats-py's, with leaner requests.

nats-py 2.16's ``request`` makes a random token per call (``secrets.token_hex``, a getrandom
system call) and waits for the reply under ``asyncio.wait_for`` (a wrapper future and a timer);
its ``JetStreamContext.publish`` adds ``json.loads`` and a dataclass for the ack: about 50 µs of
client CPU per message here. Every fenced append, command, observation, report and ``ack_sync`` is
such a request. ``BusClient.request`` and ``BusJetStream.publish`` keep their contracts -- the same
arguments, ``Msg`` and ``PubAck``, the same exceptions (``APIError`` with the server's err_code,
``NoStreamResponseError``, ``nats.errors.TimeoutError``) -- at about half the cost: a counter token
on nats-py's own reply subscription, one timer handle, msgspec for the ack (``vmfence bench
append`` measures both in one run). Where the nats-py internals they rest on are missing, a
request is nats-py's own.
"""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import msgspec
import nats.errors
import nats.js.errors
from nats.aio.client import NO_RESPONDERS_STATUS, Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext, api

# what the lean request uses of nats-py's request machinery (2.16): the reply mux subscription,
# its futures by token, and how its callback cuts the token out of the reply subject
_NATS_PY_INTERNALS = ("_resp_map", "_resp_sub_prefix", "_init_request_sub", "_request_sub_callback")


class _Ack(msgspec.Struct, frozen=True):
    """A JetStream publish answer: the ack, or the server's error."""

    stream: str = ""
    seq: int = 0
    duplicate: bool | None = None  # absent: None, as nats-py reports it
    domain: str | None = None
    error: dict[str, Any] | None = None


_decode_ack = msgspec.json.Decoder(_Ack).decode


def _expire(future: asyncio.Future[Msg]) -> None:
    if not future.done():
        future.set_exception(nats.errors.TimeoutError())


class BusClient(Client):
    """nats-py's client with ``request`` through ``request_reply``; ``jetstream()`` gives a
    ``BusJetStream``. Acks that wait for the server (``Msg.ack_sync``), key-value and JetStream API
    calls are requests too."""

    _tokens = itertools.count(1)  # reply tokens: digits, never a nats-py token (22 + 4 characters)

    def __init__(self) -> None:
        super().__init__()
        # nats-py has what ``request_reply`` uses (else every request is nats-py's own)
        self.lean = all(hasattr(self, name) for name in _NATS_PY_INTERNALS)

    def jetstream(self, **opts: Any) -> JetStreamContext:
        return BusJetStream(self, **opts)

    async def request(self, subject: str, payload: bytes = b"", timeout: float = 0.5,  # noqa: ASYNC109
                      old_style: bool = False, headers: dict[str, Any] | None = None) -> Msg:
        if old_style or not self.lean:
            return await super().request(subject, payload, timeout=timeout, old_style=old_style, headers=headers)
        msg = await self.request_reply(subject, payload, headers, timeout)
        if msg.headers and msg.headers.get(api.Header.STATUS) == NO_RESPONDERS_STATUS:
            raise nats.errors.NoRespondersError
        return msg

    async def request_reply(self, subject: str, payload: bytes, headers: dict[str, Any] | None,
                            timeout: float | None) -> Msg:  # noqa: ASYNC109 - per request, as nats-py's
        """nats-py's new-style request without its per-request random token and ``wait_for``: the
        reply comes through the same mux subscription, keyed by a counter, under one timer."""
        if self.is_draining_pubs:
            raise nats.errors.ConnectionDrainingError
        if not self._resp_sub_prefix:
            await self._init_request_sub()
        assert self._resp_sub_prefix is not None
        token = str(next(self._tokens))
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Msg] = loop.create_future()
        self._resp_map[token] = future
        # None waits for ever, as nats-py's wait_for(future, None) does
        timer = None if timeout is None else loop.call_later(timeout, _expire, future)
        try:
            await self.publish(subject, payload, reply=self._resp_sub_prefix.decode() + token, headers=headers)
            return await future
        finally:
            if timer is not None:
                timer.cancel()
            self._resp_map.pop(token, None)


class BusJetStream(JetStreamContext):
    """``publish`` through ``BusClient.request`` with the ack decoded by msgspec (see the module
    docstring)."""

    _nc: BusClient

    async def publish(
        self,
        subject: str,
        payload: bytes = b"",
        timeout: float | None = None,  # noqa: ASYNC109 - nats-py's signature
        stream: str | None = None,
        headers: dict[str, Any] | None = None,
        msg_ttl: float | None = None,
    ) -> api.PubAck:
        if msg_ttl is not None:
            return await super().publish(subject, payload, timeout=timeout, stream=stream, headers=headers,
                                         msg_ttl=msg_ttl)
        hdr = headers
        if stream is not None:
            hdr = dict(hdr or {})
            hdr[api.Header.EXPECTED_STREAM] = stream
        try:
            msg = await self._nc.request(subject, payload, timeout=self._timeout if timeout is None else timeout,
                                         headers=hdr)
        except nats.errors.NoRespondersError:
            raise nats.js.errors.NoStreamResponseError from None
        try:
            ack = _decode_ack(msg.data)
        except msgspec.DecodeError as exc:
            raise nats.js.errors.APIError(description=f"undecodable publish ack: {exc}") from None
        if ack.error is not None:
            raise nats.js.errors.APIError.from_error(ack.error)
        return api.PubAck(stream=ack.stream, seq=ack.seq, domain=ack.domain, duplicate=ack.duplicate)
