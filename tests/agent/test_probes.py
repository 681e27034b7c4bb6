"""Probe loops and the sweep end for sure, even when a cancellation is swallowed; a restart
makes a VM probed afresh, and a probe begun before it is not reported.

On Python 3.11 a cancel that races a publish's answer can be swallowed (shared.tasks). A probe loop
replaced by ``restart`` then went on probing beside its successor, and at shutdown the prober's
TaskGroup, which cancels its children only once, waited for it forever: the agent never stopped.
Here the publish swallows every cancellation, which makes that race certain.

A VM with a probe in its spec has a loop of its own; any other is swept (``Prober`` docstring).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from services.agent.ledger import Ledger, VMRow
from services.agent.probes import Prober
from services.agent.runtime import RuntimeDriver, VMSpec, make_driver
from shared.fence.schema import Probe, ProbeChanged, Spec
from shared.tasks import cancel_and_wait

from .conftest import fence

VM = "vm-p"
INTERVAL_S = 0.02
# a liveness probe gives the VM a loop of its own; with no address in the ledger the loop probes
# readiness through the runtime, as the sweep does
OWN_PROBE = Spec(cpus=1, memory_mib=64, liveness=Probe(kind="tcp", port=80))


class SwallowingPublish:
    """A publish whose answer always wins the race with a cancel: the cancel is lost."""

    def __init__(self, answered: int = 0) -> None:
        self.entered = asyncio.Event()
        self.published: list[ProbeChanged] = []
        self.answered = answered  # publishes answered before the cancels start being swallowed

    async def __call__(self, change: ProbeChanged) -> None:
        self.entered.set()
        if self.answered > 0:
            self.answered -= 1
            self.published.append(change)
            return
        try:
            await asyncio.Event().wait()  # the answer has not come yet
        except asyncio.CancelledError:
            self.published.append(change)  # ...and now it has, in the same loop iteration


@pytest.fixture
async def probed(tmp_path: Path) -> AsyncIterator[tuple[Ledger, RuntimeDriver]]:
    ledger = Ledger(str(tmp_path / "ledger.sqlite3"))
    await ledger.open()
    driver = make_driver("sim", state_dir=str(tmp_path / "runtime"), seed=1)
    await driver.open()
    await driver.create(VMSpec(vm_id=VM))
    await ledger.put_vm(VMRow(vm_id=VM, fence=fence(1), state="running", spec=Spec(cpus=1, memory_mib=64)))
    try:
        yield ledger, driver
    finally:
        await driver.close()
        await ledger.close()


def probe_loops() -> list[asyncio.Task[object]]:
    return [t for t in asyncio.all_tasks() if t.get_name() == f"probe-{VM}" and not t.done()]


async def test_a_replaced_probe_loop_ends_and_the_prober_stops(probed: tuple[Ledger, RuntimeDriver]) -> None:
    ledger, driver = probed
    await ledger.put_vm(VMRow(vm_id=VM, fence=fence(1), state="running", spec=OWN_PROBE))
    publish = SwallowingPublish()
    prober = Prober(ledger, driver, "host-a", publish, interval=INTERVAL_S, timeout=1.0)
    run = asyncio.create_task(prober.run())
    prober.kick(VM)
    await asyncio.wait_for(publish.entered.wait(), 5)
    first = probe_loops()
    assert len(first) == 1

    publish.entered.clear()
    prober.restart(VM)  # the VM restarted: its loop is replaced, and the cancel is swallowed
    await asyncio.wait_for(publish.entered.wait(), 5)  # the successor probes and publishes
    await asyncio.wait_for(asyncio.wait(first), 5)  # the replaced loop ended by itself
    assert len(probe_loops()) == 1, "a replaced probe loop went on beside its successor"

    # the successor is parked in a publish that swallows cancels, as the replaced one was
    assert await cancel_and_wait([run], attempts=3, recancel_after_s=0.5) == set(), "the prober never stopped"
    assert probe_loops() == []


async def test_a_probe_that_outlasts_its_timeout_is_not_ready(probed: tuple[Ledger, RuntimeDriver]) -> None:
    """A runtime that does not answer a probe within ``timeout`` reports the VM not ready, and the
    loop goes on: the next probe, answered, reports it ready."""
    ledger, driver = probed
    driver.faults.delay("probe", 30.0, vm_id=VM)  # type: ignore[attr-defined]  # the first probe hangs
    changes: asyncio.Queue[ProbeChanged] = asyncio.Queue()

    async def publish(change: ProbeChanged) -> None:
        changes.put_nowait(change)

    prober = Prober(ledger, driver, "host-a", publish, interval=INTERVAL_S, timeout=0.2)
    run = asyncio.create_task(prober.run())
    try:
        prober.kick(VM)
        first = await asyncio.wait_for(changes.get(), 5)
        assert first.vm_id == VM and first.ready is False, "a hung probe is not ready"
        second = await asyncio.wait_for(changes.get(), 5)
        assert second.ready is True
    finally:
        await cancel_and_wait([run])


async def test_a_restarted_swept_vm_is_probed_afresh_and_the_prober_stops(
    probed: tuple[Ledger, RuntimeDriver],
) -> None:
    """A restart reports the VM's readiness again, though unchanged; with the sweep's worker then
    parked in a publish that swallows cancels, the prober still stops."""
    ledger, driver = probed
    publish = SwallowingPublish(answered=1)
    prober = Prober(ledger, driver, "host-a", publish, interval=60.0, timeout=1.0)
    run = asyncio.create_task(prober.run())
    prober.kick(VM)
    await asyncio.wait_for(publish.entered.wait(), 5)
    assert probe_loops() == [], "a VM without a probe of its own is swept, not looped"

    publish.entered.clear()
    prober.restart(VM)
    await asyncio.wait_for(publish.entered.wait(), 5)  # reported again: this publish swallows cancels
    assert await cancel_and_wait([run], attempts=3, recancel_after_s=0.5) == set(), "the prober never stopped"
    assert [c.ready for c in publish.published] == [True, True]


class GatedDriver:
    """A runtime whose ``gated``-th probe waits for ``gate`` and then answers not ready; every
    other one answers ready at once."""

    def __init__(self, gated: int = 1) -> None:
        self.gate = asyncio.Event()
        self.entered = asyncio.Event()
        self.answered = asyncio.Event()
        self.gated = gated
        self.calls = 0

    async def probe(self, vm_id: str) -> bool:
        self.calls += 1
        if self.calls != self.gated:
            return True
        self.entered.set()
        await self.gate.wait()
        self.answered.set()  # whoever waits for this runs after the prober has used the answer
        return False


class Published:
    """A publish that keeps what it was given and says when something came."""

    def __init__(self) -> None:
        self.changes: list[ProbeChanged] = []
        self.came = asyncio.Event()

    async def __call__(self, change: ProbeChanged) -> None:
        self.changes.append(change)
        self.came.set()


async def test_a_probe_begun_before_a_restart_is_not_reported(probed: tuple[Ledger, RuntimeDriver]) -> None:
    ledger, _ = probed
    driver, published = GatedDriver(), Published()
    prober = Prober(ledger, driver, "host-a", published, interval=60.0, timeout=30.0)  # type: ignore[arg-type]
    run = asyncio.create_task(prober.run())
    try:
        prober.kick(VM)
        await asyncio.wait_for(driver.entered.wait(), 5)  # the first probe is under way...
        prober.restart(VM)  # ...when the VM restarts: the next probe answers ready
        await asyncio.wait_for(published.came.wait(), 5)
        driver.gate.set()
        await asyncio.wait_for(driver.answered.wait(), 5)
        assert [c.ready for c in published.changes] == [True], \
            "the answer of a probe begun before the restart was reported"
    finally:
        await cancel_and_wait([run])


async def test_a_probe_whose_fence_was_superseded_meanwhile_is_not_reported(
    probed: tuple[Ledger, RuntimeDriver],
) -> None:
    """Rule 4 on its own, with no restart to discard the probe: the VM's owner in the ledger moves
    to a newer fence while a probe under the older one is under way; its answer is dropped."""
    ledger, _ = probed
    driver, published = GatedDriver(gated=2), Published()
    prober = Prober(ledger, driver, "host-a", published, interval=60.0, timeout=30.0)  # type: ignore[arg-type]
    run = asyncio.create_task(prober.run())
    try:
        prober.kick(VM)
        await asyncio.wait_for(published.came.wait(), 5)  # ready under fence 1
        prober.kick(VM)  # probed again: this one waits inside the runtime
        await asyncio.wait_for(driver.entered.wait(), 5)
        await ledger.put_vm(VMRow(vm_id=VM, fence=fence(2), state="running", spec=Spec(cpus=1, memory_mib=64)))
        driver.gate.set()
        await asyncio.wait_for(driver.answered.wait(), 5)
        assert [(c.fence, c.ready) for c in published.changes] == [(fence(1), True)], \
            "a superseded fence's probe was reported"
    finally:
        await cancel_and_wait([run])
