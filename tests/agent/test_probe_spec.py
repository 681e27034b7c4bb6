"""Probes from the pod spec (issue 12 §2), run by the agent's Prober against the VM's address in the
ledger — here a real HTTP server and a real TCP port on loopback standing in for the guest: the
timing fields are honoured, exec is not run, and a result keeps its fence (rule 4)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp import web

from services.agent.ledger import Ledger, VMRow
from services.agent.probes import Prober, Streak, check
from services.agent.runtime import RuntimeDriver, VMSpec, make_driver
from shared.fence.podspec import spec_of_pod
from shared.fence.schema import Fence, Probe, ProbeChanged, Spec

from .conftest import fence

VM = "vm-spec"


class Guest:
    """An HTTP server on loopback whose /healthz answer the test switches."""

    def __init__(self) -> None:
        self.healthy = True
        self.port = 0
        self._runner: web.AppRunner | None = None

    async def _health(self, _r: web.Request) -> web.Response:
        return web.Response(status=200 if self.healthy else 503, text="ok" if self.healthy else "no")

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/healthz", self._health)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()


class Published:
    def __init__(self) -> None:
        self.changes: list[tuple[float, ProbeChanged]] = []
        self.changed = asyncio.Event()

    async def __call__(self, p: ProbeChanged) -> None:
        self.changes.append((time.monotonic(), p))
        self.changed.set()

    async def next(self, within_s: float = 10.0) -> ProbeChanged:
        await asyncio.wait_for(self.changed.wait(), within_s)
        self.changed.clear()
        return self.changes[-1][1]


@pytest.fixture
async def guest() -> AsyncIterator[Guest]:
    g = Guest()
    await g.start()
    try:
        yield g
    finally:
        await g.stop()


@pytest.fixture
async def parts(tmp_path: Path) -> AsyncIterator[tuple[Ledger, RuntimeDriver]]:
    ledger = Ledger(str(tmp_path / "ledger.sqlite3"))
    await ledger.open()
    driver = make_driver("sim", state_dir=str(tmp_path / "runtime"), seed=1)
    await driver.open()
    await driver.create(VMSpec(vm_id=VM))
    try:
        yield ledger, driver
    finally:
        await driver.close()
        await ledger.close()


async def _run(prober: Prober) -> asyncio.Task[None]:
    task = asyncio.create_task(prober.run())
    prober.kick(VM)
    return task


async def _stop(task: asyncio.Task[None]) -> None:
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_an_http_readiness_probe_honours_the_delay_and_the_thresholds(
    parts: tuple[Ledger, RuntimeDriver], guest: Guest
) -> None:
    ledger, driver = parts
    probe = Probe("http", guest.port, path="/healthz", initial_delay_s=1, period_s=1, failure_threshold=2)
    await ledger.put_vm(VMRow(vm_id=VM, fence=fence(1), state="running", ip="127.0.0.1",
                              spec=Spec(readiness=probe)))
    published = Published()
    prober = Prober(ledger, driver, "host-a", published, interval=0.05, timeout=1.0)
    t0 = time.monotonic()
    task = await _run(prober)
    try:
        first = await published.next()
        assert first.ready is False and first.fence == fence(1), "not ready before initialDelaySeconds"
        ready = await published.next()
        assert ready.ready is True and time.monotonic() - t0 >= 1.0
        guest.healthy = False
        t1 = time.monotonic()
        down = await published.next()
        assert down.ready is False and time.monotonic() - t1 >= 1.0, "one failure is below failureThreshold 2"
    finally:
        await _stop(task)


async def test_a_probe_result_keeps_its_fence_and_a_liveness_failure_asks_for_a_restart(
    parts: tuple[Ledger, RuntimeDriver], guest: Guest
) -> None:
    ledger, driver = parts
    tcp = Probe("tcp", guest.port, period_s=1)
    live = Probe("http", guest.port, path="/healthz", period_s=1, failure_threshold=1)
    await ledger.put_vm(VMRow(vm_id=VM, fence=fence(1), state="running", ip="127.0.0.1",
                              spec=Spec(readiness=tcp, liveness=live)))
    published = Published()
    restarts: list[tuple[str, Fence]] = []
    asked = asyncio.Event()

    async def restart(vm_id: str, f: Fence) -> None:
        restarts.append((vm_id, f))
        asked.set()

    prober = Prober(ledger, driver, "host-a", published, interval=0.05, timeout=1.0, on_liveness_failure=restart)
    task = await _run(prober)
    try:
        assert (await published.next()).ready is True
        # an adopt moves the VM to epoch 2: what is probed from now on is reported under it only
        await ledger.put_vm(VMRow(vm_id=VM, fence=fence(2), state="running", ip="127.0.0.1",
                                  spec=Spec(readiness=tcp, liveness=live)))
        again = await published.next()
        assert again.fence == fence(2) and again.ready is True
        assert all(p.fence in (fence(1), fence(2)) for _, p in published.changes)
        guest.healthy = False  # the TCP port still answers (ready), the HTTP liveness does not
        await asyncio.wait_for(asked.wait(), 10)
        assert restarts[0] == (VM, fence(2)), "a liveness restart was asked under a fence that lost the VM"
    finally:
        await _stop(task)


async def test_a_closed_port_and_a_garbage_answer_are_failures_never_exceptions(guest: Guest) -> None:
    assert await check(Probe("tcp", guest.port), "127.0.0.1")
    assert await check(Probe("http", guest.port, path="/healthz"), "127.0.0.1")
    assert not await check(Probe("http", guest.port, path="/nope"), "127.0.0.1")  # 404
    server = await asyncio.start_server(lambda r, w: (w.write(b"\xff" * 10000 + b"\n"), w.close()), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        assert not await check(Probe("http", port), "127.0.0.1")
        assert not await check(Probe("http", port, scheme="HTTPS"), "127.0.0.1")
    finally:
        server.close()
        await server.wait_closed()
    await guest.stop()
    assert not await check(Probe("tcp", guest.port), "127.0.0.1")


def test_thresholds_as_kubernetes_counts_them() -> None:
    s = Streak(success=2, failure=3, start=False)
    assert [s.add(x) for x in (True, False, True, True, False, False, False)] == \
        [False, False, False, True, True, True, False]


def test_exec_probes_are_a_warning_not_an_invalid_spec() -> None:
    pod = {"metadata": {"name": "p"}, "spec": {"containers": [{
        "name": "main", "readinessProbe": {"exec": {"command": ["true"]}},
        "livenessProbe": {"tcpSocket": {"port": 22}, "successThreshold": 2}}]}}
    spec, invalid = spec_of_pod(pod)
    assert spec.readiness is None and spec.unsupported is not None
    assert "exec probes are not supported" in spec.unsupported
    assert invalid is not None and "successThreshold: must be 1 for a liveness probe" in invalid
