"""A pod waiting for a host is checked again the moment a host comes live or reports more room,
not at the end of its placement backoff (up to a minute): on a real nats-server, with a real sim
agent whose first heartbeat is the host coming live."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

import shared.fence.decide.run as decide_run
from services.reconciler.config import ReconcilerConfig
from services.reconciler.effects import EffectRunner
from services.reconciler.hosts import HostsView, worth_checking
from services.reconciler.kube import NullGateway
from services.reconciler.service import Reconciler
from shared.bus.connect import Bus
from shared.fence.decide import HostView
from shared.fence.heartbeat import HostHeartbeat
from shared.fence.keys import Key
from shared.fence.schema import Fence, RetryTimer, Spec, SurveyTimer, TimerArmed, purpose_text
from shared.fence.state import Incarnation, KeyState
from tests.reconciler.helpers import observe, sim_agent, wait_until

PARTITIONS = 1  # as the bus fixture provisions


def _beat(host: str, cpus_free: int = 8, memory_free_mib: int = 8192) -> HostHeartbeat:
    return HostHeartbeat(host, "sim", 8, cpus_free, 8192, memory_free_mib, 0, time.time())


def test_a_host_new_back_or_with_more_room_makes_the_view_roomier() -> None:
    view = HostsView(stale_after_s=15.0)
    view.update(_beat("host-a"))
    view.update(_beat("host-b"))
    assert view.roomier.is_set(), "a new host"
    assert view.take_roomier() == {"host-a", "host-b"} and not view.roomier.is_set()
    assert view.take_roomier() == set()
    view.update(_beat("host-a"))
    view.update(_beat("host-a", cpus_free=4))
    assert not view.roomier.is_set(), "the same room, or less, checks nothing again"
    view.update(_beat("host-a", cpus_free=6))
    assert view.roomier.is_set(), "more CPUs free"
    assert view.take_roomier() == {"host-a"}
    view.update(_beat("host-a", cpus_free=6, memory_free_mib=8192))
    assert not view.roomier.is_set()
    view.hosts["host-a"].seen -= 16.0  # its heartbeats stopped for longer than stale_after_s
    view.update(_beat("host-a", cpus_free=6))
    assert view.roomier.is_set(), "a host back from stale"


async def test_only_checks_waiting_for_a_host_are_fired_early(bus: Bus) -> None:
    fired: list[tuple[str, str]] = []
    runner = EffectRunner(bus.js, bus.subjects, NullGateway())
    runner.submit = lambda key, work: fired.append((key, work.timer.timer_id))  # type: ignore[method-assign, union-attr]
    f = Fence("default/a", "u1", 1)
    runner.submit_all("default/a", [
        TimerArmed(f, "timer:place:1", 3600.0, purpose_text(decide_run.PlaceTimer())),
        TimerArmed(f, "timer:retry:2", 3600.0, purpose_text(RetryTimer("create", "vm-1"))),
        TimerArmed(f, "timer:survey:3", 3600.0, purpose_text(SurveyTimer())),
    ])
    assert runner.fire_host_waits() == 2
    assert fired == [("default/a", "timer:place:1"), ("default/a", "timer:survey:3")]
    assert runner.fire_host_waits() == 0, "a timer fires once"
    runner.submit_all("default/b", [TimerArmed(f, "timer:place:4", 3600.0, "place")])
    runner.submit_all("default/c", [TimerArmed(f, "timer:place:5", 3600.0, "place")])
    assert runner.fire_host_waits(lambda key, timer: key == "default/c") == 1
    assert fired[-1] == ("default/c", "timer:place:5")
    runner.close()


def _waiting(spec: Spec) -> KeyState:
    return KeyState("default/a", cur=Incarnation(fence=Fence("default/a", "u1", 1), spec=spec, unplaced="no host"))


def test_a_placement_is_checked_early_only_for_a_host_that_could_take_the_pod() -> None:
    """A pod bound to a dead node waits for that node: another host freeing room does not check it
    (each time would undo its backoff in a busy fleet); its own node, or any host with room for an
    unbound pod, does. A survey waits for any live host."""
    a, b, full_b = HostView("host-a", 8, 8192), HostView("host-b", 8, 8192), HostView("host-b", 0, 0)
    place = TimerArmed(Fence("default/a", "u1", 1), "timer:place:1", 60.0, "place")
    survey = TimerArmed(Fence("default/a", "u1", 1), "timer:survey:1", 60.0, "survey")
    on_a = _waiting(Spec(node="vmfence-host-a"))
    assert not worth_checking([b], on_a, place)
    assert worth_checking([a], on_a, place)
    unbound = _waiting(Spec(cpus=2))
    assert worth_checking([b], unbound, place)
    assert not worth_checking([full_b], unbound, place)
    assert worth_checking([b], on_a, survey)
    assert worth_checking([b], None, place), "a key not at hand is checked: the check decides"


def _place_armed(rec: Reconciler, key: Key) -> bool:
    part = rec.partitions.get(rec.subjects.partition(key))
    slot = part.keys.get(str(key)) if part is not None else None
    if slot is None:
        return False
    st: KeyState = slot.peek()
    return any(isinstance(e, TimerArmed) and e.purpose == "place" for e in st.outbox.values())


def _bound(rec: Reconciler, key: Key) -> bool:
    part = rec.partitions.get(rec.subjects.partition(key))
    slot = part.keys.get(str(key)) if part is not None else None
    st = slot.peek() if slot is not None else None
    return st is not None and st.cur is not None and st.cur.bound


async def test_a_pod_waiting_for_its_host_is_placed_when_the_host_comes_live(
    bus: Bus, nats_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a backoff far longer than the test: the pod is placed only if the host's coming live fires its check
    monkeypatch.setattr(decide_run, "PLACE_RETRY_S", 3600.0)
    monkeypatch.setattr(decide_run, "PLACE_RETRY_MAX_S", 3600.0)
    key = Key("pod", "default", "waiting")
    spec = Spec(node="vmfence-host-a")
    gateway = NullGateway()
    gateway.objects[str(key)] = ("uid-1", 1, spec)
    cfg = ReconcilerConfig(nats_url=[nats_url], partitions=PARTITIONS, id="place-again",
                           data_dir=str(tmp_path / "rec"), kube="none", http_port=0)
    rec = Reconciler(cfg, gateway=gateway, health=False)
    # host-b is live (it answers the partition's verification); the pod's node, host-a, is not yet
    async with sim_agent(nats_url, "host-b", tmp_path, PARTITIONS), asyncio.TaskGroup() as tg:
        run = tg.create_task(rec.run())
        await asyncio.wait_for(rec.ready.wait(), 30)
        await wait_until(lambda: len(rec.hosts.live()) == 1, "host-b's heartbeat")
        await observe(bus, key, "uid-1", 1, spec=spec)
        await wait_until(lambda: _place_armed(rec, key), "the pod waiting for host-a, its check armed")
        assert not _bound(rec, key)
        async with sim_agent(nats_url, "host-a", tmp_path, PARTITIONS):
            await wait_until(lambda: _bound(rec, key), "the pod bound once host-a heartbeats")
            rec.stop()
            await run
