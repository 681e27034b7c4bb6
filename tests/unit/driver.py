"""A one-key driver for scenario tests: feed inputs, keep the log, find effects by type."""

from __future__ import annotations

from shared.fence.decide import DecideEnv, HostView, decide, rebuild
from shared.fence.schema import (
    Command,
    Commanded,
    CommandResult,
    ConfirmedRead,
    ConfirmRequested,
    Decision,
    Input,
    Inventoried,
    LogEntry,
    Observed,
    Spec,
    TimerArmed,
    WriteDone,
    WriteRequested,
)
from shared.fence.state import KeyState, fold_all

KEY = "default/web.v1"
ENV = DecideEnv(hosts=[HostView("host-a", 8, 8192), HostView("host-b", 8, 8192)], restart_backoff_base_s=1)


class Driver:
    """``auto_bind``: a pod's binding (pods/binding, which comes before its VM) is answered ok as
    soon as it is requested, and its decisions are returned with those of the input that asked for
    it, so a scenario about something else reads as before binding existed. Tests of the binding
    itself turn it off."""

    def __init__(self, key: str = KEY, env: DecideEnv = ENV, *, auto_bind: bool = True) -> None:
        self.state = KeyState(key=key)
        self.env = env
        self.log: list[LogEntry] = []
        self.rv = 0
        self.auto_bind = auto_bind

    @property
    def key(self) -> str:
        return self.state.key

    def feed(self, inp: Input) -> list[Decision]:
        decisions = self._feed(inp)
        while self.auto_bind and (binds := self.writes("bind")):
            w = binds[0].write
            decisions = decisions + self._feed(WriteDone(w.fence, w.id, "ok", node=w.node))
        return decisions

    def _feed(self, inp: Input) -> list[Decision]:
        decisions = decide(self.state, inp, self.env)
        if decisions:
            fold_all(self.state, decisions)
            self.state.n += 1
            self.log.append(LogEntry(self.key, self.state.n, decisions))
        return decisions

    def next_rv(self) -> int:
        self.rv += 1
        return self.rv

    def admit(self, uid: str, spec: Spec | None = None, *, deleting: bool = False) -> list[Decision]:
        """Observe then confirm a uid; returns the decisions of the confirmation."""
        rv = self.next_rv()
        self.feed(Observed(self.key, uid, rv, spec=spec or Spec()))
        req = self.pending(ConfirmRequested)[-1]
        return self.feed(ConfirmedRead(self.key, req.request, uid, rv, deleting=deleting, spec=spec or Spec()))

    def pending(self, kind: type) -> list:  # type: ignore[type-arg]
        return [e for e in self.state.outbox.values() if isinstance(e, kind)]

    def commands(self, op: str | None = None) -> list[Command]:
        return [e.command for e in self.pending(Commanded) if op is None or e.command.op == op]

    def answer(self, cmd: Command, outcome: str = "ok", **kw: object) -> list[Decision]:
        return self.feed(
            CommandResult(cmd.fence, cmd.id, cmd.op, cmd.host, cmd.vm_id, outcome, **kw)  # type: ignore[arg-type]
        )

    def run_up(self, uid: str, spec: Spec | None = None) -> Command:
        """Admit uid and answer its create: the VM is bound."""
        self.admit(uid, spec)
        (create,) = self.commands("create")
        self.answer(create, ip="10.0.0.9")
        return create

    def writes(self, verb: str) -> list[WriteRequested]:
        return [e for e in self.pending(WriteRequested) if e.write.verb == verb]

    def timers(self) -> list[TimerArmed]:
        return self.pending(TimerArmed)


def of(decisions: list[Decision], kind: type) -> list:  # type: ignore[type-arg]
    return [d for d in decisions if isinstance(d, kind)]


def lose_tail(d: Driver, keep: int) -> KeyState:
    """The key's log keeps its first ``keep`` entries (restored from an older copy); the writer,
    which knew more, appends ``Rebuilt``. Returns what the writer knew."""
    known = d.state
    d.log = d.log[:keep]
    d.state = KeyState(key=d.key)
    for entry in d.log:
        fold_all(d.state, entry.decisions)
        d.state.n = entry.n
    out = rebuild(d.state, known.epoch, d.env, "tail lost")
    fold_all(d.state, out)
    d.state.n += 1
    d.log.append(LogEntry(d.key, d.state.n, out))
    return known


def answer_surveys(d: Driver, found: dict[str, list[Inventoried]], *, finders_last: bool = False) -> list:  # type: ignore[type-arg]
    """Every host answers its survey; ``finders_last``: the hosts that found something answer after
    the others (the last answer of a round is the one that ends it)."""
    out = []
    surveys = d.commands("survey")
    if finders_last:
        surveys.sort(key=lambda c: bool(found.get(c.host)))
    for s in surveys:
        out += d.answer(s, found=found.get(s.host, []))
    return out


def cut_unseen(d: Driver, keep: int) -> list[LogEntry]:
    """The key's log keeps its first ``keep`` entries and the writer restarts from it with no memory
    of more (its data dir is gone, or its snapshot predates the cut): no ``Rebuilt`` is appended, the
    cut log looks like a normal, shorter one. Returns the lost entries."""
    lost = d.log[keep:]
    d.log = d.log[:keep]
    d.state = KeyState(key=d.key)
    for entry in d.log:
        fold_all(d.state, entry.decisions)
        d.state.n = entry.n
    return lost
