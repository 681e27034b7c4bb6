"""A command on a VM that answered inconclusive (a runtime that did not say), or a remove that
failed, is sent again after a delay that doubles per re-send since the VM's last ok answer, up to a
cap: a host whose runtime hangs is not asked once a second per VM for as long as it lasts. An
inconclusive adopt's inspect backs off alike, and so does a survey round with a failed answer (one
retry at a time: they multiplied). The count is the log's (fold), so a replay or a new
owner of the partition backs off from where the writer was."""

from __future__ import annotations

from shared.fence.audit import audit
from shared.fence.decide import RETRY_MAX_S, rebuild, retry_backoff_s
from shared.fence.schema import Command, Observed, Spec, TimerArmed, TimerFired
from shared.fence.state import KeyState, fold_all
from tests.unit.driver import KEY, Driver, of

DOUBLING = [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]


def _answer_and_fire(d: Driver, cmd: Command, outcome: str, purpose: str) -> tuple[float, Command]:
    """``cmd`` answers ``outcome``; the re-send timer it arms fires; the command sent again."""
    (armed,) = [t for t in of(d.answer(cmd, outcome), TimerArmed) if t.purpose == purpose]
    d.feed(TimerFired(armed.fence, armed.timer_id))
    (again,) = d.commands(cmd.op)
    return armed.delay_s, again


def test_the_delay_doubles_from_one_second_up_to_the_cap() -> None:
    assert [retry_backoff_s(n) for n in range(7)] == DOUBLING
    assert retry_backoff_s(10**6) == RETRY_MAX_S


def test_a_remove_that_keeps_failing_waits_twice_as_long_each_time() -> None:
    d = Driver()
    d.run_up("u1")
    d.feed(Observed(KEY, "u1", d.next_rv(), deleting=True))
    (remove,) = d.commands("remove")
    delays = []
    for _ in DOUBLING:
        delay, remove = _answer_and_fire(d, remove, "failed", f"retry/remove/{remove.vm_id}")
        delays.append(delay)
    assert delays == DOUBLING
    d.answer(remove, "ok")
    assert remove.vm_id not in d.state.vms
    assert audit(d.log, final=False).clean


def test_an_ok_answer_starts_the_backoff_again() -> None:
    """A create inconclusive three times, then made: a later inspect of the VM that is inconclusive
    waits the first delay again, not the fourth."""
    d = Driver()
    d.admit("u1")
    (create,) = d.commands("create")
    delays = []
    for _ in range(3):
        delay, create = _answer_and_fire(d, create, "inconclusive", f"retry/create/{create.vm_id}")
        delays.append(delay)
    assert delays == DOUBLING[:3]
    assert d.state.vms[create.vm_id].retries == 3
    d.answer(create, "ok")
    assert d.state.vms[create.vm_id].retries == 0
    assert d.state.cur is not None and d.state.cur.bound


def test_an_inconclusive_adopt_backs_off_as_well() -> None:
    d = Driver()
    first = d.run_up("u1")
    d.admit("u2", Spec(on_recreate="adopt"))
    (adopt,) = d.commands("adopt")
    assert adopt.vm_id == first.vm_id
    delays = []
    for _ in range(4):
        delay, adopt = _answer_and_fire(d, adopt, "inconclusive", f"adopt/{adopt.vm_id}")
        delays.append(delay)
    assert delays == DOUBLING[:4]
    assert audit(d.log, final=False).clean


def test_a_replay_of_the_log_backs_off_from_where_the_writer_was() -> None:
    d = Driver()
    d.admit("u1")
    (create,) = d.commands("create")
    for _ in range(2):
        _, create = _answer_and_fire(d, create, "inconclusive", f"retry/create/{create.vm_id}")
    replayed = KeyState(key=KEY)
    for entry in d.log:
        fold_all(replayed, entry.decisions)
    assert replayed.vms[create.vm_id].retries == d.state.vms[create.vm_id].retries == 2


def _rebuilding() -> Driver:
    """A bound key whose log lost a tail: every host (two) is surveyed before any VM is made."""
    d = Driver()
    d.run_up("u1")
    fold_all(d.state, rebuild(d.state, d.state.epoch, d.env, "tail lost"))
    return d


def _survey_timers(d: Driver) -> list[TimerArmed]:
    return [t for t in d.timers() if t.purpose == "survey"]


def test_surveys_no_host_answers_go_one_round_at_a_time_backing_off() -> None:
    """Each failed answer armed a retry of its own, and each retry asked every host: with two hosts
    that did not answer, the surveys doubled every round (64 in the sixth). One retry at a time
    now, after a delay that doubles per round with a failed answer."""
    d = _rebuilding()
    delays = []
    for _ in DOUBLING:
        surveys = d.commands("survey")
        assert len(surveys) == 2, "one survey per host per round"
        for s in surveys:
            d.answer(s, "inconclusive")
        (timer,) = _survey_timers(d)
        delays.append(timer.delay_s)
        d.feed(TimerFired(timer.fence, timer.timer_id))
    assert delays == DOUBLING
    assert d.state.survey_failures == len(DOUBLING)
    for s in d.commands("survey"):
        d.answer(s, found=[])
    assert not d.state.rebuilding and d.state.survey_failures == 0, "a round every host answered ends it"
    assert _survey_timers(d) == []


def test_one_host_that_does_not_answer_fails_the_round_once() -> None:
    d = _rebuilding()
    a, b = d.commands("survey")
    d.answer(a, "failed")
    d.answer(b, found=[])
    (timer,) = _survey_timers(d)
    assert timer.delay_s == DOUBLING[0] and d.state.rebuilding
    d.feed(TimerFired(timer.fence, timer.timer_id))
    a, b = d.commands("survey")
    d.answer(b, "failed")
    d.answer(a, "inconclusive")
    (timer,) = _survey_timers(d)
    assert timer.delay_s == DOUBLING[1], "two failed answers in one round back off once"
