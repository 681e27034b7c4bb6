"""The pace of an inventory round: at most ``rate`` reports a second on average, in bursts of
``BURST_S``, never a sleep per report; 0 is unpaced; a stop ends the wait."""

from __future__ import annotations

from services.agent.pace import BURST_S, Pace
from services.agent.rounds import round_items
from shared.fence.schema import Fence


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> bool:
        self.slept.append(seconds)
        self.now += seconds
        return False


async def test_a_thousand_reports_at_five_hundred_a_second_take_two_seconds_in_bursts() -> None:
    clock = _Clock()
    pace = Pace(500.0, clock)
    for _ in range(1000):
        assert not await pace.next(clock.sleep)
    assert abs((clock.now - 100.0) - (999 / 500)) < BURST_S
    assert len(clock.slept) <= 999 / 500 / BURST_S + 1, "a sleep per burst, not per report"
    assert min(clock.slept) >= BURST_S


async def test_unpaced_never_sleeps() -> None:
    clock = _Clock()
    pace = Pace(0.0, clock)
    for _ in range(1000):
        assert not await pace.next(clock.sleep)
    assert clock.slept == []


async def test_a_stop_during_the_wait_ends_the_round() -> None:
    async def stopping(seconds: float) -> bool:
        return True

    clock = _Clock()
    pace = Pace(1.0, clock)
    assert not await pace.next(stopping)  # the first goes at once
    assert await pace.next(stopping)


class _Row:
    def __init__(self, vm_id: str) -> None:
        self.vm_id, self.state, self.fence = vm_id, "running", Fence("default/p", "u", 1)


class _Ledger:
    def __init__(self, n: int) -> None:
        self.rows = {f"vm-{i:04d}": _Row(f"vm-{i:04d}") for i in range(n)}

    def vms(self) -> list[_Row]:
        return list(self.rows.values())

    def vm(self, vm_id: str) -> _Row | None:
        return self.rows.get(vm_id)


async def test_a_round_never_outlasts_its_interval_however_low_the_rate() -> None:
    """A host with more VMs than the rate times the interval is paced faster: its rounds then start
    at most two intervals apart, inside the reconciler's stale sweep (180 s), which would otherwise
    inspect VMs a slow round had not reached yet."""
    waits: list[float] = []

    async def sleep(seconds: float) -> bool:
        waits.append(seconds)
        return False

    ledger = _Ledger(1000)
    items = [x async for x in round_items(ledger, {}, 1.0, 10.0, sleep)]  # type: ignore[arg-type]
    assert len(items) == 1000
    assert 9.0 < max(waits) <= 10.0, "1 000 VMs within 10 s: 100 a second, not 1"
    waits.clear()
    assert len([x async for x in round_items(ledger, {}, 0.0, 10.0, sleep)]) == 1000  # type: ignore[arg-type]
    assert waits == [], "0: unpaced"
