"""A health endpoint whose port is taken says so (the reconciler printed "cannot reach NATS" for it,
which sent a reader after the wrong cause)."""

from __future__ import annotations

import errno
import socket

import pytest

from shared.httpserve import HealthServer, ListenError


async def test_a_taken_port_is_a_listen_error_naming_the_address() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        server = HealthServer(host="127.0.0.1", port=port, ready=lambda: True)
        with pytest.raises(ListenError, match=f"cannot listen on 127.0.0.1:{port}") as caught:
            await server.start()
        assert caught.value.errno == errno.EADDRINUSE
