"""In-process, deterministic, fault-injectable runtime driver.

The sim "host" is a record of VMs that outlives the agent process when ``state_dir`` is given:
``sim-host.json`` (the whole record, rewritten atomically at open, close and compaction) and
``sim-host.journal`` (one line per effect, the changed VM only), so an effect costs the same at
ten VMs as at ten thousand; ``load_host`` reads both (a torn last line is ignored). Tests use ``running_vms()`` and
``history`` as an oracle independent of the agent's own ledger.

Faults (``driver.faults``):
  - ``fail(op, ...)``: the op raises RuntimeFailure before any effect.
  - ``delay(op, seconds, ...)``: the op sleeps before its effect.
  - ``crash_after(op, ...)``: the effect is applied (and persisted), then AgentCrash is raised:
    the "agent died between effect and report" case.
  - ``inconclusive(...)``: inspect raises Inconclusive.
  - ``driver.crash_vm(vm_id)``: the VM exits (-> VMExitedEvent).
  - ``driver.lose_vm(vm_id)``: the host forgets the VM silently; inspect then returns None and a
    VMGoneEvent is published when the driver notices (inspect, list or reconcile()).
Each rule matches an op name ("*" = any), optionally a vm_id, fires ``times`` times (None =
forever) and/or with a ``probability`` drawn from the driver's seeded random.Random.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import time
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec

from .base import (
    EventHub,
    EventSubscription,
    Inconclusive,
    RuntimeFailure,
    SnapshotInfo,
    VMExitedEvent,
    VMGoneEvent,
    VMInfo,
    VMSpec,
    check_spec,
    check_vm_id,
)
from .images import ImageError, check_in_store
from .pool import VNC_ALPHABET, VNC_PASSWORD_CHARS, DisplayPool, vnc_owner

OPS = ("create", "start", "stop", "remove", "inspect", "list", "snapshot", "restore", "probe")



HISTORY_LIMIT = 10_000  # operations kept for tests and oracles
HISTORY_SLACK = 1_000  # ...and at most this many more, so a trim moves the list once per this many ops
READ_ONLY_OPS = frozenset({"probe", "inspect", "list"})

class AgentCrash(Exception):
    """Injected: the agent process 'died' right after an effect was applied, before reporting it."""


FaultKind = Literal["fail", "delay", "crash_after", "inconclusive"]


@dataclass
class FaultRule:
    kind: FaultKind
    op: str
    vm_id: str | None = None
    times: int | None = 1
    probability: float | None = None
    seconds: float = 0.0
    message: str = "injected failure"
    fired: int = 0

    def matches(self, op: str, vm_id: str | None) -> bool:
        if self.op != "*" and self.op != op:
            return False
        if self.vm_id is not None and self.vm_id != vm_id:
            return False
        return self.times is None or self.fired < self.times


class SimFaults:
    def __init__(self, rng: random.Random) -> None:
        self._rng = rng
        self.rules: list[FaultRule] = []

    def _add(self, rule: FaultRule) -> FaultRule:
        if rule.op != "*" and rule.op not in OPS:
            raise ValueError(f"unknown op {rule.op!r}; one of {OPS}")
        self.rules.append(rule)
        return rule

    def fail(
        self,
        op: str,
        *,
        vm_id: str | None = None,
        times: int | None = 1,
        probability: float | None = None,
        message: str = "injected failure",
    ) -> FaultRule:
        return self._add(FaultRule("fail", op, vm_id, times, probability, message=message))

    def delay(
        self,
        op: str,
        seconds: float,
        *,
        vm_id: str | None = None,
        times: int | None = 1,
        probability: float | None = None,
    ) -> FaultRule:
        return self._add(FaultRule("delay", op, vm_id, times, probability, seconds=seconds))

    def crash_after(
        self, op: str, *, vm_id: str | None = None, times: int | None = 1, probability: float | None = None
    ) -> FaultRule:
        return self._add(FaultRule("crash_after", op, vm_id, times, probability))

    def inconclusive(
        self, *, vm_id: str | None = None, times: int | None = 1, probability: float | None = None
    ) -> FaultRule:
        return self._add(FaultRule("inconclusive", "inspect", vm_id, times, probability))

    def apply_flags(self, flags: tuple[str, ...]) -> None:
        """The agent's ``--sim-fault kind:op[:seconds]`` rules (each fires once)."""
        for f in flags:
            kind, op, *rest = f.split(":")
            if kind == "delay":
                self.delay(op, float(rest[0]) if rest else 1.0)
            elif kind == "fail":
                self.fail(op)
            elif kind == "crash_after":
                self.crash_after(op)
            elif kind == "inconclusive":
                self.inconclusive()

    def clear(self) -> None:
        self.rules.clear()

    def draw(self, kind: FaultKind, op: str, vm_id: str | None) -> FaultRule | None:
        """The first matching rule of this kind that fires now (consumes one firing)."""
        for rule in self.rules:
            if rule.kind != kind or not rule.matches(op, vm_id):
                continue
            if rule.probability is not None and self._rng.random() >= rule.probability:
                continue
            rule.fired += 1
            return rule
        return None


