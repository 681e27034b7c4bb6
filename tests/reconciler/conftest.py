"""Fixtures for the reconciler's tests on a real nats-server."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from services.testbed.natsserver import NatsServer
from shared.bus.connect import Bus
from shared.bus.provision import StreamsConfig, provision
from shared.subjects import Subjects


@pytest.fixture
async def bus(nats_server: NatsServer) -> AsyncIterator[Bus]:
    """A client on streams of one partition (every key's inputs and log in partition 0)."""
    b = await Bus.open(nats_server.url, name="test", subjects=Subjects(partitions=1))
    await provision(b.js, b.subjects, StreamsConfig(partitions=1))
    yield b
    await b.close()
