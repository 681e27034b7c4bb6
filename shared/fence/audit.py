"""The audit: fold a whole log with the writer's own ``fold`` and check the invariants.

It is deliberately independent of ``decide``: it trusts nothing but the log, so a bug in the policy
shows up here as a violation with the key and the position where it happened.

Invariants (DESIGN.md, "Audit and decision streams"):
  * per-key entries are contiguous (n = 1, 2, 3 … with no gap or repeat);
  * epochs strictly increase and a tombstoned uid is never admitted or acted for again;
  * every command carries the fence current at its position (a remove may carry the fence of the
    VM's own owner: cleaning up a predecessor is allowed);
  * every applied result (bound, released, hibernated) matches the fence and VM of its command,
    finished in the same entry (the policy decides a result together with its Done);
  * at most one VM per key is live (not being removed) at every position, and a VM name is bound to
    one incarnation at a time;
  * a pod's VM is placed only on the host its ``spec.nodeName`` names (once the log records one);
  * at the end every VM is released, hibernated, or bound to the live incarnation.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any, Literal

import msgspec

from shared.fence.schema import (
    Admitted,
    Adopted,
    Bound,
    Command,
    Commanded,
    Decision,
    Discovered,
    Done,
    Hibernated,
    LogEntry,
    Placed,
    Rebuilt,
    Released,
    Restarting,
    Skipped,
)
from shared.fence.state import FOLDS, KeyState

NODE_PREFIX = "vmfence-"  # a host's Node name is vmfence-<host> (shared.fence.podspec.NODE_PREFIX)

# the invariant a violation breaks (docs/architecture.md, "The audit", names each)
ViolationRule = Literal[
    "gap", "repeat", "wrong_key", "tombstone_returned", "epoch_not_increasing", "command_fence_not_current",
    "result_fence_mismatch", "bound_not_current", "vm_bound_twice", "two_vms_for_key", "unsettled_vm",
    "undecodable_entry", "placed_off_node",
]


class Violation(msgspec.Struct, frozen=True):
    key: str
    n: int
    rule: ViolationRule
    message: str
    seq: int | None = None


class InvariantCheck(msgspec.Struct, frozen=True):
    """One invariant as a report shows it: what it means, at how many positions it was checked,
    how many violations of it were found."""

    name: str
    meaning: str
    rules: list[str]  # the Violation.rule names that break it
    positions: int
    violations: int


class VMEvent(msgspec.Struct, array_like=True, frozen=True):
    """A VM bound to a key, or released or hibernated by it, as one shard of a sharded audit saw it:
    whether a VM is live for one key at a time spans keys, so the merge checks it (``vm_events``)."""

    seq: int
    key: str
    n: int
    vm_id: str
    bound: bool


# name, meaning, the violation rules that break it, the decision types at which it is checked
# ("entry": every entry; "vm": every VM left at the end, when the audit is final)
INVARIANTS: tuple[tuple[str, str, tuple[ViolationRule, ...], tuple[str, ...]], ...] = (
    ("entries_decode", "every stored entry decodes as a log entry of a known schema",
     ("undecodable_entry",), ("entry",)),
    ("contiguous", "each key's entries are numbered 1, 2, 3 ... with no gap and no repeat",
     ("gap", "repeat"), ("entry",)),
    ("epochs_increase", "a new incarnation gets a higher epoch than every earlier one; a tombstoned uid never returns",
     ("epoch_not_increasing", "tombstone_returned", "wrong_key"), ("admitted",)),
    ("commands_carry_the_current_fence",
     "every placement and command carries the fence current at its position (a remove: its VM owner's)",
     ("command_fence_not_current",), ("placed", "commanded")),
    ("results_match_their_commands",
     "every applied result names the VM and fence of the command it answers, finished in the same entry",
     ("result_fence_mismatch",), ("bound", "adopted", "released", "hibernated")),
    ("bound_only_to_the_current_incarnation", "a VM is bound only to the incarnation current at that position",
     ("bound_not_current",), ("bound",)),
    ("one_key_per_vm", "a VM is live for one key at a time", ("vm_bound_twice",), ("bound",)),
    ("one_live_vm_per_key", "a key never has two live VMs at once",
     ("two_vms_for_key",), ("placed", "commanded", "bound", "adopted", "released", "hibernated", "restarting",
                            "rebuilt", "discovered")),
    ("placed_on_its_node", "a pod's VM is placed only on the host its nodeName names",
     ("placed_off_node",), ("placed",)),
    ("settled_at_the_end", "at the end every VM is released, hibernated, or bound to the live incarnation",
     ("unsettled_vm",), ("vm",)),
)


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
    invariants: list[InvariantCheck] = msgspec.field(default_factory=list)
    final: bool = True  # end checks applied (the system had stopped)

    @property
    def clean(self) -> bool:
        return not self.violations


_LIVE_STATES = frozenset({"creating", "running", "exited", "hibernating", "waking", "adopting"})

# Decisions after which ``fold`` may have changed which VMs a key has or their states: only these
# can start (or end) "two live VMs for one key", so only these pay for counting them.
_VM_CHANGING: frozenset[type] = frozenset(
    {Placed, Commanded, Bound, Adopted, Released, Hibernated, Restarting, Rebuilt, Discovered}
)


_COUNT, _OWNER = "count", "owner"


class Auditor:
    """Feed entries in log order (per key order is what matters); ask for the report at the end.

    Per decision it does only what that decision's type needs: one table lookup finds its check
    (most types have none), the writer's own ``fold`` applies it, and live VMs are counted only
    after decisions that can change them (or while a key is already in violation, so a lasting
    violation is reported at every position as before)."""

    def __init__(self, *, shard: bool = False) -> None:
        self.states: dict[str, KeyState] = {}
        self._vm_owner: dict[str, str] = {}  # vm_id -> key that has it live
        # one shard of a sharded audit (it sees only some keys): instead of checking that a VM is
        # live for one key at a time, it records each bind and release for the merge to check
        self.vm_events: list[VMEvent] | None = [] if shard else None
        self._counts: dict[type[msgspec.Struct], int] = dict.fromkeys(FOLDS, 0)  # decisions fed, by type
        self._skipped: Counter[str] = Counter()
        self.found: list[Violation] = []  # violations found so far, in the order found
        self._entries = 0
        self._created = 0
        self._released = 0
        self._two_live: set[str] = set()  # keys whose last count found more than one live VM
        # VMs a log declared stranded (a force-deleted predecessor's, being removed on a dead host):
        # a successor's placement beside them is the operator's call, not a second VM of the policy's
        self._stranded: dict[str, set[str]] = {}
        self._checks: dict[type, Callable[[KeyState, dict[str, Command], Any, int, int | None], None]] = {
            Admitted: self._admitted,
            Placed: self._placed,
            Commanded: self._commanded,
            Bound: self._bound,
            Adopted: self._adopted,
            Released: self._released_vm,
            Hibernated: self._hibernated,
            Skipped: self._skipped_input,
            Done: self._done,
        }
        self._cmds: dict[str, Command] = {}  # of the entry being fed
        # per decision type, one lookup: its fold, its check (or None), and whether it may change
        # the key's VMs (_COUNT: count the live ones after it; _OWNER: also which key a VM is live for)
        self._plans: dict[type, tuple[Callable[[KeyState, Any], None], Any, str]] = {
            t: (fold_t, self._checks.get(t),
                _OWNER if t in (Bound, Released, Hibernated) else _COUNT if t in _VM_CHANGING else "")
            for t, fold_t in FOLDS.items()
        }

    def undecodable(self, key: str, seq: int | None, message: str) -> None:
        """A stored entry that did not decode (corrupt or forged): a violation at its position; the
        key's state is untouched, so the entries after it are judged as if it were absent."""
        self._entries += 1
        self._bad(key, 0, seq, "undecodable_entry", message)

    def _bad(self, key: str, n: int, seq: int | None, rule: ViolationRule, message: str) -> None:
        self.found.append(Violation(key, n, rule, message, seq))

    def feed(self, entry: LogEntry, seq: int | None = None) -> None:
        key = entry.key
        n = entry.n
        s = self.states.get(key)
        if s is None:
            s = self.states[key] = KeyState(key=key)
        # the commands this entry finishes: the policy decides a result in the same entry as its
        # command's Done (decide.tables._on_result), so a result is checked against those and nothing
        # older (which also keeps the audit's memory off the log's length)
        cmds = self._cmds
        if cmds:
            cmds.clear()
        self._entries += 1
        if n != s.n + 1:
            rule: ViolationRule = "gap" if n > s.n + 1 else "repeat"
            self._bad(key, n, seq, rule, f"entry {n} follows entry {s.n}")
        plans = self._plans
        counts = self._counts
        two_live = self._two_live
        for d in entry.decisions:
            t = type(d)
            counts[t] += 1
            fold_d, check, vms = plans[t]
            if check is not None:
                check(s, cmds, d, n, seq)
            fold_d(s, d)  # the writer's own fold (``fold`` looks up the same table)
            if vms:
                if len(s.vms) > 1:
                    self._count_live(s, n, seq)
                elif two_live and key in two_live:
                    two_live.discard(key)
                if vms is _OWNER:
                    self._owner_changed(d, key, n, seq)
            elif two_live and key in two_live:
                self._count_live(s, n, seq)
        s.n = n

    # ------------------------------------------------------------------ checks before the fold
    def _admitted(self, s: KeyState, cmds: dict[str, Command], d: Admitted, n: int, seq: int | None) -> None:
        f = d.fence
        if f.key != s.key:
            self._bad(s.key, n, seq, "wrong_key", f"admitted fence for {f.key}")
        if s.is_tombstoned(f.uid):
            self._bad(s.key, n, seq, "tombstone_returned", f"uid {f.uid} admitted after tombstone")
        if f.epoch <= s.epoch:
            self._bad(s.key, n, seq, "epoch_not_increasing", f"epoch {f.epoch} after {s.epoch}")

    def _placed(self, s: KeyState, cmds: dict[str, Command], d: Placed, n: int, seq: int | None) -> None:
        f, vm_id = d.fence, d.vm_id
        self._created += 1
        cur = s.cur
        if cur is None or cur.fence != f:
            self._bad(s.key, n, seq, "command_fence_not_current", f"placed {vm_id} for {f}")
        elif cur.spec.node is not None and cur.spec.node != f"{NODE_PREFIX}{d.host}":
            self._bad(s.key, n, seq, "placed_off_node",
                      f"placed {vm_id} on {d.host}; the pod is bound to {cur.spec.node}")
        if s.vms:
            stranded = self._stranded.get(s.key, set())
            others = [v for v in s.vms.values() if v.vm_id != vm_id
                      and not (v.state == "removing" and v.vm_id in stranded)]
            if others:
                names = ", ".join(f"{v.vm_id}({v.state})" for v in others)
                self._bad(s.key, n, seq, "two_vms_for_key", f"{vm_id} placed while {names} exist")

    def _commanded(self, s: KeyState, cmds: dict[str, Command], d: Commanded, n: int, seq: int | None) -> None:
        c = d.command
        op = c.op
        if op == "survey":
            return  # a read of what hosts have: no VM is touched
        if op == "remove":
            rec = s.vms.get(c.vm_id)
            if rec is not None and rec.fence != c.fence:
                self._bad(
                    s.key, n, seq, "command_fence_not_current",
                    f"remove of {c.vm_id} with {c.fence}, owner {rec.fence}",
                )
            return
        cur = s.cur
        if cur is None or cur.fence != c.fence or s.is_tombstoned(c.fence.uid):
            self._bad(s.key, n, seq, "command_fence_not_current", f"{op} {c.vm_id} with {c.fence}")

    def _bound(self, s: KeyState, cmds: dict[str, Command], d: Bound, n: int, seq: int | None) -> None:
        f, vm_id, cid = d.fence, d.vm_id, d.command_id
        key = s.key
        cmd = cmds.get(cid)
        if cmd is None or cmd.vm_id != vm_id or cmd.fence != f:
            self._bad(key, n, seq, "result_fence_mismatch", f"bound {vm_id} under {f} by {cid}")
        cur = s.cur
        if cur is None or cur.fence != f:
            self._bad(key, n, seq, "bound_not_current", f"bound {vm_id} to non-current {f}")
        if self.vm_events is None:
            owner = self._vm_owner.get(vm_id)
            if owner is not None and owner != key:
                self._bad(key, n, seq, "vm_bound_twice", f"{vm_id} already live for {owner}")

    def _adopted(self, s: KeyState, cmds: dict[str, Command], d: Adopted, n: int, seq: int | None) -> None:
        f, vm_id, cid = d.fence, d.vm_id, d.command_id
        cmd = cmds.get(cid)
        if cmd is None or cmd.op != "adopt" or cmd.vm_id != vm_id or cmd.fence != f:
            self._bad(s.key, n, seq, "result_fence_mismatch", f"adopted {vm_id} under {f} by {cid}")

    def _released_vm(self, s: KeyState, cmds: dict[str, Command], d: Released, n: int, seq: int | None) -> None:
        f, vm_id, cid = d.fence, d.vm_id, d.command_id
        self._released += 1
        rec = s.vms.get(vm_id)
        if rec is not None and rec.fence != f:
            self._bad(s.key, n, seq, "result_fence_mismatch", f"released {vm_id} under {f}")
        if cid is not None:
            cmd = cmds.get(cid)
            if cmd is None or cmd.vm_id != vm_id:
                self._bad(s.key, n, seq, "result_fence_mismatch", f"release of {vm_id} by {cid}")

    def _hibernated(self, s: KeyState, cmds: dict[str, Command], d: Hibernated, n: int, seq: int | None) -> None:
        self._released += 1
        rec = s.vms.get(d.vm_id)
        if rec is None or rec.fence != d.fence:
            self._bad(s.key, n, seq, "result_fence_mismatch", f"hibernated {d.vm_id} under {d.fence}")

    def _skipped_input(self, s: KeyState, cmds: dict[str, Command], d: Skipped, n: int, seq: int | None) -> None:
        self._skipped[d.reason] += 1
        if d.reason == "stranded":
            self._stranded.setdefault(s.key, set()).add(d.detail)

    def _done(self, s: KeyState, cmds: dict[str, Command], d: Done, n: int, seq: int | None) -> None:
        # a command finished by this entry: its results (bound, adopted, released) are checked against it
        pending = s.outbox.get(d.effect_id)
        if isinstance(pending, Commanded):
            cmds[d.effect_id] = pending.command

    # ------------------------------------------------------------------ checks after the fold
    def _owner_changed(self, d: Decision, key: str, n: int, seq: int | None) -> None:
        assert isinstance(d, Bound | Released | Hibernated)  # the plan says so
        if self.vm_events is not None:
            self.vm_events.append(VMEvent(seq or 0, key, n, d.vm_id, isinstance(d, Bound)))
        elif isinstance(d, Bound):
            self._vm_owner[d.vm_id] = key
        else:
            self._vm_owner.pop(d.vm_id, None)

    def _count_live(self, s: KeyState, n: int, seq: int | None) -> None:
        """After a decision that may change a key's VMs (or while it is in violation): more than one
        live VM is a violation at this position."""
        key = s.key
        vms = s.vms
        if len(vms) > 1 and sum(1 for v in vms.values() if v.state in _LIVE_STATES) > 1:
            names = ", ".join(v.vm_id for v in vms.values() if v.state in _LIVE_STATES)
            self._bad(key, n, seq, "two_vms_for_key", f"live VMs at once: {names}")
            self._two_live.add(key)
        else:
            self._two_live.discard(key)

    def report(self, *, final: bool = True) -> AuditReport:
        violations = list(self.found)
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
        by_type = {str(t.__struct_config__.tag): k for t, k in self._counts.items() if k}
        vms_at_end = sum(len(s.vms) for s in self.states.values()) if final else 0
        positions = [sum(self._entries if w == "entry" else vms_at_end if w == "vm" else by_type.get(w, 0)
                         for w in where) for _name, _meaning, _rules, where in INVARIANTS]
        invariants = _invariant_checks(positions, violations)
        return AuditReport(
            final=final,
            invariants=invariants,
            keys=len(self.states),
            entries=self._entries,
            decisions=sum(self._counts.values()),
            decisions_by_type=by_type,
            skipped=dict(self._skipped),
            vms_created=self._created,
            vms_released=self._released,
            vms_bound_live=bound_live,
            violations=violations,
        )


