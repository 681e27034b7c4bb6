"""cancel_and_wait ends a task that swallowed its first cancellation (as Python 3.11's
asyncio.wait_for does when its inner result races the cancel); end_within and run_within bound a
stop and say where it hung."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from shared.tasks import await_chain, cancel_and_wait, end_within, interruptible, join, run_within


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


async def _parked(until: asyncio.Event) -> None:
    await until.wait()


async def test_a_task_that_ends_on_its_own_is_not_cancelled() -> None:
    asked = asyncio.Event()
    task = asyncio.create_task(_parked(asked))
    asked.set()
    assert await end_within([task], 5.0) == set()
    assert task.done() and not task.cancelled()


async def test_a_stop_that_hangs_is_logged_with_where_it_hung_then_cancelled(caplog: pytest.LogCaptureFixture) -> None:
    never = asyncio.Event()
    task = asyncio.create_task(_parked(never), name="stuck-loop")
    await asyncio.sleep(0)
    with caplog.at_level(logging.ERROR, logger="shared.tasks"):
        assert await end_within([task], 0.05, what="stack task") == set()
    assert task.cancelled()
    (record,) = caplog.records
    assert "stack task stuck-loop did not end within 0.05s" in record.getMessage()
    assert "_parked" in record.getMessage()  # the await chain reaches the coroutine it is parked in


async def test_run_within_logs_a_failing_step_so_the_next_steps_still_run(caplog: pytest.LogCaptureFixture) -> None:
    async def fails() -> None:
        raise OSError("socket already closed")

    with caplog.at_level(logging.WARNING, logger="shared.tasks"):
        await run_within(fails(), 1.0, what="closing NATS")
    assert "closing NATS failed: OSError('socket already closed')" in caplog.text


async def test_the_await_chain_of_a_suspended_task_names_every_level() -> None:
    async def inner() -> None:
        await asyncio.Event().wait()

    async def outer() -> None:
        await inner()

    task = asyncio.create_task(outer())
    await asyncio.sleep(0)
    names = [line.rsplit(" ", 1)[-1] for line in await_chain(task)]
    assert names == ["outer", "inner", "wait"]
    await cancel_and_wait([task])


@pytest.mark.parametrize("waits_with", ["join", "the group alone"])
async def test_a_task_group_whose_child_swallows_a_cancel_still_ends_with_join(waits_with: str) -> None:
    entered, released = asyncio.Event(), asyncio.Event()

    async def swallows_a_cancel() -> None:  # an effect worker whose publish's answer won the race
        try:
            entered.set()
            await released.wait()
        except asyncio.CancelledError:
            await released.wait()  # ...and goes on to its next item: only another cancel ends it

    async def owner() -> None:
        async with asyncio.TaskGroup() as tg:
            children = [tg.create_task(swallows_a_cancel())]
            if waits_with == "join":
                await join(children)

    task = asyncio.create_task(owner())
    await entered.wait()
    left = await cancel_and_wait([task], attempts=3, recancel_after_s=0.05)
    if waits_with == "join":
        assert left == set() and task.cancelled()
    else:  # what join is for: the group cancels its child once, then waits for it forever
        assert left == {task}
        released.set()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_unless_set_gives_the_finished_step_or_abandons_it_on_the_event() -> None:
    from shared.tasks import unless_set

    stop = asyncio.Event()

    async def quick() -> int:
        return 7

    done = await unless_set(quick(), stop)
    assert done is not None and done.result() == 7

    started, cancelled = asyncio.Event(), asyncio.Event()

    async def slow() -> None:
        started.set()
        try:
            await asyncio.Event().wait()  # a request waiting out its own timeout, say
        finally:
            cancelled.set()

    waiting = asyncio.ensure_future(unless_set(slow(), stop))
    await started.wait()
    stop.set()
    assert await asyncio.wait_for(waiting, 5) is None and cancelled.is_set()
    assert await unless_set(asyncio.Event().wait(), asyncio.Event(), within_s=0.05) is None


_SWALLOWS_ITS_FIRST_CANCEL = """
import asyncio, os, signal
from shared.tasks import finish_shielded, interruptible, run_main

async def stop_stack():
    await asyncio.sleep(0.2)  # longer than the re-cancel period
    print("stack stopped", flush=True)

async def command():
    try:
        loop = asyncio.get_running_loop()
        loop.call_soon(os.kill, os.getpid(), signal.SIGINT)
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            print("cancel swallowed", flush=True)  # as wait_for does when its answer races the cancel
        await asyncio.sleep(3600)
        print("ran to its end", flush=True)
    finally:
        await finish_shielded(stop_stack())

try:
    run_main(interruptible(command(), recancel_after_s=0.02))
except KeyboardInterrupt:
    print("interrupted", flush=True)
"""


def test_an_interrupt_ends_a_command_that_swallowed_its_first_cancel_and_its_cleanup_runs_whole() -> None:
    """`vmfence demo` exited 0 after a Ctrl-C: asyncio.run cancels once, the cancel was swallowed
    (3.11) and the demo ran on to its end. `interruptible` cancels until it takes and raises
    KeyboardInterrupt; the cleanup under `finish_shielded` survives the repeated cancels. (A
    subprocess: the KeyboardInterrupt leaves the event loop, as it does in the command.)"""
    out = subprocess.run([sys.executable, "-c", _SWALLOWS_ITS_FIRST_CANCEL], capture_output=True, text=True,
                         timeout=60, cwd=Path(__file__).resolve().parents[2])
    assert out.stdout.split("\n")[:3] == ["cancel swallowed", "stack stopped", "interrupted"], out.stdout + out.stderr


async def test_an_uninterrupted_command_gives_its_result() -> None:
    async def command() -> int:
        return 7

    assert await interruptible(command()) == 7
