"""What one partition's log binds where, against the hosts' inventory rounds.

Kept beside the key states after every fold (``index``), so a host's round can be compared with
it without a scan of every key: a VM the log binds on a host that a complete round did not name
is reported (``note``), and one no round has named for a while is reported by the sweep
(``stale``). Either only makes the partition feed an ``Inventoried(ABSENT)`` to the key, for
which decide asks an inspect — a re-check, never an eviction on its own (rule 8).
"""

from __future__ import annotations

import time

from shared.fence.schema import ABSENT, Inventoried
from shared.fence.state import KeyState


class _Round:
    """One inventory round of one host as this partition saw it: the VMs the log bound there when
    its first item arrived, and the VMs its items named."""

    def __init__(self, round_id: str, expected: dict[str, str]) -> None:
        self.round_id = round_id
        self.expected = expected
        self.seen: set[str] = set()


class InventoryIndex:
    def __init__(self) -> None:
        self._bound_on: dict[str, dict[str, str]] = {}  # host -> key -> vm_id
        self._rounds: dict[str, _Round] = {}  # host -> the inventory round last seen here
        self._last_listed: dict[tuple[str, str], float] = {}  # (key, vm_id) -> when a round last named it

    def index(self, key: str, state: KeyState) -> None:
        """Keep the index equal to what ``state`` binds (called after every fold of the key)."""
        cur = state.cur
        bound = (cur.host, cur.vm_id) if cur is not None and cur.bound and cur.host and cur.vm_id else None
        for host, keys in self._bound_on.items():
            old = keys.get(key)
            if old is not None and bound != (host, old):
                del keys[key]
                self._last_listed.pop((key, old), None)
        if bound is not None:
            host, vm_id = bound
            keys = self._bound_on.setdefault(host, {})
            if keys.get(key) != vm_id:
                keys[key] = vm_id
                self._last_listed[(key, vm_id)] = time.monotonic()

    def note(self, key: str, inp: Inventoried) -> list[tuple[str, str, str, str]]:
        """An item of a host's inventory round. Agents publish a round's items one after another,
        so the first item of a newer round shows the previous one complete here: every VM the log
        bound on that host when it began and no item of it named is returned (key, vm, host, round)."""
        if inp.state == ABSENT or not inp.round:
            return []
        if self._bound_on.get(inp.host, {}).get(key) == inp.vm_id:
            self._last_listed[(key, inp.vm_id)] = time.monotonic()
        r = self._rounds.get(inp.host)
        done: _Round | None = None
        if r is None or r.round_id != inp.round:
            done = r
            r = self._rounds[inp.host] = _Round(inp.round, dict(self._bound_on.get(inp.host, {})))
        r.seen.add(inp.vm_id)
        if done is None:
            return []
        now_bound = self._bound_on.get(inp.host, {})
        return [
            (k, vm_id, inp.host, done.round_id)
            for k, vm_id in done.expected.items()
            if vm_id not in done.seen and now_bound.get(k) == vm_id
        ]

    def stale(self, live_hosts: set[str], stale_s: float) -> list[tuple[str, str, str]]:
        """(key, vm_id, host) of every VM bound on a live host that no round has named for
        ``stale_s``; each is reported once per stale period."""
        now = time.monotonic()
        out = []
        for host, keys in self._bound_on.items():
            if host not in live_hosts:
                continue
            for key, vm_id in keys.items():
                if now - self._last_listed.get((key, vm_id), now) >= stale_s:
                    self._last_listed[(key, vm_id)] = now
                    out.append((key, vm_id, host))
        return out
