"""Connecting to NATS with service-grade reconnects, and the Bus holder passed around."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.js import JetStreamContext

from shared.subjects import Subjects

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 5.0
RECONNECT_WAIT_S = 1.0
PING_INTERVAL_S = 5  # a dead server is noticed after PING_INTERVAL_S * MAX_OUTSTANDING_PINGS
MAX_OUTSTANDING_PINGS = 3



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
    user: str | None = None,
    password: str | None = None,
    creds: str | None = None,
    token: str | None = None,
    timeout: float = CONNECT_TIMEOUT_S,  # noqa: ASYNC109 - the connect timeout nats-py takes
    max_reconnect_attempts: int = -1,
    reconnect_time_wait: float = RECONNECT_WAIT_S,
) -> Client:
    """Connect with service-grade reconnects (default: forever, -1) and fast dead-peer detection."""
    servers = [url] if isinstance(url, str) else list(url)
    nc: Client = await nats.connect(
        servers=servers,
        name=name,
        user=user,
        password=password,
        user_credentials=creds,
        token=token,
        connect_timeout=timeout,  # type: ignore[arg-type,unused-ignore]  # annotated int, float works
        allow_reconnect=True,
        max_reconnect_attempts=max_reconnect_attempts,
        reconnect_time_wait=reconnect_time_wait,  # type: ignore[arg-type,unused-ignore]
        ping_interval=PING_INTERVAL_S,
        max_outstanding_pings=MAX_OUTSTANDING_PINGS,
        error_cb=_on_error,
        disconnected_cb=_on_disconnected,
        reconnected_cb=_on_reconnected,
    )
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
        user: str | None = None,
        password: str | None = None,
        creds: str | None = None,
        token: str | None = None,
    ) -> Bus:
        nc = await connect(
            url,
            name=name,
            max_reconnect_attempts=max_reconnect_attempts,
            user=user,
            password=password,
            creds=creds,
            token=token,
        )
        return cls(nc=nc, js=nc.jetstream(), subjects=subjects or Subjects())

    async def close(self) -> None:
        if not self.nc.is_closed:
            await self.nc.close()