class SimOp(msgspec.Struct):
    op: str
    vm_id: str | None
    labels: dict[str, str] = {}
    outcome: str = "ok"  # ok | failed | crashed_after | inconclusive | unknown | ready | not-ready


class _SimVM(msgspec.Struct):
    spec: VMSpec
    state: Literal["running", "paused", "exited", "creating"]
    pid: int | None = None
    vnc_display: int | None = None
    probe_host_port: int | None = None
    exit_code: int | None = None
    memory_token: str = ""
    vnc_password: str | None = None
    ready: bool = True
    run_pid: int | None = None  # this run's pid, kept after it exits (its console names it)
    previous_pid: int | None = None  # the run before this one's (its console is ``.previous``)


def _write_console(path: str, spec: VMSpec, pid: int | None) -> None:
    with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
        f.write(f"sim: booting {spec.vm_id} (pid {pid}, {spec.cpus} cpu, {spec.memory_mib} MiB)\n"
                f"VMFENCE-READY sim\n")


class _HostRecord(msgspec.Struct):
    vms: dict[str, _SimVM] = {}
    next_pid: int = 1000
    next_port: int = 20000
    history: list[SimOp] = []
    known: list[str] = []  # vm ids the (previous) agent was told about: a VM that vanishes is "gone"


class _JournalLine(msgspec.Struct, omit_defaults=True):
    """One effect on one VM: its record now (None: gone), whether the agent knows it, the counters."""

    vm_id: str
    vm: _SimVM | None
    known: bool
    next_pid: int
    next_port: int
    ops: list[SimOp] = []  # the history since the previous line (read-only ops included)


HOST_FILE = "sim-host.json"
JOURNAL_FILE = "sim-host.journal"
JOURNAL_MIN_COMPACT = 256  # lines; compaction once the journal is past this and twice the VMs
_journal_line = msgspec.json.Decoder(_JournalLine)


def load_host(state_dir: str) -> _HostRecord:
    """The host record of ``state_dir``: the last whole record, then its journal in order."""
    rec = _HostRecord()
    path = os.path.join(state_dir, HOST_FILE)
    if os.path.exists(path):
        with open(path, "rb") as f:
            rec = msgspec.json.decode(f.read(), type=_HostRecord)
    try:
        with open(os.path.join(state_dir, JOURNAL_FILE), "rb") as f:
            lines = f.read().split(b"\n")
    except FileNotFoundError:
        return rec
    known = dict.fromkeys(rec.known)
    for raw in lines:
        if not raw:
            continue
        try:
            line = _journal_line.decode(raw)
        except msgspec.DecodeError:
            break  # a torn write of a killed agent: nothing after it was ever acknowledged
        if line.vm is None:
            rec.vms.pop(line.vm_id, None)
        else:
            rec.vms[line.vm_id] = line.vm
        if line.known:
            known[line.vm_id] = None
        else:
            known.pop(line.vm_id, None)
        rec.next_pid, rec.next_port = line.next_pid, line.next_port
        rec.history.extend(line.ops)
    rec.known = list(known)
    del rec.history[: max(0, len(rec.history) - HISTORY_LIMIT)]
    return rec


@dataclass
class _Snapshot:
    spec: VMSpec
    memory_token: str


