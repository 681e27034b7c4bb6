"""Oracles the chaos campaigns share: what the log must say once the faults have stopped."""

from __future__ import annotations

from shared.bus.logstream import Record
from shared.fence.schema import Admitted, Bound, Forgotten, Hibernated, Superseded
from shared.fence.state import KeyState, fold

LIVE_STATES = ("running", "paused", "creating")  # sim VM states that count as a VM


def lost_inputs(records: list[Record], live: dict[str, tuple[str, bool]]) -> list[str]:
    """Every acknowledged input eventually decided: each live pod (key -> (uid, hibernate wanted))
    is the log's current incarnation, bound to a VM or hibernated as asked; every admitted
    incarnation that is gone was ended (Superseded or Forgotten). One line per miss."""
    states: dict[str, KeyState] = {}
    admitted: dict[str, set[str]] = {}
    ended: set[str] = set()
    decided: dict[str, set[str]] = {}  # uid -> names of decisions that settle it
    for rec in records:
        s = states.setdefault(rec.entry.key, KeyState(key=rec.entry.key))
        for d in rec.entry.decisions:
            match d:
                case Admitted(fence=f):
                    admitted.setdefault(f.key, set()).add(f.uid)
                case Superseded(fence=f) | Forgotten(fence=f):
                    ended.add(f.uid)
                case Bound(fence=f) | Hibernated(fence=f):
                    decided.setdefault(f.uid, set()).add(type(d).__name__)
            fold(s, d)
        s.n = rec.entry.n
    lost: list[str] = []
    for key, (uid, want_hib) in live.items():
        s = states.get(key)
        cur = s.cur if s is not None else None
        if cur is None or cur.fence.uid != uid:
            lost.append(f"{key} uid {uid}: live pod, log's current incarnation is {cur.fence.uid if cur else None}")
        elif not (cur.hibernated if want_hib else (cur.bound and cur.vm_id is not None)):
            lost.append(f"{key} uid {uid}: live pod (hibernate={want_hib}) but the log says bound={cur.bound} "
                        f"hibernated={cur.hibernated} ({sorted(decided.get(uid, ()))})")
    for key, uids in admitted.items():
        live_uid = live.get(key, ("", False))[0]
        for uid in sorted(uids - ended - {live_uid}):
            lost.append(f"{key} uid {uid}: deleted incarnation never Superseded/Forgotten")
    return lost
