"""An observation or consistent read too large to log (a huge annotation) is decided as an invalid
spec — a Warning Event and the SpecValid=False condition, nothing of it in the log — so the key's
entry stays small and the key goes on (issue 10, finding 6)."""

from __future__ import annotations

from shared.fence.decide import within_bounds
from shared.fence.schema import (
    MAX_ENTRY_BYTES,
    MAX_OBJECT_BYTES,
    Admitted,
    Commanded,
    ConfirmedRead,
    ConfirmRequested,
    Failed,
    LogEntry,
    Observed,
    Spec,
    SpecChanged,
    WriteRequested,
    encode,
)
from tests.unit.driver import KEY, Driver, of

HUGE = Spec(image="x" * 250_000)


def _entry_bytes(d: Driver) -> int:
    return max(len(encode(LogEntry(e.key, e.n, e.decisions))) for e in d.log)


def _warnings(decisions: list) -> list[str]:  # type: ignore[type-arg]
    return [w.write.message or "" for w in of(decisions, WriteRequested)
            if w.write.verb == "event" and w.write.event_type == "Warning"]


def test_a_huge_read_is_admitted_as_an_invalid_spec_with_a_warning() -> None:
    d = Driver()
    d.feed(Observed(KEY, "u1", 1, spec=HUGE))
    (req,) = d.pending(ConfirmRequested)
    out = d.feed(ConfirmedRead(KEY, req.request, "u1", 1, spec=HUGE))
    (admitted,) = of(out, Admitted)
    assert admitted.spec == Spec() and admitted.invalid is not None and "bytes" in admitted.invalid
    assert of(out, Failed) and of(out, Commanded) == []
    assert any("above the bound" in m for m in _warnings(out)), "the pod gets a Warning Event saying why"
    assert d.state.cur is not None and d.state.cur.status is not None and d.state.cur.status.invalid
    assert _entry_bytes(d) < MAX_OBJECT_BYTES < MAX_ENTRY_BYTES


def test_a_huge_change_to_a_running_pod_keeps_its_vm_and_says_why() -> None:
    d = Driver()
    d.run_up("u1", Spec(cpus=2, node="vmfence-host-a"))
    out = d.feed(Observed(KEY, "u1", d.next_rv(), spec=HUGE))
    (change,) = of(out, SpecChanged)
    assert change.spec == Spec(cpus=2, node="vmfence-host-a") and change.invalid is not None, \
        "the VM keeps its last valid spec"
    assert _warnings(out) and d.state.cur is not None and d.state.cur.bound
    assert _entry_bytes(d) < MAX_OBJECT_BYTES


def test_inputs_within_the_bound_are_untouched() -> None:
    ok = Observed(KEY, "u1", 1, spec=Spec(image="debian-12"))
    assert within_bounds(ok) is ok
