"""A pure, in-memory world around ``decide``: a Kubernetes object store with a lagging cache, agents
with ledgers, and a bag of in-flight messages that a test, hypothesis or the fault campaign delivers
in any order, any number of times — plus the faults of the campaign (reconciler crashes, a lost log
tail, split-brain writers, lost write responses, finalizers, Kubernetes conflicts).

Nothing here is vmfence's own component but ``decide``/``fold``/``audit``: this is the *environment*
the policy must survive, written as plainly as possible so interleavings can be searched. Its oracle
(``max_vms_per_key``) comes from the agents' own records, not from the reconciler's state.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from msgspec.structs import replace

from shared.fence.audit import AuditReport, audit
from shared.fence.decide import DecideEnv, HostView, decide, rebuild
from shared.fence.schema import (
    NO_INCARNATION,
    Command,
    Commanded,
    CommandResult,
    ConfirmedRead,
    ConfirmRequested,
    Decision,
    Fence,
    Input,
    Inventoried,
    KubeWrite,
    LogEntry,
    Observed,
    ProbeChanged,
    Spec,
    TimerArmed,
    TimerFired,
    VMExited,
    VMGone,
    WriteDone,
    WriteRequested,
)
from shared.fence.state import KeyState, fold_all, survey_pending

HOSTS = ("host-a", "host-b")


@dataclass
class Pod:
    uid: str
    rv: int
    spec: Spec
    deleting: bool = False
    finalizer: bool = False  # a grace-0 delete leaves it terminating until the user clears it


@dataclass
class AgentVM:
    vm_id: str
    key: str
    owner: Fence
    running: bool = True


@dataclass
class Agent:
    host: str
    vms: dict[str, AgentVM] = field(default_factory=dict)
    results: dict[str, CommandResult] = field(default_factory=dict)
    snapshots: dict[str, str] = field(default_factory=dict)
    removed: set[str] = field(default_factory=set)  # a removed VM id never comes back
    lost: dict[str, AgentVM] = field(default_factory=dict)  # VMs the runtime lost: inventories repeat them
    marks: dict[str, int] = field(default_factory=dict)  # per key: the newest epoch commanded
    mark_uids: dict[str, str] = field(default_factory=dict)  # per key: the uid of that epoch ("": any)
    floor: int = 0  # the newest writer generation that verified this host (PartitionVerify)

    def verify(self, gen: int) -> tuple[int, list[str]]:
        """Raise the floor to ``gen``; the floor after it and the keys with a VM here."""
        self.floor = max(self.floor, gen)
        return self.floor, sorted({vm.key for vm in self.vms.values()})

    def execute(self, cmd: Command) -> CommandResult:
        """Measure, act on the difference, record by command id (answers redeliveries)."""
        done = self.results.get(cmd.id) if cmd.op != "survey" else None  # a survey is answered afresh
        if done is not None:
            return done
        if cmd.gen < self.floor and cmd.op != "remove":
            # an older writer's command after a newer one verified this host: not run, not stored
            return CommandResult(cmd.fence, cmd.id, cmd.op, self.host, cmd.vm_id, "inconclusive",
                                 error="older writer generation", floor=self.floor)
        vm = self.vms.get(cmd.vm_id)
        outcome = "ok"
        snapshot = None
        key = cmd.fence.key
        mark, mark_uid = self.marks.get(key, 0), self.mark_uids.get(key, "")
        other_uid = cmd.fence.epoch == mark and bool(mark_uid) and bool(cmd.fence.uid) and cmd.fence.uid != mark_uid
        key_fenced = cmd.op not in ("remove", "survey") and (cmd.fence.epoch < mark or other_uid)
        raises = cmd.fence.epoch > mark or (cmd.fence.epoch == mark and not mark_uid)
        if not key_fenced and cmd.op != "remove" and raises:
            # a survey under an epoch the log gave to no incarnation: nothing may run at that epoch
            self.marks[key], self.mark_uids[key] = cmd.fence.epoch, cmd.fence.uid or NO_INCARNATION
        if key_fenced:
            outcome = "fenced"  # older than a fence this host already saw for the key, or its epoch reused
        elif vm is not None and cmd.fence.epoch < vm.owner.epoch:
            outcome = "fenced"
        elif cmd.vm_id in self.removed and cmd.op != "remove":
            outcome = "fenced"  # a create redelivered after its remove must not resurrect the VM
        elif cmd.op == "create":
            if vm is None:
                self.vms[cmd.vm_id] = AgentVM(cmd.vm_id, cmd.fence.key, cmd.fence)
            elif vm.owner.uid == cmd.fence.uid:
                vm.owner = cmd.fence  # same incarnation, newer epoch (a rebuilt log): take it over
        elif cmd.op == "start":
            if vm is None:
                outcome = "not_found"  # start re-runs an existing VM; it never makes one
            else:
                vm.running = True
        elif cmd.op == "wake":
            if cmd.snapshot not in self.snapshots:
                outcome = "failed"
            else:
                self.vms[cmd.vm_id] = AgentVM(cmd.vm_id, cmd.fence.key, cmd.fence)
        elif cmd.op == "remove":
            self.removed.add(cmd.vm_id)
            if vm is None:
                outcome = "not_found"
            else:
                del self.vms[cmd.vm_id]
        elif cmd.op == "hibernate":
            if vm is None:
                outcome = "not_found"
            else:
                snapshot = f"{self.host}:{cmd.vm_id}:{cmd.id}"
                self.snapshots[snapshot] = cmd.vm_id
                del self.vms[cmd.vm_id]
        elif cmd.op == "survey":
            found = [
                Inventoried(v.owner, self.host, v.vm_id, "running") for v in self.vms.values() if v.key == cmd.fence.key
            ]
            result = CommandResult(
                cmd.fence, cmd.id, cmd.op, self.host, cmd.vm_id, "ok", found=found,
                key_epoch=self.marks.get(key, 0), key_uid=self.mark_uids.get(key, ""),
            )
            self.results[cmd.id] = result
            return result
        elif cmd.op == "adopt":
            if vm is None:
                outcome = "not_found"
            else:
                vm.owner = cmd.fence
        owner = self.vms.get(cmd.vm_id)
        found = []
        if owner is not None and (outcome == "fenced" or (cmd.op == "adopt" and outcome == "ok")):
            found = [Inventoried(owner.owner, self.host, owner.vm_id, "running" if owner.running else "exited")]
        result = CommandResult(
            cmd.fence, cmd.id, cmd.op, self.host, cmd.vm_id, outcome,  # type: ignore[arg-type]
            ip="10.0.0.1" if outcome == "ok" and cmd.op != "remove" else None, snapshot=snapshot, found=found,
            key_epoch=self.marks.get(key, 0), key_uid=self.mark_uids.get(key, ""),
        )
        self.results[cmd.id] = result
        return result


@dataclass
class Msg:
    """Something in flight: an input for the reconciler, or an effect waiting to be carried out."""

    kind: str  # "input" | "command" | "confirm" | "write" | "timer" | "verify" | "verified"
    key: str
    payload: object


class World:
    def __init__(self, keys: int = 2, stale_lag: int = 3, vm_keys: int = 0, spread: bool = False) -> None:
        self.keys = [f"default/pod-{i}.x" for i in range(keys)] + [f"vm:default/db-{i}" for i in range(vm_keys)]
        self.pods: dict[str, Pod] = {}
        self.rv = itertools.count(1)
        self.uids = itertools.count(1)
        self.history: dict[str, list[Observed]] = {k: [] for k in self.keys}
        self.stale_lag = stale_lag
        self.agents = {h: Agent(h) for h in HOSTS}
        self.states = {k: KeyState(key=k) for k in self.keys}
        self.log: list[LogEntry] = []
        self.bag: list[Msg] = []
        self.env = DecideEnv(hosts=[HostView(h, 64, 65536) for h in HOSTS], restart_backoff_base_s=0.0)
        # placement follows the hosts' VM counts (as heartbeats report them), so a key's successive
        # VMs land on different hosts; off, every VM lands on host-a (the default schedule's model)
        self.spread = spread
        self.max_vms_per_key = 0
        self.faults: dict[str, int] = {}
        self.write_faults: list[str] = []  # queued outcomes forced on the next writes: conflict|lost
        # partition verification (one partition: one writer for every key), as Partition does it:
        # the writer's generation (+1 per restart), the hosts that answered at it, the keys they
        # named, and the keys the restarted writer has not met yet (no entry in the log: its
        # ``_slot`` decides their ``unverified`` when their first input comes)
        self.gen = 1
        self.verified: set[str] = set(HOSTS)
        self.named: set[str] = set()
        self.unmet: set[str] = set()

    # -------------------------------------------------------------- the user and Kubernetes
    def _observe(self, key: str, *, gone: bool = False) -> None:
        pod = self.pods.get(key)
        if pod is None and not gone:
            return
        assert pod is not None
        obs = Observed(key, pod.uid, pod.rv, deleting=pod.deleting, gone=gone, spec=pod.spec)
        self.history[key].append(obs)
        self.bag.append(Msg("input", key, obs))

    def create(self, key: str, spec: Spec | None = None) -> bool:
        if key in self.pods:
            return False
        self.pods[key] = Pod(f"uid-{next(self.uids)}", next(self.rv), spec or Spec())
        self._observe(key)
        return True

    def churn(self, rounds: int, limit: int = 1_000_000) -> None:
        """Every key created, settled, deleted and settled again, ``rounds`` times: a clean log of
        the real policy's, as long as wanted (benchmarks and tests of the log's readers)."""
        for _ in range(rounds):
            for key in self.keys:
                self.create(key)
            self.settle(limit)
            for key in self.keys:
                self.delete(key)
            self.settle(limit)

    def delete(self, key: str) -> None:
        pod = self.pods.get(key)
        if pod is not None and not pod.deleting:
            pod.deleting, pod.rv = True, next(self.rv)
            self._observe(key)

    def force_delete(self, key: str, *, observed: bool = True) -> None:
        pod = self.pods.pop(key, None)
        if pod is not None and observed:
            obs = Observed(key, pod.uid, next(self.rv), deleting=True, gone=True, spec=pod.spec)
            self.history[key].append(obs)
            self.bag.append(Msg("input", key, obs))

    def set_hibernate(self, key: str, value: bool) -> None:
        pod = self.pods.get(key)
        if pod is not None and not pod.deleting and pod.spec.hibernate != value:
            pod.spec = Spec(hibernate=value, on_recreate=pod.spec.on_recreate)
            pod.rv = next(self.rv)
            self._observe(key)

    def stale_replay(self, key: str, back: int) -> None:
        """Redeliver an older observation, as a lagging watch cache or a relist may."""
        hist = self.history[key]
        if hist:
            self.bag.append(Msg("input", key, hist[max(0, len(hist) - 1 - back)]))

    # ---------------------------------------------------------------------- agent faults
    def crash_vm(self, key: str) -> None:
        for agent in self.agents.values():
            for vm in agent.vms.values():
                if vm.key == key and vm.running:
                    vm.running = False
                    self.bag.append(Msg("input", key, VMExited(vm.owner, agent.host, vm.vm_id, 1)))
                    return

    def lose_vm(self, key: str) -> None:
        for agent in self.agents.values():
            for vm in list(agent.vms.values()):
                if vm.key == key:
                    del agent.vms[vm.vm_id]
                    agent.removed.add(vm.vm_id)
                    agent.lost[vm.vm_id] = vm
                    self.bag.append(Msg("input", key, VMGone(vm.owner, agent.host, vm.vm_id)))
                    return

    def probe(self, key: str, ready: bool) -> None:
        for agent in self.agents.values():
            for vm in agent.vms.values():
                if vm.key == key and vm.running:
                    self.bag.append(Msg("input", key, ProbeChanged(vm.owner, agent.host, vm.vm_id, ready)))

    def inventory(self) -> None:
        for agent in self.agents.values():
            for vm in agent.vms.values():
                state = "running" if vm.running else "exited"
                self.bag.append(Msg("input", vm.key, Inventoried(vm.owner, agent.host, vm.vm_id, state)))
            for vm in agent.lost.values():
                self.bag.append(Msg("input", vm.key, Inventoried(vm.owner, agent.host, vm.vm_id, "lost")))

    # ------------------------------------------------------------------------ delivery
    def deliver(self, index: int, *, duplicate: bool = False, drop_report: bool = False) -> None:
        """Carry out one in-flight message. ``duplicate`` leaves it in flight (redelivery);
        ``drop_report`` models an agent crash between effect and report: the command stays queued."""
        if not self.bag:
            return
        i = index % len(self.bag)
        msg = self.bag[i] if duplicate or (drop_report and self.bag[i].kind == "command") else self.bag.pop(i)
        match msg.kind:
            case "input":
                self._decide(msg.key, msg.payload)  # type: ignore[arg-type]
            case "command":
                cmd: Command = msg.payload  # type: ignore[assignment]
                result = self.agents[cmd.host].execute(cmd)
                if not drop_report:
                    self.bag.append(Msg("input", msg.key, result))
            case "confirm":
                req: ConfirmRequested = msg.payload  # type: ignore[assignment]
                pod = self.pods.get(msg.key)
                read = ConfirmedRead(
                    msg.key, req.request, pod.uid if pod else None, pod.rv if pod else 0,
                    deleting=pod.deleting if pod else False, spec=pod.spec if pod else Spec(),
                )
                self.bag.append(Msg("input", msg.key, read))
            case "write":
                self._write(msg.key, msg.payload)  # type: ignore[arg-type]
            case "timer":
                armed: TimerArmed = msg.payload  # type: ignore[assignment]
                self.bag.append(Msg("input", msg.key, TimerFired(armed.fence, armed.timer_id)))
            case "verify":
                host, gen = msg.payload  # type: ignore[misc]
                floor, named = self.agents[host].verify(gen)
                self.bag.append(Msg("verified", "", (host, gen, floor, named)))
            case "verified":
                host, gen, floor, named = msg.payload  # type: ignore[misc]
                if gen == self.gen and floor == gen:
                    self.verified.add(host)
                    self.named.update(named)
                    if self.verified >= set(HOSTS):
                        self._verify_loaded_keys()
        self._check_oracle()

    def _write(self, key: str, w: KubeWrite) -> None:
        pod = self.pods.get(key)
        forced = self.write_faults.pop(0) if self.write_faults and w.verb != "event" else None
        if forced == "conflict":  # 409 the gateway could not resolve within its retries
            self.bag.append(Msg("input", key, WriteDone(w.fence, w.id, "failed", "injected 409")))
            return
        if pod is None:
            outcome = "gone"
        elif pod.uid != w.fence.uid:
            outcome = "superseded"
        else:
            outcome = "ok"
            if w.verb == "delete" and pod.finalizer:
                pod.deleting, pod.rv = True, next(self.rv)  # stuck terminating
                self._observe(key)
            elif w.verb == "delete":
                del self.pods[key]
                obs = Observed(key, pod.uid, next(self.rv), deleting=True, gone=True, spec=pod.spec)
                self.history[key].append(obs)
                self.bag.append(Msg("input", key, obs))
            elif w.verb == "evict":
                self.delete(key)
            elif w.verb == "status":
                pod.rv = next(self.rv)
                self._observe(key)
        if forced == "lost":  # applied on the server, response lost: the gateway reports a failure
            self.bag.append(Msg("input", key, WriteDone(w.fence, w.id, "failed", "response lost")))
        elif w.verb != "event":
            self.bag.append(Msg("input", key, WriteDone(w.fence, w.id, outcome)))  # type: ignore[arg-type]

    def _verify_loaded_keys(self) -> None:
        """Every host answered: keys the writer loaded (or met) before that, named by no host and
        with no survey out, are verified by the answers (Partition._verify_early_keys)."""
        for key in self.keys:
            st = self.states[key]
            if key not in self.unmet and key not in self.named and st.unverified and not st.rebuilding \
                    and not survey_pending(st):
                st.unverified = False

    def _decide(self, key: str, inp: Input) -> None:
        if isinstance(inp, CommandResult) and inp.floor > 0:
            return  # refused for an older writer: the shell's, never decided (Partition._refused_below_floor)
        s = self.states[key]
        if key in self.unmet:  # the restarted writer meets the key: Partition._slot
            self.unmet.discard(key)
            s.unverified = key in self.named or not self.verified >= set(HOSTS)
        decisions = decide(s, inp, self._env())
        if not decisions:
            return
        self._append(key, decisions)
        self._emit(key, list(decisions))

    def _env(self) -> DecideEnv:
        if not self.spread:
            return self.env
        hosts = [HostView(h, 64, 65536, vms=len(self.agents[h].vms)) for h in HOSTS]
        return DecideEnv(hosts=hosts, restart_backoff_base_s=self.env.restart_backoff_base_s)

    def _append(self, key: str, decisions: list[Decision]) -> None:
        s = self.states[key]
        fold_all(s, decisions)
        s.n += 1
        self.log.append(LogEntry(key, s.n, decisions))

    # ----------------------------------------------------------------- campaign faults
    def count(self, fault: str) -> None:
        self.faults[fault] = self.faults.get(fault, 0) + 1

    def crash_reconciler(self) -> None:
        """Lose everything in-process (pending reads, writes, timers), keep what is on the bus, and
        restart from the log: state re-folded, outbox effects carried out again (rule 11)."""
        self.bag = [m for m in self.bag if m.kind in ("input", "command", "verify")]
        self.gen += 1
        self.verified, self.named, self.unmet = set(), set(), set()
        for key in self.keys:
            self.states[key] = self._fold_log(key)
            # loaded from the log: whether the log lost a tail before the load (all of it, even)
            # cannot be known (Partition does the same), so its first VM waits for a survey
            self.states[key].unverified = True
            if self.states[key].n == 0:
                self.unmet.add(key)  # not in the log: met when its first input comes
            self._emit(key, list(self.states[key].outbox.values()))
        for host in HOSTS:  # the new writer verifies every host, behind what is on its way there
            self.bag.append(Msg("verify", "", (host, self.gen)))

    def _fold_log(self, key: str, upto: int | None = None) -> KeyState:
        s = KeyState(key=key)
        for e in self.log:
            if e.key == key and (upto is None or e.n <= upto):
                fold_all(s, e.decisions)
                s.n = e.n
        return s

    def lose_log_tail(self, key: str, k: int) -> None:
        """The stream lost the key's last k entries (restored from an older copy). The writer's
        next append fails its expected-sequence check; it re-reads the log (full reload), sees it
        is behind what it knew, and says so with a Rebuilt entry carrying its epoch floor."""
        known = self.states[key]
        entries = [e for e in self.log if e.key == key]
        drop = {id(e) for e in entries[-k:]} if k else set()
        self.log = [e for e in self.log if id(e) not in drop]
        rebuilt = self._fold_log(key)
        self.states[key] = rebuilt
        self.bag = [m for m in self.bag if not (m.key == key and m.kind in ("confirm", "write", "timer"))]
        if rebuilt.n < known.n:
            self._append(key, rebuild(rebuilt, known.epoch, self._env(), "log tail lost"))
        self._emit(key, list(self.states[key].outbox.values()))

    def lose_log_tail_unseen(self, key: str, k: int) -> None:
        """The stream lost the key's last k entries and no reconciler saw them: the partition's owner
        restarts without its data dir (or from a snapshot older than the cut) and reads the cut log
        as a normal, shorter one — no Rebuilt from memory. Commands and reports already on the bus
        stay in flight; only the agents' epochs can show the cut."""
        entries = [e for e in self.log if e.key == key]
        drop = {id(e) for e in entries[-k:]} if k else set()
        self.log = [e for e in self.log if id(e) not in drop]
        self.crash_reconciler()

    def split_brain(self, key: str, back: int) -> None:
        """A second writer with a stale copy of the key (an old snapshot) decides the next input;
        its append carries a stale expected position, loses, and it re-reads before deciding."""
        n = self.states[key].n
        stale = self._fold_log(key, max(0, n - back))
        if stale.n != n:
            self.count("lost_race")
        # the loser re-reads the log: what it ends up with is exactly the log's state, read cold
        self.states[key] = self._fold_log(key)
        self.states[key].unverified = True

    def add_finalizer(self, key: str) -> None:
        pod = self.pods.get(key)
        if pod is not None:
            pod.finalizer = True

    def clear_finalizer(self, key: str) -> None:
        """The user (or a controller) removes the finalizer of a terminating pod: it goes away."""
        pod = self.pods.get(key)
        if pod is not None and pod.finalizer:
            pod.finalizer = False
            if pod.deleting:
                self.force_delete(key)

    def relist_current(self, key: str) -> None:
        """A relist: the object as it is now (deduplicated downstream when nothing changed)."""
        self._observe(key)

    def relist_missing(self, key: str) -> None:
        """A watch relist that misses an object which still exists: the watcher infers it gone."""
        pod = self.pods.get(key)
        if pod is not None:
            obs = Observed(key, pod.uid, next(self.rv), deleting=True, gone=True, spec=pod.spec)
            self.bag.append(Msg("input", key, obs))

    def stale_deleting(self, key: str) -> None:
        """A stale read still showing an older uid, now with a deletionTimestamp."""
        older = [o for o in self.history[key] if key not in self.pods or o.uid != self.pods[key].uid]
        if older:
            o = older[-1]
            self.bag.append(Msg("input", key, Observed(key, o.uid, o.resource_version, deleting=True, spec=o.spec)))

    def _emit(self, key: str, effects: list[object]) -> None:
        for d in effects:
            match d:
                case Commanded(command=cmd):
                    # the sending writer's generation, stamped at send time (EffectRunner)
                    self.bag.append(Msg("command", key, replace(cmd, gen=self.gen)))
                case ConfirmRequested():
                    self.bag.append(Msg("confirm", key, d))
                case WriteRequested(write=w):
                    self.bag.append(Msg("write", key, w))
                case TimerArmed():
                    self.bag.append(Msg("timer", key, d))
                case _:
                    pass

    def _check_oracle(self) -> None:
        for key in self.keys:
            n = sum(1 for a in self.agents.values() for vm in a.vms.values() if vm.key == key)
            self.max_vms_per_key = max(self.max_vms_per_key, n)

    # --------------------------------------------------------------------- quiescence
    def settle(self, limit: int = 5000) -> None:
        """Deliver everything in order until nothing is in flight."""
        steps = 0
        while self.bag:
            steps += 1
            if steps > limit:
                raise AssertionError(f"no quiescence after {limit} deliveries: {self.bag[:5]}")
            self.deliver(0)

    def vms_of(self, key: str) -> list[AgentVM]:
        return [vm for a in self.agents.values() for vm in a.vms.values() if vm.key == key]

    def audit(self, final: bool = True) -> AuditReport:
        return audit(self.log, final=final)
