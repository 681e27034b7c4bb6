"""The API server's silence, per kind of request (services/reconciler/silence.py): what waits for
its next answer goes when it comes, the oldest first as a canary meanwhile; what went early and
failed again waits out its own delay once before it may go early again; reads and writes apart."""

from __future__ import annotations

import asyncio

from services.reconciler.effects import EffectRunner
from services.reconciler.kube import NullGateway
from services.reconciler.silence import Silence
from shared.bus.connect import Bus
from shared.fence.keys import Key
from shared.fence.schema import Fence, KubeWrite, TimerArmed, WriteDone, WriteRequested

REWRITE = "rewrite/status"


def test_what_waits_goes_when_the_server_answers_and_only_then() -> None:
    s = Silence()
    s.wait("a", "t1", REWRITE)
    assert len(s) == 0, "nothing waits for a server that answers"
    s.failed("b")
    s.wait("a", "t1", REWRITE)
    s.wait("b", "t2", REWRITE)
    assert s.answered() and s.release() == [("a", "t1"), ("b", "t2")]
    assert not s.answered(), "answered once: the silence is over"


def test_what_went_early_waits_out_its_own_delay_before_it_goes_early_again() -> None:
    """A webhook of one namespace times out: b's writes are never answered while a's are. b goes
    early once per delay of its own at most, not at the pace of a's answers."""
    s = Silence()
    s.failed("b")
    s.wait("b", "t1", REWRITE)
    s.answered()
    assert s.release() == [("b", "t1")]  # a's write answered: b goes early
    s.failed("b")  # and is not answered again
    s.wait("b", "t2", REWRITE)
    assert len(s) == 0, "b went early and failed: it waits out its delay"
    s.answered()
    assert s.release() == []
    s.waited_out("b", REWRITE)  # its timer ran out (it failed again: silent)
    s.failed("b")
    s.wait("b", "t3", REWRITE)
    assert s.answered() and s.release() == [("b", "t3")], "early again, once"


def test_canaries_go_oldest_first_and_a_failed_one_waits_at_the_back() -> None:
    """A canary is not held to waiting out its delay (canaries go one a second whatever answers):
    the server found back later releases it with the rest, not 30 s after."""
    s = Silence()
    s.failed("b")
    for key in ("a", "b"):
        s.wait(key, key, "parked")
    assert s.canary() == ("a", "a")
    s.wait("a", "a", "parked")  # it failed: at the back
    assert s.canary() == ("b", "b") and s.canary() == ("a", "a") and s.canary() is None
    s.wait("a", "a", "parked")
    assert s.answered() and s.release() == [("a", "a")]


def test_dropped_keys_wait_no_more() -> None:
    s = Silence()
    s.failed("b")
    s.wait("p0/a", "t1", REWRITE)
    s.wait("p1/b", "t2", REWRITE)
    s.drop_keys(lambda key: key.startswith("p0/"))
    s.drop("p1/b", "t2")
    assert s.release() == []


def _write(key: str, n: int) -> WriteRequested:
    return WriteRequested(KubeWrite(f"status:{n}", "status", Fence(key, "u1", 1)))


async def test_a_write_the_server_never_answers_for_one_key_goes_early_at_most_every_other_time(bus: Bus) -> None:
    """Key b's writes time out (a webhook of its namespace), key a's are answered: each answer of
    a's fires the rewrites that wait for one. b's rewrite goes early, fails, and waits out its own
    delay before it may go early again: without that, b is written at a's pace."""
    fired: list[str] = []
    due = asyncio.Event()

    class Gateway(NullGateway):
        async def write(self, key: Key, write: KubeWrite) -> WriteDone:
            if str(key) == "default/b":
                return WriteDone(write.fence, write.id, "failed", "504 webhook", unanswered=True)
            return WriteDone(write.fence, write.id, "ok")

    async def feed(key: str, inp: object) -> bool:
        return True

    runner = EffectRunner(bus.js, bus.subjects, Gateway(), feed=feed)  # type: ignore[arg-type]
    submit = runner.submit

    def capture(key: str, work: object) -> None:
        if hasattr(work, "timer"):
            fired.append(key)
            due.set()
        else:
            submit(key, work)  # type: ignore[arg-type]

    runner.submit = capture  # type: ignore[method-assign]
    a, b = Key.parse("default/a"), Key.parse("default/b")

    def arm_b(n: int, delay: float) -> None:
        runner.submit_all("default/b", [TimerArmed(Fence("default/b", "u1", 1), f"timer:{n}", delay, REWRITE)])

    await runner._execute(b, _write("default/b", 1))
    arm_b(1, 3600.0)
    await runner._execute(a, _write("default/a", 2))
    assert fired == ["default/b"], "a's answer fires b's rewrite"
    await runner._execute(b, _write("default/b", 3))  # b's rewrite: not answered again
    arm_b(2, 0.01)  # its next backoff, short here
    await runner._execute(a, _write("default/a", 4))
    assert fired == ["default/b"], "b went early and failed: not early again before its own delay"
    due.clear()
    await asyncio.wait_for(due.wait(), 10)  # b's own delay ran out: its timer fired
    assert fired == ["default/b", "default/b"]
    await runner._execute(b, _write("default/b", 5))
    arm_b(3, 3600.0)
    await runner._execute(a, _write("default/a", 6))
    assert fired == ["default/b"] * 3, "having waited out a delay, b goes early again"
    runner.close()


async def test_a_read_answered_says_nothing_of_the_writes(bus: Bus) -> None:
    runner = EffectRunner(bus.js, bus.subjects, NullGateway())
    runner.submit = lambda key, work: None  # type: ignore[method-assign]
    runner._write_answered(False, "default/b")
    runner.submit_all("default/b", [TimerArmed(Fence("default/b", "u1", 1), "timer:1", 3600.0, REWRITE)])
    runner.read_answered(False, "default/c")
    runner.read_answered(True, "default/c")  # the reads' silence ends
    assert not runner.reads_silent
    assert len(runner.writes) == 1 and runner.writes.silent, "a read's answer fired a write's wait"
    runner.read_answered(False, "default/c")
    runner._write_answered(True, "default/a")
    assert len(runner.writes) == 0 and runner.reads_silent, "a write's answer ended the reads' silence"
    runner.close()


def test_a_write_that_failed_in_a_silence_that_ended_before_its_retry_was_armed_goes_at_once() -> None:
    """Its failure was decided while another write's answer ended the silence: its retry, armed
    after, waits for no answer (none is coming) and goes at once, not after its backoff."""
    s = Silence()
    s.failed("b")
    assert s.answered()  # another key's write answered
    assert s.release() == []  # b's retry is not armed yet
    assert s.wait("b", "t1", REWRITE), "armed after the silence ended: at once"
    assert not s.wait("b", "t2", REWRITE), "once: it went early and waits out its delay"
    s.done("b", REWRITE)
    assert not s.wait("b", "t3", REWRITE), "answered since: nothing to go early for"


def test_failures_are_not_kept_past_the_silence_after_theirs() -> None:
    s = Silence()
    s.failed("gone")  # a key deleted while its writes failed: never answered
    s.answered()
    assert "gone" in s._failed_in, "kept while its silence is the last that ended"
    s.failed("other")
    s.answered()
    assert "gone" not in s._failed_in and "other" in s._failed_in
