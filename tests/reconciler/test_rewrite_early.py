"""A Kubernetes write that failed because the API server did not answer is written again as soon as
it answers again, not at the end of its backoff (up to 30 s): the effect runner fires the rewrite
timers armed during the silence when a write is answered again. A refusal (a 403, a 422) is an
answer: it fires them too, and nothing armed while the server answered is fired early."""

from __future__ import annotations

import asyncio

import pytest

from services.reconciler import effects
from services.reconciler.effects import EffectRunner
from services.reconciler.kube import NullGateway
from shared.bus.connect import Bus
from shared.fence.keys import Key
from shared.fence.schema import Fence, KubeWrite, TimerArmed, TimerFired, WriteDone, WriteRequested


class _Gateway(NullGateway):
    """Answers each write with the next of ``outcomes``: "ok", "refused" (failed, answered) or
    "silent" (failed, unanswered)."""

    def __init__(self) -> None:
        super().__init__()
        self.outcomes: list[str] = []

    async def write(self, key: Key, write: KubeWrite) -> WriteDone:
        how = self.outcomes.pop(0)
        outcome = "ok" if how == "ok" else "failed"
        return WriteDone(write.fence, write.id, outcome, None if how == "ok" else how, unanswered=how == "silent")


def _status(key: str, n: int) -> WriteRequested:
    return WriteRequested(KubeWrite(f"status:{n}", "status", Fence(key, "u1", 1)))


def _rewrite(key: str, n: int) -> TimerArmed:
    return TimerArmed(Fence(key, "u1", 1), f"timer:rewrite/status:{n}", 30.0, "rewrite/status")


async def test_rewrites_armed_while_the_server_was_silent_fire_when_it_answers(bus: Bus) -> None:
    gateway = _Gateway()
    fired: list[tuple[str, str]] = []
    outcomes: list[WriteDone] = []

    async def feed(key: str, inp: object) -> bool:
        if isinstance(inp, WriteDone):
            outcomes.append(inp)
        return True

    runner = EffectRunner(bus.js, bus.subjects, gateway, feed=feed)  # type: ignore[arg-type]
    submit = runner.submit
    runner.submit = lambda key, work: (  # type: ignore[method-assign]
        fired.append((key, work.timer.timer_id)) if hasattr(work, "timer") else submit(key, work)
    )
    key = Key.parse("default/a")
    # armed while the server answers (a refusal of its own): not the server's silence, not fired early
    gateway.outcomes = ["refused"]
    await runner._execute(key, _status("default/a", 1))
    runner.submit_all("default/a", [_rewrite("default/a", 1)])
    # the server goes silent: the rewrites armed from now on wait for its answer
    gateway.outcomes = ["silent", "silent"]
    await runner._execute(key, _status("default/b", 2))
    runner.submit_all("default/b", [_rewrite("default/b", 2)])
    await runner._execute(key, _status("default/c", 3))
    runner.submit_all("default/c", [_rewrite("default/c", 3)])
    assert fired == [] and [o.unanswered for o in outcomes] == [False, True, True]
    # it answers (a refusal is an answer too): both fire now, once
    gateway.outcomes = ["refused", "ok"]
    await runner._execute(key, _status("default/d", 4))
    assert sorted(fired) == [("default/b", "timer:rewrite/status:2"), ("default/c", "timer:rewrite/status:3")]
    await runner._execute(key, _status("default/e", 5))
    assert len(fired) == 2, "fired once; the one armed while the server answered waits its backoff"
    assert ("default/a", "timer:rewrite/status:1") in runner._timers
    runner.close()


async def test_a_rewrite_armed_during_a_silence_and_then_halted_is_not_fired(bus: Bus) -> None:
    gateway = _Gateway()
    fired: list[str] = []

    async def feed(key: str, inp: object) -> bool:
        return True

    runner = EffectRunner(bus.js, bus.subjects, gateway, feed=feed)  # type: ignore[arg-type]
    runner.submit = lambda key, work: fired.append(key)  # type: ignore[method-assign]
    key = Key.parse("default/a")
    gateway.outcomes = ["silent", "ok"]
    await runner._execute(key, _status("default/a", 1))
    runner.submit_all("default/a", [_rewrite("default/a", 1)])
    runner.halt("default/a")  # quarantined: nothing of it is carried out
    await runner._execute(key, _status("default/z", 2))
    assert fired == []
    runner.close()


class _Keys:
    """What a partition's decide loop does with a write's outcome, for the test: a write that failed
    arms its rewrite timer (30 s: far beyond the test); the timer fired writes again."""

    def __init__(self) -> None:
        self.runner: EffectRunner | None = None
        self.n = 0

    async def feed(self, key: str, inp: object) -> bool:
        assert self.runner is not None
        self.n += 1
        if isinstance(inp, WriteDone) and inp.outcome == "failed":
            self.runner.submit_all(key, [_rewrite(key, self.n)])
        elif isinstance(inp, TimerFired):
            self.runner.submit(key, _status(key, self.n))
        return True


async def test_a_silent_server_is_asked_by_a_canary_and_every_write_goes_once_it_answers(
    bus: Bus, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No other write happens once the server is back: a canary (one waiting write, ahead of its
    backoff) finds it answering, and the rest go at once, long before their 30 s timers."""
    monkeypatch.setattr(effects, "SERVER_CANARY_S", 0.05)
    keys = [f"default/p{i}" for i in range(20)]
    written: set[str] = set()
    all_written = asyncio.Event()

    class Gateway(NullGateway):
        silent = True

        async def write(self, key: Key, write: KubeWrite) -> WriteDone:
            if self.silent:
                return WriteDone(write.fence, write.id, "failed", "0 Transport", unanswered=True)
            written.add(str(key))
            if len(written) == len(keys):
                all_written.set()
            return WriteDone(write.fence, write.id, "ok")

    gateway, sim = Gateway(), _Keys()
    runner = sim.runner = EffectRunner(bus.js, bus.subjects, gateway, feed=sim.feed, workers=4)  # type: ignore[arg-type]
    async with asyncio.TaskGroup() as tg:
        run = tg.create_task(runner.run())
        for i, key in enumerate(keys):
            runner.submit(key, _status(key, i))
        await asyncio.wait_for(runner.idle.wait(), 10)
        assert len(runner.writes) == len(keys), "every write failed and waits for the server"
        gateway.silent = False
        await asyncio.wait_for(all_written.wait(), 10)  # the rewrite timers say 30 s
        run.cancel()
    runner.close()
