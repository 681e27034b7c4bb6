"""The audit: fold a whole log with the writer's own ``fold`` and check the invariants.

It is deliberately independent of ``decide``: it trusts nothing but the log, so a bug in the policy
shows up here as a violation with the key and the position where it happened.

Invariants (DESIGN.md, "Audit and decision streams"):
  * per-key entries are contiguous (n = 1, 2, 3 … with no gap or repeat);
  * epochs strictly increase and a tombstoned uid is never admitted or acted for again;
  * every command carries the fence current at its position (a remove may carry the fence of the
    VM's own owner: cleaning up a predecessor is allowed);
  * every applied result (bound, released, hibernated) matches its command's fence and VM;
  * at most one VM per key is live (not being removed) at every position, and a VM name is bound to
    one incarnation at a time;
  * at the end every VM is released, hibernated, or bound to the live incarnation.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

import msgspec

from shared.schema import (
    Admitted,
    Adopted,
    Bound,
    Command,
    Commanded,
    Decision,
    Done,
    Hibernated,
    LogEntry,
    Placed,
    Released,
    Skipped,
    decision_name,
)
from shared.state import KeyState, fold


class Violation(msgspec.Struct, frozen=True):
    key: str
    n: int
    rule: str
    message: str
    seq: int | None = None


class AuditReport(msgspec.Struct):
    keys: int = 0
    entries: int = 0
    decisions: int = 0
    decisions_by_type: dict[str, int] = msgspec.field(default_factory=dict)
    skipped: dict[str, int] = msgspec.field(default_factory=dict)
    vms_created: int = 0
    vms_released: int = 0
    vms_bound_live: int = 0
    violations: list[Violation] = msgspec.field(default_factory=list)

    @property
    def clean(self) -> bool:
        return not self.violations


_LIVE_STATES = {"creating", "running", "exited", "hibernating", "waking", "adopting"}


class Auditor:
    """Feed entries in log order (per key order is what matters); ask for the report at the end."""

    def __init__(self) -> None:
        self.states: dict[str, KeyState] = {}
        self._commands: dict[str, dict[str, Command]] = {}
        self._vm_owner: dict[str, str] = {}  # vm_id -> key that has it live
        self._types: Counter[str] = Counter()
        self._skipped: Counter[str] = Counter()
        self._violations: list[Violation] = []
        self._entries = 0
        self._created = 0
        self._released = 0

    def _bad(self, key: str, n: int, seq: int | None, rule: str, message: str) -> None:
        self._violations.append(Violation(key, n, rule, message, seq))

    def feed(self, entry: LogEntry, seq: int | None = None) -> None:
        key = entry.key
        s = self.states.get(key)
        if s is None:
            s = self.states[key] = KeyState(key=key)
        self._entries += 1
        if entry.n != s.n + 1:
            rule = "gap" if entry.n > s.n + 1 else "repeat"
            self._bad(key, entry.n, seq, rule, f"entry {entry.n} follows entry {s.n}")
        cmds = self._commands.setdefault(key, {})
        for d in entry.decisions:
            self._types[decision_name(d)] += 1
            self._check(s, cmds, d, entry.n, seq)
            if isinstance(d, Done):
                pending = s.outbox.get(d.effect_id)
                if isinstance(pending, Commanded):
                    cmds[d.effect_id] = pending.command
            fold(s, d)
            self._check_after(s, d, entry.n, seq)
        s.n = entry.n

    def _check(self, s: KeyState, cmds: dict[str, Command], d: Decision, n: int, seq: int | None) -> None:
        key = s.key
        cur = s.cur
        match d:
            case Admitted(fence=f):
                if f.key != key:
                    self._bad(key, n, seq, "wrong_key", f"admitted fence for {f.key}")
                if s.is_tombstoned(f.uid):
                    self._bad(key, n, seq, "tombstone_returned", f"uid {f.uid} admitted after tombstone")
                if f.epoch <= s.epoch:
                    self._bad(key, n, seq, "epoch_not_increasing", f"epoch {f.epoch} after {s.epoch}")
            case Placed(fence=f, vm_id=vm_id):
                self._created += 1
                if cur is None or cur.fence != f:
                    self._bad(key, n, seq, "command_fence_not_current", f"placed {vm_id} for {f}")
                others = [v for v in s.vms.values() if v.vm_id != vm_id]
                if others:
                    names = ", ".join(f"{v.vm_id}({v.state})" for v in others)
                    self._bad(key, n, seq, "two_vms_for_key", f"{vm_id} placed while {names} exist")
            case Commanded(command=c):
                rec = s.vms.get(c.vm_id)
                if c.op == "survey":
                    pass  # a read of what hosts have: no VM is touched
                elif c.op == "remove":
                    if rec is not None and rec.fence != c.fence:
                        self._bad(
                            key, n, seq, "command_fence_not_current",
                            f"remove of {c.vm_id} with {c.fence}, owner {rec.fence}",
                        )
                elif cur is None or cur.fence != c.fence or s.is_tombstoned(c.fence.uid):
                    self._bad(key, n, seq, "command_fence_not_current", f"{c.op} {c.vm_id} with {c.fence}")
            case Bound(fence=f, vm_id=vm_id, command_id=cid):
                cmd = cmds.get(cid)
                if cmd is None or cmd.vm_id != vm_id or cmd.fence != f:
                    self._bad(key, n, seq, "result_fence_mismatch", f"bound {vm_id} under {f} by {cid}")
                if cur is None or cur.fence != f:
                    self._bad(key, n, seq, "bound_not_current", f"bound {vm_id} to non-current {f}")
                owner = self._vm_owner.get(vm_id)
                if owner is not None and owner != key:
                    self._bad(key, n, seq, "vm_bound_twice", f"{vm_id} already live for {owner}")
            case Adopted(fence=f, vm_id=vm_id, command_id=cid):
                cmd = cmds.get(cid)
                if cmd is None or cmd.op != "adopt" or cmd.vm_id != vm_id or cmd.fence != f:
                    self._bad(key, n, seq, "result_fence_mismatch", f"adopted {vm_id} under {f} by {cid}")
            case Released(fence=f, vm_id=vm_id, command_id=cid):
                self._released += 1
                rec = s.vms.get(vm_id)
                if rec is not None and rec.fence != f:
                    self._bad(key, n, seq, "result_fence_mismatch", f"released {vm_id} under {f}")
                if cid is not None:
                    cmd = cmds.get(cid)
                    if cmd is None or cmd.vm_id != vm_id:
                        self._bad(key, n, seq, "result_fence_mismatch", f"release of {vm_id} by {cid}")
            case Hibernated(fence=f, vm_id=vm_id):
                self._released += 1
                rec = s.vms.get(vm_id)
                if rec is None or rec.fence != f:
                    self._bad(key, n, seq, "result_fence_mismatch", f"hibernated {vm_id} under {f}")
            case Skipped(reason=reason):
                self._skipped[reason] += 1
            case _:
                pass

    def _check_after(self, s: KeyState, d: Decision, n: int, seq: int | None) -> None:
        live = [v for v in s.vms.values() if v.state in _LIVE_STATES]
        if len(live) > 1:
            names = ", ".join(v.vm_id for v in live)
            self._bad(s.key, n, seq, "two_vms_for_key", f"live VMs at once: {names}")
        if isinstance(d, Bound):
            self._vm_owner[d.vm_id] = s.key
        elif isinstance(d, Released | Hibernated):
            self._vm_owner.pop(d.vm_id, None)

    def report(self, *, final: bool = True) -> AuditReport:
        violations = list(self._violations)
        bound_live = 0
        for key, s in self.states.items():
            for rec in s.vms.values():
                cur = s.cur
                if cur is not None and cur.fence == rec.fence and cur.bound and cur.vm_id == rec.vm_id:
                    bound_live += 1
                elif final:
                    violations.append(
                        Violation(
                            key, s.n, "unsettled_vm",
                            f"{rec.vm_id} on {rec.host} ({rec.state}, {rec.fence.uid}) is neither "
                            "released, hibernated nor bound to the live incarnation",
                        )
                    )
        return AuditReport(
            keys=len(self.states),
            entries=self._entries,
            decisions=sum(self._types.values()),
            decisions_by_type=dict(self._types),
            skipped=dict(self._skipped),
            vms_created=self._created,
            vms_released=self._released,
            vms_bound_live=bound_live,
            violations=violations,
        )


def audit(entries: Iterable[LogEntry | tuple[int | None, LogEntry]], *, final: bool = True) -> AuditReport:
    auditor = Auditor()
    for item in entries:
        if isinstance(item, tuple):
            seq, entry = item
            auditor.feed(entry, seq)
        else:
            auditor.feed(item)
    return auditor.report(final=final)
