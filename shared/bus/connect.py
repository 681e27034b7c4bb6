"""Connecting to NATS with service-grade reconnects, and the Bus holder passed around.

Who a process is on NATS travels as one :class:`NatsAuth` (user/password, creds file, nkey seed
file, TLS CA/client certificate), read from the shared configuration (``shared.config``). A server
that refuses the credentials ends the initial connect at once with :class:`NatsAuthError`: a wrong
password does not heal by retrying. URLs are shown only through :func:`mask_url`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import ssl
from dataclasses import dataclass, field
from typing import Any

import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.js import JetStreamContext

from shared.bus.client import BusClient
from shared.subjects import Subjects
from shared.tasks import cancel_and_wait

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 5.0
RECONNECT_WAIT_S = 1.0
PING_INTERVAL_S = 5  # a dead server is noticed after PING_INTERVAL_S * MAX_OUTSTANDING_PINGS
MAX_OUTSTANDING_PINGS = 3
_URL_USERINFO = re.compile(r"://(?:(?P<user>[^:/@\s,]*):[^@\s,/]*|[^:/@\s,]*)@")


def mask_url(url: str) -> str:
    """``nats://user:secret@host`` → ``nats://user:***@host``; ``nats://token@host`` (nats-py takes a
    bare user as a token) → ``nats://***@host``; every URL of a comma-separated list."""
    return _URL_USERINFO.sub(lambda m: "://***@" if m.group("user") is None else f"://{m.group('user')}:***@", url)


class NatsAuthError(nats.errors.AuthorizationError):
    """The server refused this identity; the message is one line for the operator (no secret in it)."""

    def __init__(self, message: str) -> None:
        super().__init__()
        self.message = message

    def __str__(self) -> str:
        return self.message


@dataclass(frozen=True)
class NatsAuth:
    """Who this process is on NATS, and how it checks the servers. All optional: none given is an
    anonymous plain-text connection (development only)."""

    user: str | None = None
    password: str | None = None
    creds: str | None = None  # a .creds file (JWT + nkey seed)
    nkey: str | None = None  # an nkey seed file
    token: str | None = None
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None

    def __repr__(self) -> str:  # never a secret in a log line or a traceback
        shown = {k: v for k, v in (("user", self.user), ("creds", self.creds), ("nkey", self.nkey),
                                   ("tls_ca", self.tls_ca), ("tls_cert", self.tls_cert)) if v}
        if self.password:
            shown["password"] = "***"
        if self.token:
            shown["token"] = "***"
        return f"NatsAuth({', '.join(f'{k}={v}' for k, v in shown.items())})"

    @property
    def who(self) -> str:
        """The identity as an error names it."""
        if self.user:
            return f"user {self.user!r}"
        if self.creds:
            return f"creds {self.creds}"
        if self.nkey:
            return f"nkey {self.nkey}"
        return "token" if self.token else "no credentials"

    def tls_context(self) -> ssl.SSLContext | None:
        """A context when a CA or client certificate is configured; else nats-py's default for tls:// URLs."""
        if not (self.tls_ca or self.tls_cert):
            return None
        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=self.tls_ca)
        if self.tls_cert:
            ctx.load_cert_chain(self.tls_cert, self.tls_key)
        return ctx

    def options(self) -> dict[str, Any]:
        """Keyword arguments of ``Client.connect`` for this identity."""
        opts: dict[str, Any] = {}
        if self.user is not None:
            opts.update(user=self.user, password=self.password)
        if self.creds:
            opts["user_credentials"] = self.creds
        if self.nkey:
            opts["nkeys_seed"] = self.nkey
        if self.token:
            opts["token"] = self.token
        tls = self.tls_context()
        if tls is not None:
            opts["tls"] = tls
        return opts


def _is_refusal(exc: Exception) -> bool:
    """The server refused the credentials. At the initial connect nats-py 2.16 reports the server's
    ``-ERR 'Authorization Violation'`` as a plain ``nats.errors.Error``, later as AuthorizationError."""
    return isinstance(exc, nats.errors.AuthorizationError) or "authorization violation" in str(exc).lower()


async def _on_error(exc: Exception) -> None:
    log.warning("nats error: %r", exc)


async def _on_disconnected() -> None:
    log.info("nats disconnected")  # also on every clean close; a real outage shows up as errors


async def _on_reconnected() -> None:
    log.info("nats reconnected")


async def connect(
    url: str | list[str],
    *,
    name: str,
    auth: NatsAuth | None = None,
    timeout: float = CONNECT_TIMEOUT_S,  # noqa: ASYNC109 - the connect timeout nats-py takes
    max_reconnect_attempts: int = -1,
    reconnect_time_wait: float = RECONNECT_WAIT_S,
) -> Client:
    """Connect with service-grade reconnects (default: forever, -1) and fast dead-peer detection.

    Raises NatsAuthError as soon as a server refuses the credentials of the initial connect."""
    auth = auth or NatsAuth()
    servers = [url] if isinstance(url, str) else list(url)
    refused = asyncio.Event()
    connected = False

    seen: set[str] = set()

    async def on_error(exc: Exception) -> None:
        if connected:
            await _on_error(exc)
        elif _is_refusal(exc):
            refused.set()  # the server answered: retrying the same credentials cannot help
        elif repr(exc) not in seen:  # the caller reports the outcome; each cause once, no storm
            seen.add(repr(exc))
            log.info("nats connect attempt failed: %r (retrying)", exc)

    nc = BusClient()
    attempt = asyncio.ensure_future(nc.connect(
        servers=servers,
        name=name,
        connect_timeout=timeout,  # type: ignore[arg-type,unused-ignore]  # annotated int, float works
        allow_reconnect=True,
        max_reconnect_attempts=max_reconnect_attempts,
        reconnect_time_wait=reconnect_time_wait,  # type: ignore[arg-type,unused-ignore]
        ping_interval=PING_INTERVAL_S,
        max_outstanding_pings=MAX_OUTSTANDING_PINGS,
        error_cb=on_error,
        disconnected_cb=_on_disconnected,
        reconnected_cb=_on_reconnected,
        **auth.options(),
    ))
    waiter = asyncio.ensure_future(refused.wait())
    try:
        await asyncio.wait({attempt, waiter}, return_when=asyncio.FIRST_COMPLETED)
    finally:  # also when this connect is itself cancelled: the attempt ends with it
        waiter.cancel()
        await cancel_and_wait([attempt], what="nats connect")  # nats-py may swallow one cancel
    if refused.is_set() and not nc.is_connected:
        with contextlib.suppress(Exception):
            await nc.close()
        where = ",".join(mask_url(s) for s in servers)
        raise NatsAuthError(f"NATS at {where} refused {auth.who}: authorization violation "
                            "(wrong user, password or credentials?)")
    attempt.result()  # raises the connect error
    connected = True
    return nc


@dataclass
class Bus:
    """A connection, its JetStream context and the deployment's subjects, passed around together."""

    nc: Client
    js: JetStreamContext
    subjects: Subjects = field(default_factory=Subjects)

    @classmethod
    async def open(
        cls,
        url: str | list[str],
        *,
        name: str,
        subjects: Subjects | None = None,
        max_reconnect_attempts: int = -1,
        auth: NatsAuth | None = None,
    ) -> Bus:
        nc = await connect(url, name=name, max_reconnect_attempts=max_reconnect_attempts, auth=auth)
        return cls(nc=nc, js=nc.jetstream(), subjects=subjects or Subjects())

    async def close(self) -> None:
        if not self.nc.is_closed:
            await self.nc.close()
