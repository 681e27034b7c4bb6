"""A LocalStack whose start fails half-way (here: an agent's configuration is refused after
nats-server, the reconcilers and the development API server are up) stops what it started and
releases its directory before the error reaches the caller: no orphan nats-server or reconciler,
and the next stack in the same directory starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.testbed.stack import LocalStack
from shared.config import ConfigError


async def test_a_failed_start_leaves_no_process_and_frees_the_directory(tmp_path: Path) -> None:
    stack = LocalStack(tmp_path / "stack", runtime="sim", partitions=2, accel="bogus")
    with pytest.raises(ConfigError, match="accel"):
        await stack.start()
    assert stack.nats is not None and stack.nats._proc is None, "nats-server left running"
    assert all(rp.proc is not None and rp.proc.poll() is not None for rp in stack.recs.values()), \
        "a reconciler left running"
    again = LocalStack(tmp_path / "stack", runtime="sim", partitions=2)
    try:
        await again.start()  # the directory's lock was released
    finally:
        await again.stop()
