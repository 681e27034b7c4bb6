"""cancel_and_wait ends a task that swallowed its first cancellation (as Python 3.11's
asyncio.wait_for does when its inner result races the cancel)."""

from __future__ import annotations

import asyncio
import contextlib

from shared.tasks import cancel_and_wait


async def test_a_task_that_swallows_a_cancellation_is_cancelled_again() -> None:
    swallowed = asyncio.Event()

    async def stubborn() -> None:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            swallowed.set()  # goes on as if the awaited answer had won the race
        await asyncio.Event().wait()  # only a second cancellation ends it

    task = asyncio.create_task(stubborn())
    await asyncio.sleep(0)
    left = await cancel_and_wait([task], recancel_after_s=0.05)
    assert left == set() and task.cancelled() and swallowed.is_set()


async def test_cleanup_after_the_first_cancellation_is_not_interrupted() -> None:
    cleaned = asyncio.Event()

    async def tidy() -> None:
        try:
            await asyncio.sleep(3600)
        finally:
            await asyncio.sleep(0.05)  # e.g. handing a lease back
            cleaned.set()

    task = asyncio.create_task(tidy())
    await asyncio.sleep(0)
    assert await cancel_and_wait([task], recancel_after_s=1.0) == set()
    assert cleaned.is_set()


async def test_failures_are_consumed_and_a_task_that_never_ends_is_reported() -> None:
    async def fails() -> None:
        raise RuntimeError("boom")

    released = asyncio.Event()

    async def immortal() -> None:
        while not released.is_set():
            with contextlib.suppress(asyncio.CancelledError):
                await released.wait()

    failed = asyncio.create_task(fails())
    await asyncio.sleep(0)
    forever = asyncio.create_task(immortal())
    await asyncio.sleep(0)
    assert await cancel_and_wait([failed, forever], attempts=3, recancel_after_s=0.01) == {forever}
    released.set()
    await forever
