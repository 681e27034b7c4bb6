"""A pod no host takes is checked again after a delay that doubles per check in a row, up to a cap
(``place_retry_s``), and starts again from the first delay once it is placed: a fleet whose hosts
are all gone does not log an entry per pending pod every 2 s for as long as that lasts."""

from __future__ import annotations

from shared.fence.audit import audit
from shared.fence.decide import PLACE_RETRY_MAX_S, PLACE_RETRY_S, DecideEnv, HostView, place_retry_s
from shared.fence.schema import Spec, TimerArmed, TimerFired
from tests.unit.driver import Driver, of

A = HostView("host-a", 8, 8192)
ON_A = Spec(node="vmfence-host-a")


def _place_delays(out: list) -> list[float]:  # type: ignore[type-arg]
    return [t.delay_s for t in of(out, TimerArmed) if t.purpose == "place"]


def _fire_place(d: Driver) -> list:  # type: ignore[type-arg]
    (timer,) = [t for t in d.timers() if t.purpose == "place"]
    return d.feed(TimerFired(timer.fence, timer.timer_id))


def test_the_delay_doubles_from_the_first_retry_up_to_the_cap() -> None:
    assert [place_retry_s(n) for n in range(7)] == [2.0, 4.0, 8.0, 16.0, 32.0, 60.0, 60.0]
    assert place_retry_s(0) == PLACE_RETRY_S and place_retry_s(10**6) == PLACE_RETRY_MAX_S


def test_each_check_that_finds_no_host_waits_twice_as_long_as_the_last() -> None:
    d = Driver(env=DecideEnv(hosts=[]))  # host-a has no heartbeat
    delays = _place_delays(d.admit("u1", ON_A))
    for _ in range(6):
        delays += _place_delays(_fire_place(d))
    assert delays == [2.0, 4.0, 8.0, 16.0, 32.0, 60.0, 60.0]
    assert d.commands("create") == []
    assert audit(d.log, final=False).clean


def test_the_backoff_starts_again_once_the_pod_is_placed() -> None:
    d = Driver(env=DecideEnv(hosts=[]))
    d.admit("u1", ON_A)
    _fire_place(d)
    _fire_place(d)
    assert d.state.cur is not None and d.state.cur.unplaced_tries == 3
    d.env = DecideEnv(hosts=[A])  # the node comes back: the VM is made there
    _fire_place(d)
    (create,) = d.commands("create")
    assert create.host == "host-a"
    assert d.state.cur.unplaced_tries == 0 and d.state.cur.unplaced is None


def _survey_delays(out: list) -> list[float]:  # type: ignore[type-arg]
    return [t.delay_s for t in of(out, TimerArmed) if t.purpose == "survey"]


def test_a_survey_with_no_live_host_waits_twice_as_long_each_time_and_goes_out_when_one_is() -> None:
    """An unverified key (loaded from a log that may have lost a tail) surveys every host before its
    first VM; with none live it asks again after 2, 4, 8 … up to 60 s, not every 2 s."""
    d = Driver(env=DecideEnv(hosts=[]))
    d.state.unverified = True
    delays = _survey_delays(d.admit("u1"))
    for _ in range(6):
        (timer,) = [t for t in d.timers() if t.purpose == "survey"]
        delays += _survey_delays(d.feed(TimerFired(timer.fence, timer.timer_id)))
    assert delays == [2.0, 4.0, 8.0, 16.0, 32.0, 60.0, 60.0]
    assert d.commands("survey") == []
    d.env = DecideEnv(hosts=[A])
    (timer,) = [t for t in d.timers() if t.purpose == "survey"]
    d.feed(TimerFired(timer.fence, timer.timer_id))
    assert [c.host for c in d.commands("survey")] == ["host-a"]
