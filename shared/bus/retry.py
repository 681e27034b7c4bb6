"""Bounded retries: exponential backoff with jitter, a count and a time budget."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import nats.js.errors

from shared.bus.wire import TRANSIENT, retriable_api_error
from shared.tasks import sleep_unless_set

T = TypeVar("T")

# A JetStream leader election answers "no responders"/503 at once for a few seconds, so retries
# are bounded by a time budget as well as a count.
APPEND_MAX_ATTEMPTS = 60  # requests per fenced append / publish before AppendFailed
APPEND_RETRY_BUDGET_S = 20.0  # total time spent retrying one append / publish
BACKOFF_BASE_S = 0.02
BACKOFF_MAX_S = 0.5




def backoff_delay(attempt: int) -> float:
    """Exponential backoff with equal jitter, capped at BACKOFF_MAX_S (attempt counts from 0)."""
    cap = min(BACKOFF_MAX_S, BACKOFF_BASE_S * 2.0 ** min(attempt, 32))  # no float overflow
    return cap / 2 + float(random.uniform(0, cap / 2))


class Retry:
    """Bounded retries: at most max_attempts tries and budget_s seconds from creation."""

    def __init__(self, max_attempts: int = APPEND_MAX_ATTEMPTS, budget_s: float = APPEND_RETRY_BUDGET_S):
        self.max_attempts = max_attempts
        self.deadline = time.monotonic() + budget_s
        self.attempt = 0

    async def backoff(self, stop: asyncio.Event | None = None) -> bool:
        """Sleep before the next try; False (without sleeping) once attempts or budget are spent,
        or once ``stop`` is set (it cuts the sleep short)."""
        self.attempt += 1
        remaining = self.deadline - time.monotonic()
        if self.attempt >= self.max_attempts or remaining <= 0:
            return False
        delay = min(remaining, backoff_delay(self.attempt - 1))
        if stop is not None:
            return not await sleep_unless_set(stop, delay)
        await asyncio.sleep(delay)
        return True


async def retry_transient(
    call: Callable[[], Awaitable[T]],
    give_up: Callable[[BaseException, Retry], BaseException],
    *,
    on_retry: Callable[[BaseException], None] | None = None,
) -> T:
    """``call()`` until it succeeds, retrying (bounded by one Retry) what a retry may cure: a
    retriable JetStream API error or a transient request failure. Any other error is raised at
    once; when the retries are spent, ``give_up(last_error, retry)`` is raised from the last one."""
    retry = Retry()
    while True:
        try:
            return await call()
        except nats.js.errors.APIError as exc:
            if not retriable_api_error(exc):
                raise
            last_error: BaseException = exc
        except TRANSIENT as exc:
            last_error = exc
        if on_retry is not None:
            on_retry(last_error)
        if not await retry.backoff():
            final = give_up(last_error, retry)
            if final is last_error:
                raise last_error
            raise final from last_error
