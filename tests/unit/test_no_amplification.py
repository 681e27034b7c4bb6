"""However hosts answer — failed, inconclusive, not found, or now and then ok — and however often
every armed timer fires (the API server answering its writes), a key's outstanding effects stay
bounded: no answer arms more than one
retry of a thing, and no retry asks more than it did. A retry per failed answer that asked every
host (surveys, found here) doubled a key's work every round: the pure kernel is where that shows.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shared.fence.decide import rebuild
from shared.fence.schema import (
    ABSENT,
    Inventoried,
    Observed,
    Spec,
    TimerFired,
    VMExited,
    VMGone,
    WriteDone,
    WriteRequested,
)
from shared.fence.state import fold_all
from tests.unit.driver import KEY, Driver

EXAMPLES = settings.default.max_examples
# two hosts: a survey round is two commands; beside it a VM's command, a few timers and writes
OUTSTANDING_BOUND = 12
ROUNDS = 12


def _start(d: Driver, scenario: str) -> None:
    match scenario:
        case "admitted":
            d.admit("u1")
        case "bound_absent":
            create = d.run_up("u1")
            d.feed(Inventoried(create.fence, create.host, create.vm_id, ABSENT, round="host-a-b1-7"))
        case "deleting":
            d.run_up("u1")
            d.feed(Observed(KEY, "u1", d.next_rv(), deleting=True))
        case "rebuilding":
            d.run_up("u1")
            fold_all(d.state, rebuild(d.state, d.state.epoch, d.env, "tail lost"))
        case "adopting":
            d.run_up("u1")
            d.admit("u2", Spec(on_recreate="adopt"))
        case "hibernating":
            d.run_up("u1")
            d.feed(Observed(KEY, "u1", d.next_rv(), spec=Spec(hibernate=True)))
        case "waking":
            d.run_up("u1")
            d.feed(Observed(KEY, "u1", d.next_rv(), spec=Spec(hibernate=True)))
            (hibernate,) = d.commands("hibernate")
            d.answer(hibernate, snapshot="/snapshots/u1.mig")
            d.feed(Observed(KEY, "u1", d.next_rv(), spec=Spec()))
        case "gone":
            create = d.run_up("u1")
            d.feed(VMGone(create.fence, create.host, create.vm_id))
        case "exited":
            create = d.run_up("u1")
            d.feed(VMExited(create.fence, create.host, create.vm_id, 1))
        case "recreated":
            d.run_up("u1")
            d.admit("u2")


SCENARIOS = ["admitted", "bound_absent", "deleting", "rebuilding", "adopting", "hibernating", "waking", "gone",
             "exited", "recreated"]


def _hosts_answer(d: Driver, data: st.DataObject, outcomes: list[str]) -> None:
    """Every command out is answered with a drawn outcome (a survey's ok finds nothing)."""
    for cmd in d.commands():
        outcome = data.draw(st.sampled_from(outcomes))
        if cmd.op == "survey" and outcome == "ok":
            d.answer(cmd, found=[])
        else:
            d.answer(cmd, outcome)


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_hosts_that_do_not_answer_never_multiply_a_keys_work(data: st.DataObject) -> None:
    d = Driver()
    _start(d, data.draw(st.sampled_from(SCENARIOS)))
    for _ in range(ROUNDS):
        _hosts_answer(d, data, ["failed", "inconclusive", "inconclusive", "not_found", "ok"])
        for pending in d.pending(WriteRequested):  # the API server answers (hosts are the doubt here)
            write = pending.write
            d.feed(WriteDone(write.fence, write.id, "ok", node=write.node))
        for timer in d.timers():
            d.feed(TimerFired(timer.fence, timer.timer_id))
        assert len(d.state.outbox) <= OUTSTANDING_BOUND, sorted(d.state.outbox)
        assert len(d.commands("survey")) <= 2, "one survey round at a time"


def _status_writes_out(d: Driver) -> int:
    writes = [p for p in d.pending(WriteRequested) if p.write.verb == "status"]
    rewrites = [t for t in d.timers() if t.purpose == "rewrite/status"]
    return len(writes) + len(rewrites)


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_an_api_server_that_fails_writes_never_piles_up_a_pods_status_writes(data: st.DataObject) -> None:
    """Hosts answer as above and the API server fails most writes: each status change made during
    the outage asked for a write of its own, and each failed one was rewritten on its own backoff, so
    a pod's status writes grew with its changes. One is out at a time, besides a change just made."""
    d = Driver()
    _start(d, data.draw(st.sampled_from(SCENARIOS)))
    for _ in range(ROUNDS):
        _hosts_answer(d, data, ["failed", "inconclusive", "not_found", "ok", "ok"])
        for pending in d.pending(WriteRequested):
            write = pending.write
            outcome = data.draw(st.sampled_from(["failed", "failed", "failed", "ok"]))
            d.feed(WriteDone(write.fence, write.id, outcome, node=write.node))
        assert _status_writes_out(d) <= 1, sorted(d.state.outbox)
        for timer in d.timers():
            d.feed(TimerFired(timer.fence, timer.timer_id))
        assert len(d.state.outbox) <= OUTSTANDING_BOUND, sorted(d.state.outbox)
