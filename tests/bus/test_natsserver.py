"""The embedded nats-server launcher: start, stop, kill/restart with the same port and store."""

from __future__ import annotations

import os

import pytest

from services.testbed.natsserver import NatsServer, NatsServerError, free_port, nats_server_binary, start_nats
from shared.bus.connect import connect


def isdir(path: str) -> bool:
    return os.path.isdir(path)


def isfile(path: str | os.PathLike[str]) -> bool:
    return os.path.isfile(path)


def test_binary_found(nats_binary: str) -> None:
    assert os.access(nats_binary, os.X_OK)
    assert nats_server_binary() == nats_binary


def test_free_port_is_bindable() -> None:
    port = free_port()
    assert 0 < port < 65536


async def test_temp_store_removed_on_stop() -> None:
    server = await start_nats()
    store = server.store_dir
    assert isdir(store)
    assert isfile(server.log_path)
    await server.stop()
    assert not isdir(store)
    assert not server.running


async def test_given_store_kept(tmp_path: os.PathLike[str]) -> None:
    store = os.path.join(tmp_path, "nats")
    async with await start_nats(store_dir=store) as server:
        assert server.url.startswith("nats://127.0.0.1:")
    assert isdir(os.path.join(store, "jetstream"))


async def test_kill_restart_keeps_port_and_data(nats_server: NatsServer) -> None:
    nc = await connect(nats_server.url, name="t", max_reconnect_attempts=-1)
    try:
        js = nc.jetstream()
        await js.add_stream(name="S", subjects=["s.>"])
        ack = await js.publish("s.1", b"hello", timeout=5)
        url = nats_server.url
        nats_server.kill()
        assert not nats_server.running
        await nats_server.restart()
        assert nats_server.url == url
        # The client reconnects by itself; the file store survived SIGKILL.
        msg = await js.get_last_msg("S", "s.1")
        assert msg.seq == ack.seq and msg.data == b"hello"
    finally:
        await nc.close()


async def test_failed_start_reports_log() -> None:
    server = None
    with pytest.raises(NatsServerError) as info:
        server = await start_nats(config_text="this is { not valid")
    assert server is None
    assert "exited" in str(info.value)


async def test_stop_is_idempotent(nats_server: NatsServer) -> None:
    await nats_server.stop()
    await nats_server.stop()
    assert not nats_server.running
