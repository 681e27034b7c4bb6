"""start_nats survives the free_port() race: a port it picked and another process bound meanwhile."""

from __future__ import annotations

import socket

import pytest

from services.testbed import natsserver


async def test_a_port_taken_between_pick_and_bind_is_picked_again(monkeypatch: pytest.MonkeyPatch) -> None:
    squatter = socket.socket()
    squatter.bind(("127.0.0.1", 0))
    squatter.listen()
    taken = squatter.getsockname()[1]
    real = natsserver.free_port
    picks = iter([taken])
    monkeypatch.setattr(natsserver, "free_port", lambda: next(picks, None) or real())
    try:
        server = await natsserver.start_nats()
        try:
            assert taken not in (server.port, server.http_port)
        finally:
            await server.stop()
    finally:
        squatter.close()
