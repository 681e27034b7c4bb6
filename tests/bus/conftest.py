"""Fixtures for the bus tests: provisioned streams on the per-test server."""

from __future__ import annotations

import pytest
from nats.js import JetStreamContext

from shared.bus.provision import StreamsConfig, provision
from shared.subjects import Subjects

LEASE_TTL_S = 1.5


@pytest.fixture
def subjects() -> Subjects:
    return Subjects()


@pytest.fixture
async def provisioned(js: JetStreamContext, subjects: Subjects) -> JetStreamContext:
    """Streams and buckets provisioned (R1, file) with a short lease TTL for expiry tests."""
    await provision(js, subjects, StreamsConfig(lease_ttl_s=LEASE_TTL_S, hosts_ttl_s=2.0))
    return js
