"""The pace of an inventory round: at most ``rate`` reports a second on average, in bursts of
``BURST_S``, never a sleep per report; 0 is unpaced; a stop ends the wait."""

from __future__ import annotations

from services.agent.pace import BURST_S, Pace


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
