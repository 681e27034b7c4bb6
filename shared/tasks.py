"""Ending tasks for sure.

On Python 3.11 ``asyncio.wait_for`` swallows a cancellation that arrives in the same loop
iteration as its inner result (gh-86296, fixed in 3.12). nats-py waits for every request's answer
with it, so a task cancelled while a JetStream publish is being acknowledged can go on running:
a watch loop kept reading its stream, and a ``TaskGroup`` or a shutdown waiting for it hung. A
second cancellation takes, so owners end their tasks with :func:`cancel_and_wait`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Coroutine, Iterable
from typing import Any, TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")

RECANCEL_AFTER_S = 2.0  # long enough for a task's own cleanup (its finally) after the first one
CANCEL_ATTEMPTS = 10


async def cancel_and_wait(
    tasks: Iterable[asyncio.Future[Any]],
    *,
    what: str = "task",
    attempts: int = CANCEL_ATTEMPTS,
    recancel_after_s: float = RECANCEL_AFTER_S,
) -> set[asyncio.Future[Any]]:
    """Cancel ``tasks`` and wait until each has finished, cancelling again those still running
    ``recancel_after_s`` after the last cancellation.

    Their results and exceptions are consumed (the owner is ending them, not awaiting their
    outcome). Returns the tasks still running after ``attempts`` cancellations, which are logged;
    normally none.
    """
    tasks = list(tasks)
    pending = {t for t in tasks if not t.done()}
    for attempt in range(attempts):
        if not pending:
            break
        if attempt:
            log.info("%d %s(s) ignored a cancellation; cancelling again", len(pending), what)
        for t in pending:
            t.cancel()
        _, pending = await asyncio.wait(pending, timeout=recancel_after_s)
    for t in tasks:
        if t.done() and not t.cancelled():
            t.exception()  # consumed: never "exception was never retrieved"
    if pending:
        log.warning("%d %s(s) ignored %d cancellations; abandoning them", len(pending), what, attempts)
    return pending


async def join(tasks: Iterable[asyncio.Future[Any]], *, what: str = "task") -> None:
    """Wait until ``tasks`` end. If this wait is cancelled, they are ended for sure first: a
    TaskGroup cancels its children only once, so one child that swallowed that cancel kept the
    group, and its owner's shutdown, waiting forever."""
    tasks = list(tasks)
    try:
        if tasks:
            await asyncio.wait(tasks)
    finally:
        await cancel_and_wait(tasks, what=what)


async def end_within(
    tasks: Iterable[asyncio.Future[Any]], seconds: float, *, what: str = "task"
) -> set[asyncio.Future[Any]]:
    """Give ``tasks``, already asked to stop, ``seconds`` to end on their own; then log where each
    one still running is stuck and cancel it (:func:`cancel_and_wait`). A stop that must not hang
    its caller. Returns the tasks that outlived every cancellation (normally none)."""
    tasks = list(tasks)
    pending = {t for t in tasks if not t.done()}
    if pending:
        _, pending = await asyncio.wait(pending, timeout=seconds)
    for t in pending:
        name = t.get_name() if isinstance(t, asyncio.Task) else repr(t)
        log.error("%s %s did not end within %gs; cancelling it. It was at:\n%s", what, name, seconds,
                  "\n".join(await_chain(t)))
    return await cancel_and_wait(tasks, what=what)


async def run_within(aw: Awaitable[Any], seconds: float, *, what: str) -> None:
    """Run one step of a shutdown for at most ``seconds`` (then it is cancelled and logged); its
    errors are logged, not raised, so the steps after it still run."""
    task = asyncio.ensure_future(aw)
    await end_within([task], seconds, what=what)
    if task.done() and not task.cancelled() and task.exception() is not None:
        log.warning("%s failed: %r", what, task.exception())


def await_chain(aw: Any) -> list[str]:
    """Where a task, coroutine or async generator is suspended: its whole await chain as
    ``file:line function`` lines, outermost first (``Task.get_stack`` shows only the outermost)."""
    lines = []
    node = aw.get_coro() if isinstance(aw, asyncio.Task) else aw
    while node is not None:
        frame = getattr(node, "cr_frame", None) or getattr(node, "gi_frame", None) or getattr(node, "ag_frame", None)
        if frame is not None:
            lines.append(f"  {frame.f_code.co_filename}:{frame.f_lineno} {frame.f_code.co_name}")
        node = getattr(node, "cr_await", None) or getattr(node, "gi_yieldfrom", None) or getattr(node, "ag_await", None)
    return lines


async def unless_set(
    aw: Awaitable[T],
    event: asyncio.Event,
    *,
    within_s: float | None = None,
    what: str = "step",
    attempts: int = CANCEL_ATTEMPTS,
    recancel_after_s: float = RECANCEL_AFTER_S,
) -> asyncio.Future[T] | None:
    """Run ``aw`` until it finishes, ``event`` is set (a stop) or ``within_s`` passes: its finished
    future, or None once it has been cancelled for sure (``cancel_and_wait``). A stop then need not
    wait out the step's own network timeouts."""
    step: asyncio.Future[T] = asyncio.ensure_future(aw)
    stopped: asyncio.Future[Any] = asyncio.ensure_future(event.wait())
    try:
        await asyncio.wait({step, stopped}, timeout=within_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
    if step.done():
        return step
    await cancel_and_wait([step], what=what, attempts=attempts, recancel_after_s=recancel_after_s)
    return None


async def sleep_unless_set(event: asyncio.Event, seconds: float) -> bool:
    """Sleep ``seconds``, waking early when ``event`` is set (a stop); True if it is set."""
    try:
        await asyncio.wait_for(event.wait(), seconds)
    except TimeoutError:
        return False
    return True


def run_main(coro: Coroutine[Any, Any, T]) -> T:
    """Run a command's coroutine to completion on uvloop where it is installed, else asyncio."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


async def finish_shielded(aw: Awaitable[T]) -> T:
    """Run ``aw`` to its end even if the caller is cancelled meanwhile (a cleanup that must not stop
    half-way, such as removing a stack's VMs); a cancellation that arrived is raised after it."""
    task = asyncio.ensure_future(aw)
    cancelled = False
    while True:
        try:
            result = await asyncio.shield(task)
            break
        except asyncio.CancelledError:
            if task.cancelled():
                raise
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError
    return result


async def interruptible(coro: Coroutine[Any, Any, T], *, recancel_after_s: float = RECANCEL_AFTER_S) -> T:
    """Run a command's coroutine; SIGINT or SIGTERM cancel it until the cancellation takes, then
    raise KeyboardInterrupt. ``asyncio.run`` cancels its main task once on SIGINT, and on Python
    3.11 that one cancel can be swallowed (above): the command then ran on to its end and exited 0,
    as if never interrupted. The coroutine's own cleanup should use ``finish_shielded``."""
    import signal

    loop = asyncio.get_running_loop()
    hit = asyncio.Event()
    sigs = (signal.SIGINT, signal.SIGTERM)
    for sig in sigs:
        loop.add_signal_handler(sig, hit.set)
    task = asyncio.ensure_future(coro)
    waiter = asyncio.ensure_future(hit.wait())
    try:
        await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
        if not hit.is_set():
            return task.result()
        while not task.done():
            task.cancel()
            await asyncio.wait({task}, timeout=recancel_after_s)
        if not task.cancelled():
            task.exception()  # consumed: the interrupt is what the user is told
        raise KeyboardInterrupt
    finally:
        waiter.cancel()
        for sig in sigs:
            loop.remove_signal_handler(sig)

