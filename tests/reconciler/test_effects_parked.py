"""An effect that fails (a confirm while the API server is away, a publish while the bus is) is tried
again later without holding an effect worker: the key's queue waits, parked, with its order kept,
and the workers go on with other keys' effects. Before, each such key held a worker in a retry
loop, and as many keys as workers stopped every effect of every other key (commands to agents
included) for as long as the API server was away."""

from __future__ import annotations

import asyncio

import pytest

from services.reconciler import effects
from services.reconciler.effects import EffectRunner
from services.reconciler.kube import KubeUnavailable, NullGateway
from shared.bus.connect import Bus
from shared.fence.keys import Key
from shared.fence.schema import ConfirmedRead, ConfirmRequested, Fence, KubeWrite, WriteDone, WriteRequested
from tests.reconciler.helpers import wait_until


class _Gateway(NullGateway):
    """Confirms fail (KubeUnavailable) while ``away``; writes are always answered."""

    def __init__(self) -> None:
        super().__init__()
        self.away = True
        self.calls: list[tuple[str, str]] = []

    async def confirm(self, key: Key, request: str) -> ConfirmedRead:
        self.calls.append((str(key), "confirm"))
        if self.away:
            raise KubeUnavailable(f"confirm {key}: 0 Transport")
        return ConfirmedRead(key=str(key), request=request, uid="u1", resource_version=1)

    async def write(self, key: Key, write: KubeWrite) -> WriteDone:
        self.calls.append((str(key), "write"))
        return WriteDone(write.fence, write.id, "ok")


def _confirm(key: str) -> ConfirmRequested:
    return ConfirmRequested(Fence(key, "u1", 1), f"confirm:{key}")


def _write(key: str) -> WriteRequested:
    return WriteRequested(KubeWrite(f"status:{key}", "status", Fence(key, "u1", 1)))


async def test_failing_effects_hold_no_worker_and_keep_their_keys_order(
    bus: Bus, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(effects, "SERVER_CANARY_S", 3600.0)  # no canary: the parking alone
    gateway = _Gateway()
    outcomes: dict[str, list[str]] = {}
    other_done = asyncio.Event()

    async def feed(key: str, inp: object) -> bool:
        outcomes.setdefault(key, []).append(type(inp).__name__)
        if key == "default/other":
            other_done.set()
        return True

    runner = EffectRunner(bus.js, bus.subjects, gateway, feed=feed, workers=2)  # type: ignore[arg-type]
    async with asyncio.TaskGroup() as tg:
        run = tg.create_task(runner.run())
        waiting = [f"default/new-{i}" for i in range(10)]  # more keys than workers wait for the server
        for key in waiting:
            runner.submit(key, _confirm(key))
            runner.submit(key, _write(key))  # behind its key's confirm: never before it
        runner.submit("default/other", _write("default/other"))
        await asyncio.wait_for(other_done.wait(), 10)
        assert all(key not in outcomes for key in waiting), "nothing of a waiting key ran out of order"
        assert not runner.idle.is_set(), "parked keys still have work"
        gateway.away = False
        runner.read_answered(True, "default/other")  # (a read answered meanwhile: unparked now)
        await asyncio.wait_for(runner.idle.wait(), 10)
        assert all(outcomes[key] == ["ConfirmedRead", "WriteDone"] for key in waiting), outcomes
        run.cancel()
    runner.close()


async def test_a_canary_finds_the_server_back_and_every_parked_key_goes(
    bus: Bus, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No other effect is made once the server is back: a canary (the oldest parked key, tried
    again ahead of its delay) finds it answering, and every parked key goes at once, long before
    their doubled delays."""
    monkeypatch.setattr(effects, "SERVER_CANARY_S", 0.05)
    monkeypatch.setattr(effects, "RETRY_DELAY_S", 3600.0)  # a parked key's own retry: beyond the test
    gateway = _Gateway()

    async def feed(key: str, inp: object) -> bool:
        return True

    runner = EffectRunner(bus.js, bus.subjects, gateway, feed=feed, workers=2)  # type: ignore[arg-type]
    async with asyncio.TaskGroup() as tg:
        run = tg.create_task(runner.run())
        for i in range(10):
            runner.submit(f"default/new-{i}", _confirm(f"default/new-{i}"))
        await wait_until(lambda: len(runner._parked) == 10, "every key failed once and is parked")
        gateway.away = False
        await asyncio.wait_for(runner.idle.wait(), 10)
        assert not runner._parked
        run.cancel()
    runner.close()


async def test_while_the_server_is_silent_a_new_pod_is_not_confirmed_inline(bus: Bus) -> None:
    """A partition confirms a new pod inline (before it appends) only while the API server answers:
    silent, it would hold the input, and the inputs of other keys behind it, for the read's timeout.
    The read goes to the outbox instead, where it is parked until the server answers."""
    from services.reconciler.partition import Partition
    from shared.fence.decide import DecideEnv, HostView
    from shared.fence.schema import Observed, Spec

    gateway = _Gateway()
    runner = EffectRunner(bus.js, bus.subjects, gateway)  # not run: effects stay queued
    env = DecideEnv(hosts=[HostView("host-a", 64, 65536)])
    part = Partition(0, js=bus.js, subjects=bus.subjects, writer="w", effects=runner, snapshots=None,
                     env=lambda: env, confirm=gateway.confirm)
    assert await part.feed("default/a", Observed("default/a", "u1", 1, spec=Spec()))
    assert gateway.calls == [("default/a", "confirm")], "inline, tried once"
    assert runner.reads_silent, "its silence is known"
    pending = [e for e in part.keys["default/a"].state.outbox.values() if isinstance(e, ConfirmRequested)]
    assert len(pending) == 1, "the read is left to the outbox"
    assert await part.feed("default/b", Observed("default/b", "u1", 1, spec=Spec()))
    assert gateway.calls == [("default/a", "confirm")], "silent: not tried inline"
    assert [e for e in part.keys["default/b"].state.outbox.values() if isinstance(e, ConfirmRequested)]
    gateway.away = False
    runner.read_answered(True, "default/z")
    assert await part.feed("default/c", Observed("default/c", "u1", 1, spec=Spec()))
    assert gateway.calls[-1] == ("default/c", "confirm"), "answering again: inline again"
    assert not [e for e in part.keys["default/c"].state.outbox.values() if isinstance(e, ConfirmRequested)]
    runner.close()