def _invariant_checks(positions: list[int], violations: list[Violation]) -> list[InvariantCheck]:
    broken = Counter(v.rule for v in violations)
    return [
        InvariantCheck(name, meaning, list(rules), positions=checked, violations=sum(broken[r] for r in rules))
        for (name, meaning, rules, _where), checked in zip(INVARIANTS, positions, strict=True)
    ]


def vm_bound_twice(events: Iterable[VMEvent]) -> list[tuple[int, Violation]]:
    """The check a sharded audit leaves to its merge, over every shard's VM events in stream order:
    a VM bound to a key while another key has it live. Each violation with the index of its event."""
    owner: dict[str, str] = {}
    found: list[tuple[int, Violation]] = []
    for i, e in enumerate(events):
        if e.bound:
            had = owner.get(e.vm_id)
            if had is not None and had != e.key:
                found.append((i, Violation(e.key, e.n, "vm_bound_twice", f"{e.vm_id} already live for {had}", e.seq)))
            owner[e.vm_id] = e.key
        else:
            owner.pop(e.vm_id, None)
    return found


def merge_reports(parts: list[AuditReport], cross_key: list[Violation]) -> AuditReport:
    """One report of shards that audited disjoint sets of keys of one log, plus the violations the
    merge found across them (``vm_bound_twice``). Counts add up; violations are in stream order
    (those found at the end, without a position, last)."""
    violations = sorted([v for p in parts for v in p.violations] + cross_key,
                        key=lambda v: (v.seq is None, v.seq or 0))
    by_type: Counter[str] = Counter()
    skipped: Counter[str] = Counter()
    for p in parts:
        by_type.update(p.decisions_by_type)
        skipped.update(p.skipped)
    positions = [sum(p.invariants[i].positions for p in parts) for i in range(len(INVARIANTS))]
    return AuditReport(
        keys=sum(p.keys for p in parts),
        entries=sum(p.entries for p in parts),
        decisions=sum(p.decisions for p in parts),
        decisions_by_type=dict(by_type),
        skipped=dict(skipped),
        vms_created=sum(p.vms_created for p in parts),
        vms_released=sum(p.vms_released for p in parts),
        vms_bound_live=sum(p.vms_bound_live for p in parts),
        violations=violations,
        invariants=_invariant_checks(positions, violations),
        final=all(p.final for p in parts),
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