@dataclass
class SimDriver:
    state_dir: str | None = None
    seed: int = 0
    vnc_displays: range = range(10, 110)
    op_latency: float = 0.0  # seconds every op awaits (0 = just yields to the loop)
    image_store: str | None = None  # set: a spec's image must resolve inside it (as on a qemu host)
    name: str = "sim"
    rng: random.Random = field(init=False)
    faults: SimFaults = field(init=False)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self.faults = SimFaults(self.rng)
        self._host = _HostRecord()
        self._hub = EventHub()
        self._displays = DisplayPool(self.vnc_displays, check_port=False)
        self._snapshots: dict[str, _Snapshot] = {}
        self._opened = False
        self._known: set[str] = set()
        self._journal: Any = None  # the open journal file while state_dir is set
        self._journal_lines = 0
        self._unjournaled = 0  # history entries not yet in the journal

    # ------------------------------------------------------------------ oracle
    @property
    def history(self) -> list[SimOp]:
        return self._host.history

    def running_vms(self) -> list[str]:
        return sorted(k for k, v in self._host.vms.items() if v.state in ("running", "paused"))

    def all_vms(self) -> list[str]:
        return sorted(self._host.vms)

    def memory_token(self, vm_id: str) -> str | None:
        vm = self._host.vms.get(vm_id)
        return vm.memory_token if vm else None

    @property
    def emitted(self) -> list[Any]:
        return list(self._hub.history)

    # ------------------------------------------------------------------ persistence
    def _path(self) -> str | None:
        return os.path.join(self.state_dir, HOST_FILE) if self.state_dir else None

    def _save(self, vm_id: str | None = None) -> None:
        """Persist one VM's effect as a journal line, or (``vm_id`` None, or the journal past
        twice the VMs) the whole record, which empties the journal."""
        path = self._path()
        if path is None:
            return
        if vm_id is not None and self._journal is not None and self._journal_lines < max(
            JOURNAL_MIN_COMPACT, 2 * len(self._host.vms)
        ):
            ops = self._host.history[len(self._host.history) - self._unjournaled :] if self._unjournaled else []
            line = _JournalLine(vm_id, self._host.vms.get(vm_id), vm_id in self._known,
                                self._host.next_pid, self._host.next_port, ops)
            self._journal.write(msgspec.json.encode(line) + b"\n")
            self._journal.flush()
            self._journal_lines += 1
            self._unjournaled = 0
            return
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        self._host.known = sorted(self._known)
        tmp = path + ".tmp"
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
            f.write(msgspec.json.encode(self._host))  # VNC passwords: the agent user's alone
        os.replace(tmp, path)
        if self._journal is not None:
            self._journal.close()
        journal = os.path.join(os.path.dirname(path), JOURNAL_FILE)
        self._journal = os.fdopen(os.open(journal, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb")
        self._journal_lines = self._unjournaled = 0

    def _load(self) -> None:
        if self.state_dir:
            self._host = load_host(self.state_dir)
        self._known = set(self._host.known)

    # ------------------------------------------------------------------ fault plumbing
    async def _enter(self, op: str, vm_id: str | None, labels: dict[str, str] | None = None) -> None:
        if self.op_latency:
            await asyncio.sleep(self.op_latency)
        else:
            await asyncio.sleep(0)
        d = self.faults.draw("delay", op, vm_id)
        if d is not None:
            await asyncio.sleep(d.seconds)
        f = self.faults.draw("fail", op, vm_id)
        if f is not None:
            self._record(op, vm_id, labels, "failed")
            raise RuntimeFailure(f"{op} {vm_id}: {f.message}")

    def _exit(self, op: str, vm_id: str | None, labels: dict[str, str] | None = None) -> None:
        """After the effect: persist, record, and maybe 'crash the agent'."""
        c = self.faults.draw("crash_after", op, vm_id)
        self._record(op, vm_id, labels, "crashed_after" if c else "ok")
        if c is not None:
            raise AgentCrash(f"injected agent crash after {op} {vm_id}")

    def _record(self, op: str, vm_id: str | None, labels: dict[str, str] | None, outcome: str) -> None:
        """History is the oracle's; it is bounded (HISTORY_LIMIT, HISTORY_SLACK) and reads do not rewrite the
        host file (a probe per VM per second would otherwise make every save slower than the last)."""
        self._host.history.append(SimOp(op, vm_id, dict(labels or {}), outcome))
        self._unjournaled = min(self._unjournaled + 1, HISTORY_LIMIT)
        if len(self._host.history) > HISTORY_LIMIT + HISTORY_SLACK:  # trimmed in steps: O(1) per op
            del self._host.history[: len(self._host.history) - HISTORY_LIMIT]
        if op not in READ_ONLY_OPS:
            self._save(vm_id)

    def _know(self, vm_id: str) -> None:
        self._known.add(vm_id)

    def _forget(self, vm_id: str) -> None:
        self._known.discard(vm_id)

    def _info(self, vm: _SimVM) -> VMInfo:
        return VMInfo(
            vm_id=vm.spec.vm_id,
            state=vm.state,
            pid=vm.pid if vm.state in ("running", "paused") else None,
            vnc_display=vm.vnc_display,
            vnc_password=vm.vnc_password if vm.vnc_display is not None else None,
            probe_host_port=vm.probe_host_port,
            ip=vm.spec.net.ip if vm.spec.net is not None else None,  # the pool's address (no tap)
            labels=dict(vm.spec.labels),
            exit_code=vm.exit_code,
        )

    def _notice_gone(self, vm_id: str) -> None:
        if vm_id in self._known and vm_id not in self._host.vms:
            self._forget(vm_id)
            self._save(vm_id)
            self._hub.publish(VMGoneEvent(vm_id=vm_id))

    @staticmethod
    def _owner(spec: VMSpec) -> str:
        return vnc_owner(spec)

    # ------------------------------------------------------------------ console
    def _console_path(self, vm_id: str) -> str:
        return os.path.join(self.state_dir or ".", "console", f"{vm_id}.log")

    def serial_log(self, vm_id: str) -> str:
        """Where the VM's console is (as the qemu driver's serial.log): a few lines per boot. The
        files are written when first asked for; from then on each boot writes them at once."""
        path = self._console_path(vm_id)
        vm = self._host.vms.get(vm_id)
        if vm is not None and self.state_dir and not os.path.exists(path):
            os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
            if vm.previous_pid is not None:
                _write_console(path + ".previous", vm.spec, vm.previous_pid)
            _write_console(path, vm.spec, vm.run_pid)
        return path

    def _console_boot(self, spec: VMSpec, pid: int) -> None:
        """A boot's console, if the VM's was asked for: the previous boot's moved to ``.previous``
        (``kubectl logs --previous``), so a reader that follows it sees the boot. Otherwise nothing:
        a file per boot cost the sim an inode each (about 250 µs of ext4's time after much churn),
        for consoles few read; ``serial_log`` writes them from the record when asked."""
        if not self.state_dir:
            return
        path = self._console_path(spec.vm_id)
        if os.path.exists(path):
            os.replace(path, path + ".previous")
            _write_console(path, spec, pid)

    def _console_drop(self, vm_id: str) -> None:
        if self.state_dir:
            path = self._console_path(vm_id)
            for p in (path, path + ".previous"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(p)

    def _boot(self, spec: VMSpec, token: str | None = None, before: _SimVM | None = None) -> _SimVM:
        """A new run of ``spec``'s VM; ``before``: its previous run, whose console becomes ``.previous``."""
        pid = self._host.next_pid
        self._host.next_pid += 1
        self._console_boot(spec, pid)
        port = None
        if spec.probe_port is not None:
            port = self._host.next_port
            self._host.next_port += 1
        disp = self._displays.reserve(self._owner(spec)) if spec.vnc else None
        memory_token = token if token is not None else f"{self.rng.getrandbits(64):016x}"
        password = "".join(self.rng.choice(VNC_ALPHABET) for _ in range(VNC_PASSWORD_CHARS)) if spec.vnc else None
        return _SimVM(
            spec=spec,
            state="running",
            pid=pid,
            vnc_display=disp,
            vnc_password=password,
            probe_host_port=port,
            memory_token=memory_token,
            run_pid=pid,
            previous_pid=before.run_pid if before is not None else None,
        )

    # ------------------------------------------------------------------ driver interface
    async def open(self) -> None:
        self._load()
        for vm in self._host.vms.values():
            if vm.vnc_display is not None:
                self._displays.claim(vm.vnc_display, self._owner(vm.spec))
        self._opened = True
        self._save()  # the host exists on disk from the start (its oracle may be read any time)
        await self.reconcile()

    async def close(self) -> None:
        self._save()
        if self._journal is not None:
            self._journal.close()
            self._journal = None
        self._hub.close()

    async def reconcile(self) -> None:
        """Notice VMs the host no longer has (-> VMGoneEvent)."""
        for vm_id in list(self._known):
            self._notice_gone(vm_id)

    def _check_image(self, op: str, spec: VMSpec) -> None:
        if self.image_store is not None and spec.image is not None:
            try:
                check_in_store(self.image_store, spec.image)
            except ImageError:
                self._record(op, spec.vm_id, spec.labels, "failed")
                raise

    async def create(self, spec: VMSpec) -> VMInfo:
        check_spec(spec)
        self._check_image("create", spec)
        await self._enter("create", spec.vm_id, spec.labels)
        vm = self._host.vms.get(spec.vm_id)
        if vm is None:
            vm = self._boot(spec)
            self._host.vms[spec.vm_id] = vm
        self._know(spec.vm_id)
        self._exit("create", spec.vm_id, spec.labels)
        return self._info(vm)

    async def start(self, vm_id: str) -> VMInfo:
        check_vm_id(vm_id)
        vm = self._host.vms.get(vm_id)
        await self._enter("start", vm_id, vm.spec.labels if vm else None)
        vm = self._host.vms.get(vm_id)
        if vm is None:
            self._record("start", vm_id, None, "failed")
            raise RuntimeFailure(f"start {vm_id}: no such VM")
        if vm.state == "exited":
            fresh = self._boot(vm.spec, token=None, before=vm)
            if vm.vnc_display is not None:  # a restart in place keeps its display and its password
                if fresh.vnc_display is not None:
                    self._displays.release(fresh.vnc_display, self._owner(vm.spec))
                fresh.vnc_display, fresh.vnc_password = vm.vnc_display, vm.vnc_password
            vm = fresh
            self._host.vms[vm_id] = vm
        self._know(vm_id)
        self._exit("start", vm_id, vm.spec.labels)
        return self._info(vm)

    async def stop(self, vm_id: str) -> None:
        check_vm_id(vm_id)
        vm = self._host.vms.get(vm_id)
        await self._enter("stop", vm_id, vm.spec.labels if vm else None)
        vm = self._host.vms.get(vm_id)
        if vm is None:
            self._record("stop", vm_id, None, "failed")
            raise RuntimeFailure(f"stop {vm_id}: no such VM")
        if vm.state != "exited":
            vm.state, vm.exit_code, vm.pid = "exited", 0, None
        self._exit("stop", vm_id, vm.spec.labels)

    async def remove(self, vm_id: str) -> None:
        check_vm_id(vm_id)
        vm = self._host.vms.get(vm_id)
        await self._enter("remove", vm_id, vm.spec.labels if vm else None)
        vm = self._host.vms.pop(vm_id, None)
        if vm is not None and vm.vnc_display is not None:
            self._displays.release(vm.vnc_display, self._owner(vm.spec))
        self._forget(vm_id)
        self._console_drop(vm_id)
        self._exit("remove", vm_id, vm.spec.labels if vm else None)

    async def inspect(self, vm_id: str) -> VMInfo | None:
        check_vm_id(vm_id)
        await self._enter("inspect", vm_id)
        if self.faults.draw("inconclusive", "inspect", vm_id) is not None:
            self._record("inspect", vm_id, None, "inconclusive")
            raise Inconclusive(f"inspect {vm_id}: injected inconclusive")
        vm = self._host.vms.get(vm_id)
        self._record("inspect", vm_id, vm.spec.labels if vm else None, "ok" if vm else "unknown")
        if vm is None:
            self._notice_gone(vm_id)
            return None
        self._know(vm_id)
        return self._info(vm)

    async def list_labelled(self, name: str, value: str) -> list[VMInfo]:
        await self._enter("list", None)
        self._record("list", None, None, "ok")
        mine = sorted((v for v in self._host.vms.values() if v.spec.labels.get(name) == value),
                      key=lambda v: v.spec.vm_id)
        for v in mine:
            self._know(v.spec.vm_id)
        return [self._info(v) for v in mine]

    async def list(self) -> list[VMInfo]:
        await self._enter("list", None)
        await self.reconcile()
        self._record("list", None, None, "ok")
        for vm_id in self._host.vms:
            self._know(vm_id)
        return [self._info(v) for _, v in sorted(self._host.vms.items())]

    async def snapshot(self, vm_id: str, dest: str) -> SnapshotInfo:
        check_vm_id(vm_id)
        t0 = time.monotonic()
        vm = self._host.vms.get(vm_id)
        await self._enter("snapshot", vm_id, vm.spec.labels if vm else None)
        vm = self._host.vms.get(vm_id)
        if vm is None or vm.state not in ("running", "paused"):
            self._record("snapshot", vm_id, None, "failed")
            raise RuntimeFailure(f"snapshot {vm_id}: VM is not running")
        snap = _Snapshot(vm.spec, vm.memory_token)
        self._snapshots[dest] = snap
        size = _write_snapshot(dest, msgspec.json.encode({"spec": vm.spec, "memory_token": vm.memory_token}))
        del self._host.vms[vm_id]
        if vm.vnc_display is not None:
            self._displays.release(vm.vnc_display, self._owner(vm.spec))
        self._forget(vm_id)
        self._exit("snapshot", vm_id, vm.spec.labels)
        return SnapshotInfo(vm_id=vm_id, path=dest, size_bytes=size, seconds=time.monotonic() - t0)

    async def restore(self, spec: VMSpec, src: str) -> VMInfo:
        check_spec(spec)
        self._check_image("restore", spec)
        await self._enter("restore", spec.vm_id, spec.labels)
        existing = self._host.vms.get(spec.vm_id)
        if existing is not None and existing.state != "exited":
            self._exit("restore", spec.vm_id, spec.labels)
            return self._info(existing)
        snap = self._snapshots.get(src)
        if snap is None:
            raw = _read_snapshot(src)
            if raw is not None:
                snap = _Snapshot(msgspec.convert(raw["spec"], VMSpec), raw["memory_token"])
        if snap is None:
            self._record("restore", spec.vm_id, spec.labels, "failed")
            raise RuntimeFailure(f"restore {spec.vm_id}: no snapshot at {src}")
        if existing is not None and existing.vnc_display is not None:
            self._displays.release(existing.vnc_display, self._owner(existing.spec))
        vm = self._boot(spec, token=snap.memory_token, before=existing)
        self._host.vms[spec.vm_id] = vm
        self._know(spec.vm_id)
        self._exit("restore", spec.vm_id, spec.labels)
        return self._info(vm)

    async def probe(self, vm_id: str) -> bool:
        check_vm_id(vm_id)
        await self._enter("probe", vm_id)
        vm = self._host.vms.get(vm_id)
        ready = vm is not None and vm.state == "running" and vm.ready
        self._record("probe", vm_id, vm.spec.labels if vm else None, "ready" if ready else "not-ready")
        return ready

    def events(self) -> EventSubscription:
        return self._hub.subscribe()

    # ------------------------------------------------------------------ host-side faults
    def crash_vm(self, vm_id: str, *, exit_code: int | None = None, signal: int | None = 9) -> None:
        """The VM process dies (as if SIGKILLed): state exited, VMExitedEvent published."""
        vm = self._host.vms.get(vm_id)
        if vm is None or vm.state == "exited":
            raise RuntimeFailure(f"crash_vm {vm_id}: not running")
        vm.state, vm.pid = "exited", None
        vm.exit_code = exit_code
        self._save(vm_id)
        self._hub.publish(VMExitedEvent(vm_id=vm_id, exit_code=exit_code, signal=signal))

    def lose_vm(self, vm_id: str) -> None:
        """The host silently forgets the VM (its record vanishes). No event until noticed."""
        vm = self._host.vms.pop(vm_id, None)
        if vm is None:
            raise RuntimeFailure(f"lose_vm {vm_id}: unknown")
        if vm.vnc_display is not None:
            self._displays.release(vm.vnc_display, self._owner(vm.spec))
        self._save(vm_id)

    def set_ready(self, vm_id: str, ready: bool) -> None:
        vm = self._host.vms[vm_id]
        vm.ready = ready
        self._save(vm_id)



def _write_snapshot(dest: str, payload: bytes) -> int:
    d = os.path.dirname(dest)
    if d:
        os.makedirs(d, mode=0o700, exist_ok=True)
    with os.fdopen(os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
        f.write(payload)  # as a qemu host's: a snapshot is the guest's memory
    return len(payload)


def _read_snapshot(src: str) -> dict[str, Any] | None:
    try:
        with open(src, "rb") as f:
            raw: dict[str, Any] = json.loads(f.read())
            return raw
    except FileNotFoundError:
        return None
