"""Oracles the chaos campaigns share: what the hosts really run (QEMU processes and sim host state,
read from the operating system, never from vmfence), and what the log must say once the faults
have stopped."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shared.bus.logstream import Record
from shared.fence.schema import Admitted, Bound, Forgotten, Hibernated, Superseded
from shared.fence.state import KeyState, fold

LIVE_STATES = ("running", "paused", "creating")  # sim VM states that count as a VM
NS = "default"  # the campaigns' pods
HOSTS = ("host-a", "host-b")  # the process campaign's hosts
ORACLE_PERIOD_S = 0.1


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


# ------------------------------------------------------------------------------ what hosts run


def incarnation_of(vm_id: str, labels: dict[str, str]) -> tuple[str, str]:
    """(key, uid prefix) of a VM: from the labels the agent stored, else from the VM name, which
    embeds the sanitized pod name and the uid's first 8 hex digits (our pod names are already safe)."""
    key = labels.get("vmfence.io/key")
    uid = labels.get("vmfence.io/uid")
    if key and uid:
        return key, uid.replace("-", "")[:8]
    name, uid8, _gen = ([*vm_id.rsplit("-", 2), "", ""])[:3]
    return f"{NS}/{name}", uid8


@dataclass(frozen=True)
class SeenVM:
    vm_id: str
    key: str
    uid8: str
    pid: int | None  # the QEMU pid; None for the sim runtime
    host: str


def proc_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2 :].split(" ", 1)[0] not in ("Z", "X")


def scan_qemu(run_dir: Path) -> list[SeenVM]:
    """Every live QEMU whose pidfile is ``<run_dir>/agents/<host>/runtime/vms/<vm>/qemu.pid``."""
    prefix = str(run_dir.resolve() / "agents") + os.sep
    out: list[SeenVM] = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid = int(entry)
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if not argv or b"qemu-system" not in os.path.basename(argv[0]):
            continue
        try:
            pidfile = argv[argv.index(b"-pidfile") + 1].decode()
        except (ValueError, IndexError):
            continue
        if not pidfile.startswith(prefix) or not proc_alive(pid):
            continue
        vm_dir = os.path.dirname(pidfile)
        vm_id = os.path.basename(vm_dir)
        host = pidfile[len(prefix) :].split(os.sep, 1)[0]
        labels: dict[str, str] = {}
        with contextlib.suppress(OSError, ValueError):
            with open(os.path.join(vm_dir, "spec.json")) as f:
                labels = dict((json.load(f).get("spec") or {}).get("labels") or {})
        key, uid8 = incarnation_of(vm_id, labels)
        out.append(SeenVM(vm_id, key, uid8, pid, host))
    return out


def scan_sim(run_dir: Path) -> list[SeenVM]:
    """VMs the sim hosts record as existing (the file outlives a SIGKILLed agent, like a host)."""
    from services.agent.runtime.sim import load_host

    out: list[SeenVM] = []
    for host in HOSTS:
        try:
            rec = load_host(str(run_dir / "agents" / host / "runtime"))
        except (OSError, ValueError):
            continue
        for vm_id, vm in rec.vms.items():
            if vm.state in LIVE_STATES:
                key, uid8 = incarnation_of(vm_id, dict(vm.spec.labels))
                out.append(SeenVM(vm_id, key, uid8, None, host))
    return out


class Oracle:
    """Samples the OS (or the sim host files) and keeps the worst VM count per key and incarnation.

    One scan is not atomic (a VM may exit while a later one is read), so a sample with two VMs for
    one key is confirmed by a second scan: VM names are never reused, so two VMs present in both
    scans existed at the same instant (the moment the second scan read the first of them).
    """

    def __init__(self, run_dir: Path, runtime: str, forced: set[tuple[str, str]] | None = None) -> None:
        self.run_dir = run_dir
        self.runtime = runtime
        self.samples = 0
        self.max_per_key = 0
        self.max_per_incarnation = 0
        self.worst: list[str] = []
        # (key, uid8) of incarnations the workload force-deleted (grace 0): the operator's word that
        # the VM is out of the way, so a successor may start elsewhere while that VM's host is not
        # live (issue 11, decide.bringup._stranded). Such an overlap is counted apart, never in max_per_key.
        self.forced = forced if forced is not None else set()
        self.forced_overlaps: list[str] = []

    def scan(self) -> list[SeenVM]:
        return scan_qemu(self.run_dir) if self.runtime == "qemu" else scan_sim(self.run_dir)

    @staticmethod
    def _group(vms: list[SeenVM], by_incarnation: bool) -> dict[Any, set[str]]:
        out: dict[Any, set[str]] = {}
        for vm in vms:
            out.setdefault((vm.key, vm.uid8) if by_incarnation else vm.key, set()).add(vm.vm_id)
        return out

    def sample(self) -> None:
        first = self.scan()
        self.samples += 1
        per_key = self._group(first, False)
        worst = max((len(v) for v in per_key.values()), default=0)
        if worst > 1:
            second = {vm.vm_id for vm in self.scan()}
            per_key = {k: v & second for k, v in per_key.items()}
            per_inc = {k: v & second for k, v in self._group(first, True).items()}
        else:
            per_inc = self._group(first, True)
        incarnation = {vm.vm_id: (vm.key, vm.uid8) for vm in first}
        for k, v in per_key.items():
            unforced = {vm for vm in v if incarnation.get(vm) not in self.forced}
            if len(v) > 1 and len(unforced) <= 1:
                self.forced_overlaps.append(
                    f"{k}: {sorted(v)} at once, all but one force-deleted (t={time.time():.1f})")
                self.max_per_key = max(self.max_per_key, 1)
                continue
            if len(v) > 1:
                self.worst.append(f"{k}: {sorted(v)} at once (t={time.time():.1f})")
            self.max_per_key = max(self.max_per_key, len(v))
        for v in per_inc.values():
            self.max_per_incarnation = max(self.max_per_incarnation, len(v))

    async def run(self) -> None:
        while True:
            await asyncio.to_thread(self.sample)
            await asyncio.sleep(ORACLE_PERIOD_S)


def qemu_pids_under(run_dir: Path) -> list[int]:
    """Every live QEMU whose command line names a path under run_dir — VMs and also the agent's
    accel-probe QEMU (no pidfile; it survives an agent SIGKILLed mid-probe)."""
    needle = str(run_dir.resolve()).encode() + b"/"
    pids: list[int] = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if argv and b"qemu-system" in os.path.basename(argv[0]) and any(needle in a for a in argv[1:]):
            if proc_alive(int(entry)):
                pids.append(int(entry))
    return pids


def kill_leftover_qemu(run_dir: Path) -> int:
    """SIGKILL every QEMU of this run still alive (the last line of cleanup)."""
    n = 0
    for pid in qemu_pids_under(run_dir):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
            n += 1
    return n
