"""A pace for a stream of reports that has no deadline of its own (an inventory round): at most
``rate`` a second on average, in short bursts, so what the host sends at once never queues other
work behind it at the reconcilers."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

BURST_S = 0.05  # ahead of the pace by this much before it sleeps: a sleep per report would cost more than it spares


class Pace:
    def __init__(self, rate: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate = rate  # reports a second; 0: unpaced
        self._clock = clock
        self._start: float | None = None
        self._sent = 0

    async def next(self, sleep: Callable[[float], Awaitable[bool]]) -> bool:
        """Wait, if ahead of the pace, before the next report; True when ``sleep`` says stop."""
        if self.rate <= 0:
            return False
        now = self._clock()
        if self._start is None:
            self._start = now
        due = self._start + self._sent / self.rate
        self._sent += 1
        if due - now >= BURST_S:
            return await sleep(due - now)
        return False
