"""``decide``: the fence policy, one input at a time, as a table of small pure rules.

``decide(state, input, env)`` returns the decisions one input produces; the reconciler appends them
to the key's log as one entry and then carries out their effects. Each decision is folded into a
working copy as it is made, so every rule sees the state the log will have at that point — which is
also what the audit re-derives.

Reading guide (the rows of the table; the first column is ``_INPUTS``, one rule per input kind):

    input            state of the key                      decisions
    ---------------  ------------------------------------  ------------------------------------
    Observed         uid tombstoned                        Skipped(superseded)
                     uid current, not newer                (dropped)
                     uid current, gone (no claim held)     ConfirmRequested: successor or absent?
                     uid current, deleting                 delete path (rule 5)
                     uid current, spec changed             SpecChanged [+ hibernate / wake]
                     uid unknown                           ConfirmRequested   (rule 3)
    ConfirmedRead    object absent                         delete path of current, tombstones
                     same uid as current                   (tombstones for others seen)
                     new uid                               Superseded(old) + Admitted(new) (rule 2,3)
    CommandResult    command not outstanding               (dropped: redelivery)
                     fence or VM not the command's         Skipped(stale_effect)
                     another host than the command's       Skipped(wrong_host)
                     else                                  Done + the (op, outcome) cell below
    VMExited         current bound VM                      Restarting | Succeeded | Failed (rule 7)
    VMGone           current bound VM, no delete claim     Released + EvictionRequested (rule 7)
                     current bound VM, delete claim held   Released + EvictionDeferred
                     another host than the log placed it   Skipped(wrong_host): never an eviction
    ProbeChanged     fence not current                     Skipped(superseded | stale_effect)
    Inventoried      unknown VM, current uid, key VM-less   Discovered + adopt (inspect first, rule 8)
                     absent: a host's inventory lacks our   inspect; not_found -> the VM-gone path
                       bound VM                             (rules 8, 12: confirmed, never a guess)
                     any other unknown VM                  Discovered + remove (never a leak)
    WriteDone        write not outstanding                 (dropped: redelivery)
                     else                                  Done + the outcome's cell (``_WRITES``):
                                                           ok: delete done -> Forgotten; superseded
                                                           (Conflict/Invalid): ConfirmRequested
                                                           (rule 6); gone (NotFound): delete path;
                                                           failed: rewrite timer (a bind
                                                           refused as already bound: to the
                                                           node it names, never elsewhere)
    TimerFired       timer not armed                       (dropped: redelivery)
                     else                                  Done + the purpose's cell below: a
                                                           re-check, never a destruction (rule 12)

Placement (``_place``), for every bring-up: a pod's ``spec.nodeName`` (``Spec.node``) is law — its
VM is placed on that host or nowhere (a dead, unknown or full host: Skipped(no_host) with why, a
FailedPlacement Warning Event the first time that why appears, Unschedulable status, a place timer);
a pod without one is bound first when ``bind_unscheduled`` (a ``bind`` write in the outbox; its ok
records the node and only then the create is commanded) or waits for the scheduler's binding; a
VirtualMachine's host selector names the only host it may use.

Before any row: an input carrying a fence outside the epoch bound (below 0, above ``MAX_EPOCH``, or
more than ``MAX_EPOCH_LEAP`` above the log's epoch) is Skipped(epoch_out_of_bounds) and nothing else,
never evidence of a lost tail; an observation or read above ``MAX_OBJECT_BYTES`` is decided as an
invalid spec (``within_bounds``).

Agent results by the command's op (as the log commanded it) and the answer's outcome (``_RESULTS``;
``-`` is a named CannotHappen). A create/start/wake that took is Bound if its fence is current, else
Skipped(stale_effect) + remove (no leak); a failed one releases only a claim it still owns (rule 2)
and places again; an adopt is bound only after the agent's inspect confirmed the VM (rule 8); a
survey's finds (after a lost tail, Rebuilt) are Discovered and adopted or removed, and no VM is
made again until every host has answered:

    op         ok          failed            fenced  not_found         inconclusive
    create     up_ok       up_failed         fenced  up_failed         retry
    start      up_ok       up_failed         fenced  up_failed         retry
    remove     removed     retry             fenced  removed           retry
    hibernate  hibernated  hibernate_failed  fenced  hibernate_failed  retry
    wake       up_ok       up_failed         fenced  up_failed         retry
    adopt      adopted     adopt_lost        fenced  adopt_lost        adopt_again
    inspect    inspected   retry             fenced  inspect_gone      retry
    survey     surveyed    resurvey          fenced  resurvey          resurvey

Timers by typed purpose (``_KEY_TIMERS`` for any fence of the key, ``_CURRENT_TIMERS`` only for the
current incarnation: another fence's is Skipped; a rewrite by the write's verb, ``_REWRITES``):

    SurveyTimer       any fence  timer_survey
    RetryTimer        any fence  timer_retry
    UnknownTimer      any fence  -
    PlaceTimer        current    timer_place
    RestartTimer      current    timer_restart
    AdoptTimer        current    timer_adopt
    RewriteTimer      current    timer_rewrite
      rewrite status  current    rewrite_status
      rewrite delete  current    rewrite_delete
      rewrite evict   current    rewrite_evict
      rewrite bind    current    rewrite_bind
      rewrite event   current    -

A cell that cannot happen and fires after all is logged as Skipped(cannot_happen) naming the cell,
and counted; nothing else is done. tests/unit/test_policy_table.py checks that these tables cover
every input kind, op, outcome, purpose and verb, and that this guide shows their cells.

After every input a status intent is derived from the incarnation and requested if it changed, so
no rule has to remember to write status.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from shared.fence.schema import (
    ABSENT,
    MAX_EPOCH,
    MAX_EPOCH_LEAP,
    MAX_OBJECT_BYTES,
    NO_INCARNATION,
    SURVEY_VM_ID,
    Admitted,
    Adopted,
    AdoptTimer,
    Bound,
    BringUpFailed,
    Command,
    Commanded,
    CommandOp,
    CommandResult,
    ConfirmedRead,
    ConfirmRequested,
    Decision,
    DeleteClaimed,
    Discovered,
    Done,
    EventReason,
    EvictionDeferred,
    EvictionRequested,
    Failed,
    Fence,
    Forgotten,
    Hibernated,
    Input,
    Inventoried,
    KubeWrite,
    Observed,
    Placed,
    PlaceTimer,
    PodStatusIntent,
    ProbeChanged,
    ReadyChanged,
    Rebuilt,
    Released,
    ReleaseReason,
    Restarting,
    RestartTimer,
    ResultOutcome,
    RetryTimer,
    RewriteTimer,
    Skipped,
    SkipReason,
    Spec,
    SpecChanged,
    StatusReason,
    Succeeded,
    Superseded,
    SurveyTimer,
    TimerArmed,
    TimerFired,
    TimerPurpose,
    UnknownTimer,
    VMExited,
    VMGone,
    WriteDone,
    WriteOutcome,
    WriteRequested,
    WriteVerb,
    purpose_text,
)
from shared.fence.state import Incarnation, KeyState, VMRec, fold
from shared.fence.state import vm_name as _vm_name

# Named bounds (seconds) for the re-checks timers trigger.
PLACE_RETRY_S = 2.0
EFFECT_RETRY_S = 1.0
# A failed bring-up (a missing image, a full disk) is placed again after a backoff that doubles per
# failure in a row, from CREATE_BACKOFF_BASE_S up to CREATE_BACKOFF_MAX_S (as a kubelet's image-pull
# backoff), and the count starts again once a VM is bound: never once a second forever.
CREATE_BACKOFF_BASE_S = 1.0
CREATE_BACKOFF_MAX_S = 300.0
MAX_CAUSE_CHARS = 1024  # of an agent's error text kept in the log, a condition and an Event


def create_backoff_s(failures: int) -> float:
    """The delay before the bring-up that follows ``failures`` failed ones in a row."""
    return min(CREATE_BACKOFF_BASE_S * 2.0 ** min(max(failures - 1, 0), 32), CREATE_BACKOFF_MAX_S)


class HostView(msgspec.Struct, frozen=True):
    """A live host as its heartbeat describes it, plus VMs the reconciler has placed there since."""

    name: str
    cpus_free: int
    memory_free_mib: int
    vms: int = 0


class DecideEnv(msgspec.Struct, frozen=True):
    """Everything besides state and input that a decision may depend on. Decisions that depend on
    it (placement, backoff) are logged, so replay never needs it."""

    hosts: Sequence[HostView] = ()
    restart_backoff_base_s: float = 10.0
    restart_backoff_max_s: float = 300.0
    writer: str = ""
    # a pod without ``spec.nodeName``: True — vmfence places it and binds it (pods/binding) before
    # its VM is made, as a scheduler does (no scheduler runs: the development server); False — it
    # waits for the scheduler's binding (a real control plane). The reconciler's --bind-unscheduled.
    bind_unscheduled: bool = True


class _Run:
    """Collects decisions while folding them into a working copy of the state."""

    def __init__(self, state: KeyState, env: DecideEnv, inp: Input | None = None) -> None:
        self.s = state
        self.env = env
        self.out: list[Decision] = []
        self.inp = inp
        self._tag: str | None = None

    def add(self, d: Decision) -> None:
        self.out.append(d)
        fold(self.s, d)

    @property
    def next_n(self) -> int:
        return self.s.n + 1

    def effect_id(self, *parts: object) -> str:
        """Deterministic effect ids: derived from the log position and the input, so replay and a
        redelivered input re-derive them. The key's epoch counter is part of it: after a lost tail
        the positions repeat, the epoch does not (Rebuilt lifts it). After a cut nobody saw, position
        and epoch both repeat: a digest of the input decided keeps an answer to a lost effect (a
        consistent read asked for another observation) from completing a new one."""
        if self._tag is None:
            self._tag = _digest(self.inp) if self.inp is not None else ""
        pos = f"{self.s.epoch}.{self.next_n}.{len(self.out)}"
        return ":".join(str(p) for p in (*parts, f"{pos}.{self._tag}" if self._tag else pos))


_digest_encoder = msgspec.msgpack.Encoder()


def _digest(inp: Input) -> str:
    return hashlib.blake2b(_digest_encoder.encode(inp), digest_size=4).hexdigest()


def decide(state: KeyState, inp: Input, env: DecideEnv | None = None) -> list[Decision]:
    """Decisions for one input. ``state`` is not modified (a copy is folded)."""
    inp = within_bounds(inp)
    run = _Run(_copy(state), env or DecideEnv(), inp)
    bad = epoch_out_of_bounds(state, inp)
    if bad is not None:
        # a fence no log of this key can have given (above MAX_EPOCH, negative, or further above
        # the log's epoch than any lost tail reaches): never evidence of a cut, never applied
        run.add(Skipped("epoch_out_of_bounds", _fences_of(inp)[0].uid or None, bad))
        return run.out
    why = cut_evidence(state, inp)
    if why is not None:
        # an agent holds a fence of this key the log never assigned (an epoch above all it knows, or
        # its newest epoch under another uid): the log lost entries that no reconciler saw (all
        # restarted without their data, or from a snapshot older than the cut). Rebuild as for a
        # detected cut; the survey rediscovers what this input said.
        _rebuild(run, agent_epoch(state, inp), why)
        return run.out
    _INPUTS[type(inp)](run, inp)
    _sync_status(run)
    return run.out


_size_encoder = msgspec.json.Encoder()


def within_bounds(inp: Input) -> Input:
    """An observation or consistent read whose encoding exceeds ``MAX_OBJECT_BYTES`` (a huge
    annotation: copies of its spec in one entry would pass the server's max payload, and the input
    would be redelivered forever) is decided as an invalid spec: a Warning Event and a condition say
    why, nothing of it is logged, and the key goes on."""
    if isinstance(inp, Observed | ConfirmedRead):
        size = len(_size_encoder.encode(inp))
        if size > MAX_OBJECT_BYTES:
            why = f"the object's vmfence fields take {size} bytes, above the bound of {MAX_OBJECT_BYTES}"
            return msgspec.structs.replace(inp, spec=Spec(), invalid=why)
    return inp


_copier = msgspec.msgpack.Encoder()
_copy_decoder = msgspec.msgpack.Decoder(KeyState)


def _copy(s: KeyState) -> KeyState:
    return _copy_decoder.decode(_copier.encode(s))


# ----------------------------------------------------------------------------- observations


def _on_observed(run: _Run, o: Observed) -> None:
    s = run.s
    if s.is_tombstoned(o.uid):
        run.add(Skipped("superseded", o.uid, "observation of a superseded incarnation"))
        return
    cur = s.cur
    if cur is not None and cur.fence.uid == o.uid:
        if o.resource_version <= cur.rv and not o.gone:
            return  # not newer than what we folded: dropped, counted by the shell
        if o.gone and not cur.delete_claim:
            # gone without a graceful phase (a force delete): ask who owns the name now, so a
            # successor created right behind it is seen — and its on-recreate policy applies —
            # before the predecessor's VM is touched
            _request_confirm(run, o.uid)
            return
        if o.gone or o.deleting:
            _delete_path(run, cur, gone=o.gone)
            return
        _spec_change(run, cur, o.spec, o.resource_version, o.invalid)
        return
    if o.gone:
        return  # deletion of an incarnation we never admitted: nothing of ours to undo
    _request_confirm(run, o.uid)


def _request_confirm(run: _Run, uid: str) -> None:
    """Ask for a consistent read. Reads for one key run in order, so each answer is at least as new
    as the observation that asked for it; one read per unknown uid is enough."""
    if any(isinstance(e, ConfirmRequested) and e.seen_uid == uid for e in run.s.outbox.values()):
        return
    run.add(ConfirmRequested(request=run.effect_id("confirm"), seen_uid=uid, at=run.next_n))


def _spec_change(run: _Run, cur: Incarnation, spec: Spec, rv: int, invalid: str | None) -> None:
    if spec == cur.spec and invalid == cur.invalid:
        return  # e.g. our own status write coming back: nothing changed
    if invalid is not None:
        # the running VM keeps its last valid spec; the pod says why the change was refused
        run.add(SpecChanged(cur.fence, cur.spec, rv, invalid))
        _event(run, cur.fence, "InvalidSpec", invalid, warning=True)
        return
    old = cur.spec
    if old.node is not None and spec.node != old.node:
        # nodeName is immutable once set (the API server refuses a change); a pod bound through our
        # own binding keeps the node the binding gave it, whatever a stale object says
        spec = msgspec.structs.replace(spec, node=old.node)
        if spec == old:
            return
    run.add(SpecChanged(cur.fence, spec, rv))
    if spec.unsupported is not None and spec.unsupported != old.unsupported:
        _event(run, cur.fence, "Unsupported", spec.unsupported, warning=True)
    if spec.hibernate and not old.hibernate:
        _hibernate(run, cur)
    elif old.hibernate and not spec.hibernate:
        _wake(run, cur)
    elif old.node is None and spec.node is not None:
        _bring_up(run)  # the scheduler bound it: its VM comes up on that node


# ---------------------------------------------------------------------- confirmation (rule 3)


def _on_confirmed(run: _Run, r: ConfirmedRead) -> None:
    if not isinstance(run.s.outbox.get(r.request), ConfirmRequested):
        return  # a redelivered read
    _confirmed(run, r)
    _collect_discovered(run)


def _confirmed(run: _Run, r: ConfirmedRead) -> None:
    s = run.s
    asked = s.outbox.get(r.request)
    assert isinstance(asked, ConfirmRequested)
    run.add(Done(r.request, "confirmed" if r.uid else "absent"))
    seen = asked.seen_uid
    if seen != r.uid and not s.is_tombstoned(seen) and (s.cur is None or s.cur.fence.uid != seen):
        # seen before the read was issued, absent from it: that incarnation is already dead
        run.add(Superseded(Fence(s.key, seen, 0), by_uid=r.uid))
    cur = s.cur
    if r.uid is None:
        if cur is not None and asked.at < cur.admitted_at:
            # asked before the current incarnation was admitted: absence then says nothing now
            run.add(Skipped("stale_read", cur.fence.uid, "an older read found the name empty"))
        elif cur is not None:
            _delete_path(run, cur, gone=True)
    elif cur is not None and cur.fence.uid == r.uid:
        if r.deleting:
            _delete_path(run, cur, gone=False)
    elif s.is_tombstoned(r.uid):
        run.add(Skipped("superseded", r.uid, "consistent read returned a tombstoned uid"))
    elif r.resource_version < s.admitted_rv:
        # older than an incarnation already admitted (resourceVersions are etcd revisions): a read
        # answered before a later one was applied. Its uid is dead; never admit it.
        run.add(Superseded(Fence(s.key, r.uid, 0), by_uid=cur.fence.uid if cur else None))
    else:
        _admit(run, r)


def _admit(run: _Run, r: ConfirmedRead) -> None:
    s = run.s
    assert r.uid is not None
    prev = s.cur
    adopt_vm: str | None = None
    if prev is not None:
        _remove_hibernated(run, prev)  # its saved VM, snapshot and address: the successor never wakes it
        run.add(Superseded(prev.fence, by_uid=r.uid))
        _event(run, prev.fence, "Superseded", f"replaced by incarnation {r.uid}", warning=False)
        if r.spec.on_recreate == "adopt" and not r.deleting and prev.vm_id in s.vms and prev.bound:
            adopt_vm = prev.vm_id
    if adopt_vm is None and not r.deleting and r.invalid is None:
        # a VM known only from an agent (a lost log tail), waiting for this read: the admitted
        # incarnation's own, or with on-recreate adopt its predecessor's, is adopted (rule 8)
        found = [rec for rec in s.vms.values() if rec.state == "discovered"]
        own = [rec for rec in found if rec.fence.uid == r.uid]
        if own or (r.spec.on_recreate == "adopt" and len(found) == 1 and len(s.vms) == 1):
            adopt_vm = (own or found)[0].vm_id
    fence = Fence(s.key, r.uid, s.epoch + 1)
    run.add(Admitted(fence, r.spec, r.invalid, r.resource_version))
    cur = s.cur
    assert cur is not None
    # predecessor VMs: adopt the bound one if asked to, remove the rest (rule 8 default: replace)
    for rec in list(s.vms.values()):
        if rec.vm_id != adopt_vm and (rec.fence.uid == r.uid or rec.state == "removing"):
            continue
        if rec.vm_id == adopt_vm:
            _command(run, "adopt", fence, rec.host, rec.vm_id, cur.spec)
        else:
            _command(run, "remove", rec.fence, rec.host, rec.vm_id, None)
    if r.invalid is not None:
        run.add(Failed(fence, "InvalidSpec", r.invalid))
        _event(run, fence, "InvalidSpec", r.invalid, warning=True)
        if r.deleting:
            _delete_path(run, cur, gone=False)
        return
    if r.spec.unsupported is not None:
        _event(run, fence, "Unsupported", r.spec.unsupported, warning=True)
    if r.deleting:
        _delete_path(run, cur, gone=False)
        return
    _bring_up(run)


# ------------------------------------------------------------------------- bring-up (rule 2)


def _bring_up(run: _Run) -> None:
    """Create (or wake) the current incarnation's VM — only when no other VM of the key exists, so
    a key never has two VMs at once."""
    s = run.s
    cur = s.cur
    if cur is None or cur.deleting or cur.invalid is not None or cur.phase in ("Failed", "Succeeded"):
        return
    if s.rebuilding:
        return  # after a lost tail, no VM is made until every host said what it has
    if cur.vm_id is not None and cur.vm_id in s.vms:
        return  # has (or is making) its VM
    if s.vms and not _stranded(run, cur):
        return  # another VM of the key is still being removed or adopted: wait for its Released
    if _place_pending(s, cur.fence):
        return
    if _verify_first(run):
        return
    if cur.hibernated:
        _wake(run, cur)  # restores from the snapshot in the log; never a blank VM (rule 10)
        return
    if _is_pod(s.key) and cur.spec.node is None:
        _bind(run, cur)  # an unscheduled pod: bound first (or left to the scheduler), its VM after
        return
    host, why = _place(run.env, cur.spec)
    if host is None:
        # a node that is not a vmfence host never becomes one: said once, never re-checked
        _unplaced(run, cur, why, retry=cur.spec.node is None or cur.spec.node.startswith(NODE_PREFIX))
        return
    vm_id = _vm_name(s.key, cur.fence.uid, cur.gen + 1)
    run.add(Placed(cur.fence, vm_id, host))
    _command(run, "create", cur.fence, host, vm_id, cur.spec)


def _stranded(run: _Run, cur: Incarnation) -> bool:
    """Every other VM of the key is a predecessor's, being removed, on a host that is not live: the
    predecessor's object was force-deleted (vmfence never frees a name before its VM is confirmed
    gone, rule 12), which is the operator's word that its VM is out of the way, as for a pod on a
    down kubelet. Logged per VM as Skipped(stranded); the remove stays queued for its host. A
    removal on a live host is always waited for."""
    live = {h.name for h in run.env.hosts}
    others = list(run.s.vms.values())
    if not others or any(r.state != "removing" or r.fence.uid == cur.fence.uid or r.host in live for r in others):
        return False
    for r in others:
        run.add(Skipped("stranded", r.fence.uid, r.vm_id))
    return True


def _is_pod(key: str) -> bool:
    return not key.startswith("vm:")


def _bind(run: _Run, cur: Incarnation) -> None:
    """A pod without ``spec.nodeName``. With a scheduler (``bind_unscheduled`` off) nothing: the
    scheduler's binding arrives as an observation and brings the VM up. Without one, vmfence picks
    the host and binds the pod to it through ``pods/binding`` — a write in the outbox, before any
    command (rule 11): the VM is made only once the binding took (``_written``), so the pod's
    ``nodeName`` is always true, and a binding someone else won leads to their node, never to a VM
    elsewhere (``_write_failed``)."""
    if not run.env.bind_unscheduled or _binding(run.s, cur.fence):
        return
    host, why = _place(run.env, cur.spec)
    if host is None:
        _unplaced(run, cur, why)
        return
    run.add(WriteRequested(KubeWrite(run.effect_id("bind"), "bind", cur.fence, node=node_of(host))))


def _binding(s: KeyState, fence: Fence) -> bool:
    return any(
        isinstance(e, WriteRequested) and e.write.verb == "bind" and e.write.fence == fence
        for e in s.outbox.values()
    )


def _unplaced(run: _Run, cur: Incarnation, why: str, *, retry: bool = True) -> None:
    """No host takes the VM now: logged with why (the pod's status says it), a Warning Event the
    first time that reason appears, and a place timer re-checks (rule 12: never a VM elsewhere)."""
    if cur.unplaced != why:
        _event(run, cur.fence, "FailedPlacement", why, warning=True)
    run.add(Skipped("no_host", cur.fence.uid, why))
    if retry:
        _arm(run, cur.fence, PlaceTimer(), PLACE_RETRY_S)


def _verify_first(run: _Run) -> bool:
    """The writer loaded the key from a log that may have lost a tail nobody saw (``unverified``):
    before its first VM, every host says what it has of the key and raises its key mark to the
    current fence, so a VM or an in-flight command of the lost tail shows the cut (cut_evidence) or
    is refused — never a second VM beside it. True while that survey is out."""
    s = run.s
    if not s.unverified:
        return False
    if not _verifying(s):
        _survey(run)
    return True


def _verifying(s: KeyState) -> bool:
    """A survey round sent since the load is out, or a retry of one is armed."""
    return bool(s.verifying) or (
        s.unverified and any(isinstance(e, TimerArmed) and isinstance(e.timer, SurveyTimer) for e in s.outbox.values())
    )


NODE_PREFIX = "vmfence-"  # a vmfence host's Node is ``vmfence-<host>`` (shared.fence.podspec.NODE_PREFIX)


def node_of(host: str) -> str:
    return f"{NODE_PREFIX}{host}"


def _place(env: DecideEnv, spec: Spec) -> tuple[str | None, str]:
    """The host for the VM, or None and why not. A pod's ``nodeName`` is law: its VM runs on that
    host or nowhere (a full, dead or unknown host is a reason, never a detour); a VirtualMachine's
    host selector names the only host it may use; anything else takes the emptiest live host."""
    size = f"{spec.cpus} CPU{'s' if spec.cpus != 1 else ''}, {spec.memory_mib} MiB"
    if spec.node is not None:
        if not spec.node.startswith(NODE_PREFIX):
            return None, f"the pod is bound to node {spec.node}, which is not a vmfence host"
        only: str | None = spec.node[len(NODE_PREFIX):]
        what = f"node {spec.node}"
    else:
        only = spec.host_selector
        what = f"host {only}"
    hosts = [h for h in env.hosts if only is None or h.name == only]
    if only is not None and not hosts:
        return None, f"{what} is not a live vmfence host (dead, unknown or not yet heartbeating)"
    fits = [h for h in hosts if h.cpus_free >= spec.cpus and h.memory_free_mib >= spec.memory_mib]
    if not fits:
        if only is not None:
            return None, f"{what} has no room for this VM ({size})"
        return None, f"no live vmfence host has room for this VM ({size})"
    return min(fits, key=lambda h: (h.vms, -h.memory_free_mib, h.name)).name, ""


# ---------------------------------------------------------------------------------- results


class _Answer(msgspec.Struct, frozen=True):
    """An agent's answer to a command still outstanding, with what its rule needs: the key's record
    of the VM on that host, the current incarnation, and whether a rebuild was under way before the
    answer's ``Done`` (the Done of a round's last survey answer ends the rebuild it belongs to)."""

    cmd: Command
    r: CommandResult
    rec: VMRec | None
    cur: Incarnation | None
    rebuilding: bool


def _on_result(run: _Run, r: CommandResult) -> None:
    """Finds the cell (command op, outcome) of ``_RESULTS``; the op is the one the log commanded."""
    s = run.s
    pending = s.outbox.get(r.command_id)
    if not isinstance(pending, Commanded):
        return  # redelivered result of a finished command
    cmd = pending.command
    if cmd.fence != r.fence or cmd.vm_id != r.vm_id:
        run.add(Skipped("stale_effect", r.fence.uid, f"result fence does not match command {cmd.id}"))
        return
    if r.host != cmd.host or any(i.host != cmd.host for i in r.found):
        run.add(Skipped("wrong_host", r.fence.uid, f"answer to {cmd.id} (sent to {cmd.host}) names {r.host}"))
        return
    rebuilding = s.rebuilding
    run.add(Done(cmd.id, r.outcome))
    answer = _Answer(cmd, r, _rec_on(s, cmd.vm_id, cmd.host), s.cur, rebuilding)
    cell = _RESULTS[cmd.op][r.outcome]
    if isinstance(cell, CannotHappen):
        _cannot_happen(run, f"result {cmd.op}/{r.outcome}", cell, r.fence.uid)
    else:
        cell(run, answer)


def _fenced(run: _Run, a: _Answer) -> None:
    """The agent refused the command: its fence is older than the VM's owner there (rule 4)."""
    s, cmd, rec, cur = run.s, a.cmd, a.rec, a.cur
    run.add(Skipped("fenced", a.r.fence.uid, f"agent refused {cmd.op} of {cmd.vm_id}"))
    owner = next((i for i in a.r.found if i.vm_id == cmd.vm_id), None)
    if owner is not None and owner.fence.key == s.key:
        # the VM exists under a newer fence of this key (an adopt whose answer is still on
        # its way, or one the log lost): it is still this key's VM, never "gone". Record its
        # real owner; collect it under that fence unless that is the current incarnation.
        run.add(Discovered(owner.fence, owner.vm_id, owner.host))
        if cur is None or cur.fence != owner.fence or cur.deleting:
            _command(run, "remove", owner.fence, owner.host, owner.vm_id, None)
        elif cur.vm_id is None and len(s.vms) == 1:
            # the current fence already owns it and the log never bound it (an adopt of a lost
            # tail, re-decided otherwise): it is the incarnation's VM; adopt it (rule 8)
            _command(run, "adopt", cur.fence, owner.host, owner.vm_id, cur.spec)
        elif cur.vm_id != owner.vm_id:
            _command(run, "remove", owner.fence, owner.host, owner.vm_id, None)
        return
    # otherwise the VM does not exist for us (removed for good, or never made): our record of
    # it ends here; if it does exist after all, the next inventory brings it back
    if rec is not None and cmd.op != "survey":
        run.add(Released(rec.fence, cmd.vm_id, cmd.host, "fenced", cmd.id))
        if cur is not None and cur.fence == cmd.fence and not cur.deleting:
            _arm(run, cur.fence, PlaceTimer(), EFFECT_RETRY_S)
        else:
            _after_release(run)


def _retry(run: _Run, a: _Answer) -> None:
    """Inconclusive (or a remove that failed): the same op again for the VM's owner (rule 12)."""
    if a.rec is not None:
        _arm(run, a.rec.fence, RetryTimer(a.cmd.op, a.cmd.vm_id), EFFECT_RETRY_S)


def _up_ok(run: _Run, a: _Answer) -> None:
    """A create, start or wake took: bound if its fence is current, else removed (no leak)."""
    s, cmd, rec, cur = run.s, a.cmd, a.rec, a.cur
    if rec is None or rec.state == "removing":
        return  # a remove is already queued behind it on the same host
    if cur is not None and cur.fence == cmd.fence and not cur.deleting and cur.vm_id == cmd.vm_id:
        run.add(Bound(cur.fence, cmd.vm_id, cmd.host, cmd.id, a.r.ip, a.r.vnc_port))
        _event(run, cur.fence, "Started", f"VM {cmd.vm_id} running on {cmd.host}")
        if cur.spec.hibernate:
            _hibernate(run, cur)
        return
    reason: SkipReason = "superseded" if s.is_tombstoned(cmd.fence.uid) else "stale_effect"
    run.add(Skipped(reason, cmd.fence.uid, f"{cmd.op} of {cmd.vm_id} finished after its fence ended"))
    if rec.fence == cmd.fence:
        # still the finished command's VM: remove it (no leak). One a successor adopted meanwhile
        # (a restart's answer re-sent from the agent's ledger after the adopt's) is the successor's
        # now: removing it would replace its VM for nothing (found by docs/mutants.md)
        _command(run, "remove", rec.fence, rec.host, rec.vm_id, None)


_UP_FAILED: dict[CommandOp, ReleaseReason] = {
    "create": "create_failed", "start": "start_failed", "wake": "wake_failed"
}


def _up_failed(run: _Run, a: _Answer) -> None:
    """A create, start or wake failed (or found no VM): release the claim, place again."""
    cmd, rec, cur = a.cmd, a.rec, a.cur
    cause = (a.r.error or f"{cmd.op} failed ({a.r.outcome})")[:MAX_CAUSE_CHARS]
    if rec is not None and rec.fence == cmd.fence:
        # a failed bring-up releases only a claim it still owns (rule 2): a start of a VM that a
        # successor adopted meanwhile (its answer re-sent from the agent's ledger after the
        # adopt's) must not release the successor's VM (tests/unit/test_rule2_claim.py)
        run.add(Released(cmd.fence, cmd.vm_id, cmd.host, _UP_FAILED[cmd.op], cmd.id))
    if cur is not None and cur.fence == cmd.fence and not cur.deleting:
        failures = cur.failures + 1
        backoff = create_backoff_s(failures)
        repeats = cur.failure_repeats + 1 if cause == cur.failure else 1
        run.add(BringUpFailed(cur.fence, cmd.vm_id, failures, backoff, cause, repeats))
        # one Event per cause, counting its repeats (Kubernetes' aggregation), not one per failure
        _event(run, cur.fence, "FailedCreate", cause, warning=True, count=repeats)
        _arm(run, cur.fence, PlaceTimer(), backoff)
    else:
        _after_release(run)


def _removed(run: _Run, a: _Answer) -> None:
    """The VM is gone from its host: released; a delete finishes or a successor comes up."""
    if a.rec is not None:
        run.add(Released(a.rec.fence, a.cmd.vm_id, a.cmd.host, "removed", a.cmd.id))
        _after_release(run)


def _hibernated(run: _Run, a: _Answer) -> None:
    """The snapshot is made and recorded in the log (rule 10); an answer without one failed."""
    cmd, rec, cur, snapshot = a.cmd, a.rec, a.cur, a.r.snapshot
    if rec is None:
        return
    if snapshot is None:
        _hibernate_failed(run, a)
        return
    run.add(Hibernated(rec.fence, cmd.vm_id, cmd.host, snapshot))
    if cur is not None and cur.fence == rec.fence:
        _event(run, cur.fence, "Hibernated", f"snapshot {snapshot} on {cmd.host}")
    _after_release(run)  # finishes a delete, or wakes if unhibernated meanwhile


def _hibernate_failed(run: _Run, a: _Answer) -> None:
    """The VM keeps running: bound again if its fence is current, else removed."""
    cmd, rec, cur = a.cmd, a.rec, a.cur
    if rec is None:
        return
    run.add(Skipped("hibernate_failed", a.r.fence.uid, a.r.error or ""))
    if cur is not None and cur.fence == rec.fence and not cur.deleting:
        run.add(Bound(cur.fence, cmd.vm_id, cmd.host, cmd.id, cur.ip, cur.vnc_port))
    else:
        _command(run, "remove", rec.fence, rec.host, rec.vm_id, None)


def _adopted(run: _Run, a: _Answer) -> None:
    """The agent's inspect confirmed the VM (rule 8): it is the current incarnation's, or removed."""
    cmd, cur = a.cmd, a.cur
    if a.rec is None:
        return
    run.add(Adopted(cmd.fence, cmd.vm_id, cmd.host, cmd.id))
    if cur is None or cur.fence != cmd.fence or cur.deleting:
        _command(run, "remove", cmd.fence, cmd.host, cmd.vm_id, None)
        return
    run.add(Bound(cur.fence, cmd.vm_id, cmd.host, cmd.id, a.r.ip, a.r.vnc_port))
    _event(run, cur.fence, "Adopted", f"VM {cmd.vm_id} on {cmd.host}")
    state = next((i.state for i in a.r.found if i.vm_id == cmd.vm_id), "running")
    if state == "exited":
        # adopted while it was down (its predecessor's restart died with that
        # fence): the successor's restart policy takes over, or it stays down forever
        _on_exited(run, VMExited(cur.fence, cmd.host, cmd.vm_id, None))
    elif cur.spec.hibernate:
        _hibernate(run, cur)


def _adopt_lost(run: _Run, a: _Answer) -> None:
    """The runtime does not know the VM: it leaves the index; a new one is made (rule 8)."""
    if a.rec is not None:
        run.add(Released(a.rec.fence, a.cmd.vm_id, a.cmd.host, "lost", a.cmd.id))
        _after_release(run)


def _adopt_again(run: _Run, a: _Answer) -> None:
    """An inconclusive inspect is retried, never trusted (rule 8)."""
    if run.s.is_current(a.cmd.fence):
        _arm(run, a.cmd.fence, AdoptTimer(a.cmd.vm_id), EFFECT_RETRY_S)
    else:
        _retry(run, a)


def _inspected(run: _Run, a: _Answer) -> None:
    """The runtime knows the VM: the inventory that lacked it was wrong (or raced a change); the
    binding stands and nothing else is done."""


def _inspect_gone(run: _Run, a: _Answer) -> None:
    """The runtime confirmed the VM is gone: the VM-gone path (rule 7), as if its host had said so."""
    _on_gone(run, VMGone(a.cmd.fence, a.cmd.host, a.cmd.vm_id))


def _surveyed(run: _Run, a: _Answer) -> None:
    """A host said what it has of the key: each VM unknown to the log is discovered."""
    s = run.s
    for item in a.r.found:
        if item.vm_id not in s.vms:
            _discover(run, item, a.rebuilding)
    if not s.rebuilding and not _verifying(s):
        _after_release(run)  # (still unverified after a round from an older epoch: another)


def _resurvey(run: _Run, a: _Answer) -> None:
    """A survey without an answer is asked again: no VM is made on a guess."""
    _arm(run, a.cmd.fence, SurveyTimer(), EFFECT_RETRY_S)


def _rec_on(s: KeyState, vm_id: str, host: str) -> VMRec | None:
    """The key's record of ``vm_id`` if it is the VM on ``host``: after a cut nobody saw, a name the
    lost tail gave a VM (since lost or removed) may be given again on another host; news about the
    old one must not touch the new one's record."""
    rec = s.vms.get(vm_id)
    return rec if rec is not None and rec.host == host else None


def _after_release(run: _Run) -> None:
    """A VM left the key: finish a delete, or bring up the successor that waited for it."""
    s = run.s
    cur = s.cur
    if cur is None:
        return
    if cur.delete_claim:
        if not s.rebuilding and not _vms_of(s, cur) and not _verify_first(run):
            _finish_delete(run, cur)
        return
    _bring_up(run)


# ------------------------------------------------------------------------- deletes (rule 5)


def _delete_path(run: _Run, cur: Incarnation, *, gone: bool) -> None:
    s = run.s
    if cur.delete_claim:
        if gone and not _vms_of(s, cur):
            _forget(run, cur)
            return
        run.add(Skipped("delete_in_flight", cur.fence.uid, "a delete for this incarnation is in flight"))
        return
    run.add(DeleteClaimed(cur.fence))
    mine = _vms_of(s, cur)
    for rec in mine:
        if rec.state != "removing":
            _command(run, "remove", rec.fence, rec.host, rec.vm_id, None)
    if not mine and _remove_hibernated(run, cur):
        mine = _vms_of(s, cur)
        if gone:
            _forget(run, cur)  # the object is gone; the remove of its saved VM goes on under its fence
        return
    if not mine:
        if gone:
            _forget(run, cur)
        elif not s.rebuilding and not _verify_first(run):
            _finish_delete(run, cur)
        # else: a survey is out after a lost log tail (or, loaded from the log, to find one nobody
        # saw); a VM the lost tail made may still run, so the object stays until every host
        # answered (its answer finishes the delete)


def _remove_hibernated(run: _Run, cur: Incarnation) -> bool:
    """A hibernated incarnation that ends: its saved VM's host is told to remove it (the snapshot
    files and the address it kept go with it, owned by its fence: rule 9). True if commanded."""
    if not cur.hibernated or cur.hibernated_vm is None or cur.snapshot_host is None:
        return False
    if cur.hibernated_vm in run.s.vms:
        return False
    _command(run, "remove", cur.fence, cur.snapshot_host, cur.hibernated_vm, None)
    return True


def _vms_of(s: KeyState, cur: Incarnation) -> list[VMRec]:
    """The incarnation's VMs, also those a survey found under an epoch from before a rebuild."""
    return [rec for rec in s.vms.values() if rec.fence.uid == cur.fence.uid]


def _finish_delete(run: _Run, cur: Incarnation) -> None:
    """VMs are gone: remove the object as a kubelet does (grace 0, UID precondition)."""
    if any(
        isinstance(e, WriteRequested) and e.write.verb == "delete" and e.write.fence == cur.fence
        for e in run.s.outbox.values()
    ):
        return
    run.add(WriteRequested(KubeWrite(run.effect_id("delete"), "delete", cur.fence)))


def _forget(run: _Run, cur: Incarnation) -> None:
    if cur.eviction_deferred is not None:
        # a deferred eviction is resolved by the delete it waited for, and says so
        run.add(Done(f"eviction:{cur.eviction_deferred}", "resolved_by_delete"))
    run.add(Forgotten(cur.fence))


# ------------------------------------------------------------------------- VM lifecycle (rule 7)


def _on_exited(run: _Run, e: VMExited) -> None:
    s = run.s
    if _wrong_host(run, e.vm_id, e.host, "exit"):
        return
    rec = _rec_on(s, e.vm_id, e.host)
    cur = s.cur
    if rec is None or rec.fence != e.fence or cur is None or cur.fence != e.fence:
        _skip_foreign(run, e.fence, f"exit of {e.vm_id}")
        return
    if cur.vm_id != e.vm_id or rec.state != "running":
        return  # an exit while it is being removed/hibernated is expected
    policy = cur.spec.restart_policy
    failed = e.exit_code != 0  # an unknown exit code (None) counts as a failure, as a signal would
    if policy == "Always" or (policy == "OnFailure" and failed):
        count = cur.restart_count + 1
        backoff = min(
            run.env.restart_backoff_base_s * (2 ** (count - 1)), run.env.restart_backoff_max_s
        )
        run.add(Restarting(cur.fence, e.vm_id, count, backoff))
        _event(run, cur.fence, "BackOff", f"VM exited ({e.exit_code}); restart {count} in {backoff:.0f}s")
        _arm(run, cur.fence, RestartTimer(e.vm_id), backoff)
        return
    if not failed:
        run.add(Succeeded(cur.fence))
    else:
        run.add(Failed(cur.fence, "VMExited", f"exit code {'unknown' if e.exit_code is None else e.exit_code}"))
    _command(run, "remove", rec.fence, rec.host, rec.vm_id, None)


def _on_gone(run: _Run, g: VMGone) -> None:
    s = run.s
    if _wrong_host(run, g.vm_id, g.host, "vm-gone"):
        return  # never an eviction on a report the log contradicts
    rec = _rec_on(s, g.vm_id, g.host)
    # lost after the agent moved it to the adopting fence, before the adopt's answer came back: it
    # is gone all the same (as an adopt answered not_found: released, a new VM made)
    lost_while_adopted = rec is not None and rec.state == "adopting" and s.is_current(g.fence)
    if rec is None or (rec.fence != g.fence and not lost_while_adopted):
        _skip_foreign(run, g.fence, f"vm-gone of {g.vm_id}")
        return
    cur = s.cur
    was_bound = cur is not None and cur.fence == rec.fence and cur.vm_id == g.vm_id and cur.bound
    run.add(Released(rec.fence, g.vm_id, rec.host, "gone"))
    if not was_bound or cur is None:
        _after_release(run)
        return
    if s.key.startswith("vm:"):
        # a VirtualMachine gets exactly one replacement per failure
        run.add(Restarting(cur.fence, g.vm_id, cur.restart_count + 1, 0.0))
        _bring_up(run)
        return
    if cur.delete_claim:
        run.add(EvictionDeferred(cur.fence, g.vm_id))
        _after_release(run)
        return
    run.add(EvictionRequested(cur.fence, g.vm_id))
    run.add(WriteRequested(KubeWrite(run.effect_id("evict"), "evict", cur.fence, message="VM gone")))
    _event(run, cur.fence, "VMGone", f"VM {g.vm_id} vanished from {g.host}; evicting", warning=True)


def _on_probe(run: _Run, p: ProbeChanged) -> None:
    s = run.s
    if _wrong_host(run, p.vm_id, p.host, "probe"):
        return
    cur = s.cur
    if cur is None or cur.fence != p.fence or cur.vm_id != p.vm_id or cur.host != p.host or not cur.bound:
        _skip_foreign(run, p.fence, f"probe of {p.vm_id}")
        return
    if cur.ready != p.ready:
        run.add(ReadyChanged(cur.fence, p.ready))


def _wrong_host(run: _Run, vm_id: str, host: str, what: str) -> bool:
    """A report about a VM from a host other than the one the log placed it on contradicts the log:
    logged as Skipped(wrong_host), never acted on. True if it was."""
    rec = run.s.vms.get(vm_id)
    if rec is None or rec.host == host:
        return False
    run.add(Skipped("wrong_host", rec.fence.uid, f"{what} of {vm_id} from {host}; the log placed it on {rec.host}"))
    return True


def _skip_foreign(run: _Run, fence: Fence, what: str) -> None:
    """Rule 4: work reported for a fence that is not current is logged and never applied."""
    s = run.s
    if s.is_tombstoned(fence.uid):
        run.add(Skipped("superseded", fence.uid, what))
    elif not s.is_current(fence):
        run.add(Skipped("stale_effect", fence.uid, what))


# ---------------------------------------------------------------------- inventory (rule 8)


def _on_inventory(run: _Run, i: Inventoried) -> None:
    """Inventories are the backstop for runtime news whose own report never arrived (the agent
    died between the event and the report): an exit (exit code unknown), a VM the runtime lost,
    readiness."""
    if _wrong_host(run, i.vm_id, i.host, "inventory"):
        return
    rec = run.s.vms.get(i.vm_id)
    ours = rec is not None and rec.host == i.host and rec.fence == i.fence  # our record of that VM
    if i.state == "lost":
        if ours:
            _on_gone(run, VMGone(i.fence, i.host, i.vm_id))
        return  # a lost VM is never discovered: there is nothing to adopt or remove
    if i.state == ABSENT:
        if ours and rec is not None:
            _inspect(run, rec)
        return  # absence of a VM we do not bind there says nothing
    if rec is None:
        _discover(run, i, run.s.rebuilding)
    elif not ours:
        return
    elif i.state == "exited":
        if rec.state == "running":
            _on_exited(run, VMExited(i.fence, i.host, i.vm_id, None))
    elif i.state == "running" and i.ready is not None and (cur := run.s.cur) is not None \
            and cur.bound and cur.fence == i.fence and cur.vm_id == i.vm_id:
        # the probe's own report was decided before the binding (a redelivery reordered them) and
        # dropped, or never stored: the readiness the host last reported wins
        _on_probe(run, ProbeChanged(i.fence, i.host, i.vm_id, i.ready))


def _inspect(run: _Run, rec: VMRec) -> None:
    """A complete inventory of the VM's host lacked it (a forged remove, a lost vm-gone): evidence,
    not proof. The agent asks its runtime (rule 8); only its not_found takes the VM-gone path, an
    inconclusive answer is asked again (rule 12). One inspect of a VM at a time."""
    s, cur = run.s, run.s.cur
    if cur is None or cur.fence != rec.fence or cur.vm_id != rec.vm_id or not cur.bound or cur.deleting:
        return
    if rec.state != "running" or _inspecting(s, rec.vm_id):
        return
    _command(run, "inspect", rec.fence, rec.host, rec.vm_id, None)


def _inspecting(s: KeyState, vm_id: str) -> bool:
    return any(
        (isinstance(e, Commanded) and e.command.op == "inspect" and e.command.vm_id == vm_id)
        or (isinstance(e, TimerArmed) and e.timer == RetryTimer("inspect", vm_id))
        for e in s.outbox.values()
    )


def _discover(run: _Run, i: Inventoried, rebuilding: bool) -> None:
    """A VM the log does not know: record it under its agent-side owner, then adopt it if it is
    the current incarnation's only VM (after the agent inspects it), else remove it — never a
    leak, never a second VM for a key. ``rebuilding``: the report came while a lost tail was being
    rebuilt (a survey answer's own Done may have ended the rebuild since)."""
    s = run.s
    run.add(Discovered(i.fence, i.vm_id, i.host))
    cur = s.cur
    if (
        cur is not None
        and (cur.fence.uid == i.fence.uid or _adopts_predecessor(s, cur, i, rebuilding))
        and cur.vm_id is None
        and not (cur.deleting or cur.hibernated)
        and len(s.vms) == 1
    ):
        _command(run, "adopt", cur.fence, i.host, i.vm_id, cur.spec)
        return
    if not s.is_tombstoned(i.fence.uid) and (cur is None or cur.fence.uid != i.fence.uid):
        # an incarnation the log never admitted (its admission was in a lost tail): the VM may be
        # the live pod's. It stays ``discovered`` (no VM is made beside it) until a consistent read
        # says who owns the name: that incarnation adopts it, or it is removed (_collect_discovered)
        _request_confirm(run, i.fence.uid)
        return
    run.add(Skipped("orphan", i.fence.uid, f"VM {i.vm_id} on {i.host} belongs to no live incarnation"))
    _command(run, "remove", i.fence, i.host, i.vm_id, None)


def _collect_discovered(run: _Run) -> None:
    """VMs kept ``discovered`` while a read was out whose incarnation is now known dead: removed."""
    s = run.s
    for rec in list(s.vms.values()):
        if rec.state == "discovered" and s.is_tombstoned(rec.fence.uid):
            run.add(Skipped("orphan", rec.fence.uid, f"VM {rec.vm_id} on {rec.host} belongs to no live incarnation"))
            _command(run, "remove", rec.fence, rec.host, rec.vm_id, None)


def _adopts_predecessor(s: KeyState, cur: Incarnation, i: Inventoried, rebuilding: bool) -> bool:
    """After a lost log tail the predecessor's VM is known only from the survey: a successor with
    ``on-recreate: adopt`` takes it over as it would have at its admission (rule 8)."""
    return (
        rebuilding
        and cur.spec.on_recreate == "adopt"
        and s.is_tombstoned(i.fence.uid)
        and i.state not in ("removing", "hibernating")
    )


def rebuild(state: KeyState, known_epoch: int, env: DecideEnv | None = None, reason: str = "") -> list[Decision]:
    """Decisions for a key whose log turned out to be behind what its writer had seen (a lost
    tail): say so, lift the epoch above any the writer knew (so no agent holds a fence as new as
    the next incarnation's: rule 4), and survey every host before any VM is made again, since the
    lost tail's claims are known only to the agents now (rule 2; the fault campaign's scenario 17,
    ``log_tail_lost``)."""
    run = _Run(_copy(state), env or DecideEnv())
    _rebuild(run, known_epoch, reason or "log behind its writer")
    return run.out


def _rebuild(run: _Run, known_epoch: int, reason: str) -> None:
    run.add(Rebuilt(reason, epoch_floor=max(known_epoch, run.s.epoch)))
    _survey(run)


def agent_epoch(state: KeyState, inp: Input) -> int:
    """The newest epoch of this key an agent's report shows (0: none): the fences it carries (the
    owner of a VM it reports, a command's fence, the owners a fenced answer or a survey names) and
    a fenced answer's key mark. Epochs are assigned only by the key's log, so one above
    ``state.epoch`` proves the log lost entries; a stale copy of the log (another writer appended
    meanwhile) loses its append race and decides again on the re-read log."""
    return max([0, *(f.epoch for f in _agent_fences(state, inp))])


def epoch_out_of_bounds(state: KeyState, inp: Input) -> str | None:
    """Why a fence the input carries cannot be believed, or None: an epoch below 0 or above
    ``MAX_EPOCH``, or (for this key) more than ``MAX_EPOCH_LEAP`` above the log's epoch."""
    ceiling = min(MAX_EPOCH, state.epoch + MAX_EPOCH_LEAP)
    for f in _fences_of(inp):
        limit = ceiling if f.key == state.key else MAX_EPOCH
        if not 0 <= f.epoch <= limit:
            return f"epoch {f.epoch} outside 0..{limit} (the log of the key is at epoch {state.epoch})"
    return None


def _fences_of(inp: Input) -> list[Fence]:
    """Every fence an input carries (none for observations and reads)."""
    match inp:
        case CommandResult():
            return [inp.fence, *(i.fence for i in inp.found), Fence(inp.fence.key, inp.key_uid, inp.key_epoch)]
        case Inventoried() | VMExited() | VMGone() | ProbeChanged() | WriteDone() | TimerFired():
            return [inp.fence]
        case _:
            return []


def cut_evidence(state: KeyState, inp: Input) -> str | None:
    """Why an agent's report proves the key's log lost entries, or None. Epochs are assigned only by
    the key's log, each to one uid: a fence above ``state.epoch``, or at ``state.epoch`` under a uid
    other than ``state.epoch_uid``, was assigned by entries the log no longer holds."""
    seen = agent_epoch(state, inp)
    if seen > state.epoch:
        return f"an agent holds epoch {seen} of the key; the log knows only {state.epoch}"
    if not state.epoch_uid or seen < state.epoch:
        return None
    for f in _agent_fences(state, inp):
        if f.epoch == state.epoch and f.uid and f.uid != state.epoch_uid:
            return f"an agent holds epoch {f.epoch} of the key for {f.uid}; the log gave it to {state.epoch_uid}"
    return None


def _agent_fences(state: KeyState, inp: Input) -> list[Fence]:
    match inp:
        case CommandResult():
            fences = [inp.fence, *(i.fence for i in inp.found), Fence(state.key, inp.key_uid, inp.key_epoch)]
        case Inventoried() | VMExited() | VMGone() | ProbeChanged():
            fences = [inp.fence]
        case _:
            return []
    return [f for f in fences if f.key == state.key]


def _survey(run: _Run) -> None:
    s = run.s
    # under the owner of the key's epoch ("" if none: agents then hold that epoch for no incarnation)
    owner = s.cur.fence.uid if s.cur is not None else s.epoch_uid
    fence = Fence(s.key, "" if owner == NO_INCARNATION else owner, s.epoch)
    if not run.env.hosts:
        _arm(run, fence, SurveyTimer(), PLACE_RETRY_S)
        return
    for host in run.env.hosts:
        _command(run, "survey", fence, host.name, SURVEY_VM_ID, None)


# ------------------------------------------------------------------ Kubernetes writes (rule 6)


def _on_write_done(run: _Run, w: WriteDone) -> None:
    """Finds the cell of ``_WRITES`` for the outcome of a write still outstanding (rule 6)."""
    s = run.s
    pending = s.outbox.get(w.write_id)
    if not isinstance(pending, WriteRequested):
        return
    run.add(Done(w.write_id, w.outcome))
    cur = s.cur
    if cur is None or cur.fence != w.fence:
        return
    if w.outcome == "failed" and pending.write.verb == "bind":
        _write_failed(run, cur, pending.write, w.node)
        return
    _WRITES[w.outcome](run, cur, pending.write)


def _written(run: _Run, cur: Incarnation, write: KubeWrite) -> None:
    """The write took; the final delete of the object ends the incarnation; a binding makes the
    pod's node true, and only then is its VM made, on that node."""
    if write.verb == "delete":
        _forget(run, cur)
    elif write.verb == "bind" and write.node is not None:
        _bound_to(run, cur, write.node)
        _event(run, cur.fence, "Scheduled", f"Successfully assigned {cur.fence.key} to {write.node}")


def _bound_to(run: _Run, cur: Incarnation, node: str) -> None:
    """The pod's nodeName is ``node`` (our binding took, or another binder's did): recorded, and
    the VM brought up there — on no other host."""
    if cur.spec.node is None:
        run.add(SpecChanged(cur.fence, msgspec.structs.replace(cur.spec, node=node), cur.rv))
    _bring_up(run)


def _write_superseded(run: _Run, cur: Incarnation, write: KubeWrite) -> None:
    """Conflict/Invalid on a uid-carrying write: another incarnation owns the name; ask who."""
    run.add(Skipped("superseded_write", cur.fence.uid, f"{write.verb} hit another incarnation"))
    _request_confirm(run, cur.fence.uid)


def _write_gone(run: _Run, cur: Incarnation, write: KubeWrite) -> None:
    """NotFound: the object is gone; the delete path removes the VM."""
    _delete_path(run, cur, gone=True)


def _write_failed(run: _Run, cur: Incarnation, write: KubeWrite, node: str | None = None) -> None:
    """Any other failure: the same write again later (a timer: re-check, never destroy). A binding
    refused because the pod is bound already (409: a scheduler, or another reconciler, was first)
    names that node: the VM goes there or nowhere, never to the host this binding picked."""
    if write.verb == "bind" and node is not None:
        _bound_to(run, cur, node)
        return
    _arm(run, cur.fence, RewriteTimer(write.verb), EFFECT_RETRY_S)


def _on_timer(run: _Run, t: TimerFired) -> None:
    """Finds the cell of ``_KEY_TIMERS`` (any fence of the key) or ``_CURRENT_TIMERS`` (only the
    current incarnation's) for the armed timer's typed purpose (rule 12: every one re-checks)."""
    s = run.s
    armed = s.outbox.get(t.timer_id)
    if not isinstance(armed, TimerArmed):
        return
    run.add(Done(t.timer_id, "fired"))
    purpose = armed.timer
    kind = type(purpose)
    if kind in _KEY_TIMERS:
        cell: TimerRule | CannotHappen = _KEY_TIMERS[kind]
    else:
        cur = s.cur
        if cur is None or cur.fence != t.fence:
            _skip_foreign(run, t.fence, f"timer {armed.purpose}")
            return
        cell = _CURRENT_TIMERS[kind]
    if isinstance(cell, CannotHappen):
        _cannot_happen(run, f"timer {armed.purpose}", cell, t.fence.uid)
    else:
        cell(run, t.fence, purpose)


def _timer_survey(run: _Run, fence: Fence, p: SurveyTimer) -> None:
    _survey(run)


def _timer_retry(run: _Run, fence: Fence, p: RetryTimer) -> None:
    """The op again, for the VM's owner as long as it still owns it (a predecessor's remove too),
    carrying what the first one carried: the incarnation's spec (a create must not come back as a
    default VM) and, for a wake, the snapshot in the log (rule 10: never a blank VM)."""
    s = run.s
    rec = s.vms.get(p.vm_id)
    if rec is not None and rec.fence == fence and (p.op not in _RETRY_WHILE_CURRENT or s.is_current(fence)):
        cur = _cur_of(s, fence)
        spec = cur.spec if cur is not None and p.op in _CARRIES_SPEC else None
        snapshot = cur.snapshot if cur is not None and p.op in _CARRIES_SNAPSHOT else None
        _command(run, p.op, rec.fence, rec.host, p.vm_id, spec, snapshot)


def _timer_place(run: _Run, fence: Fence, p: PlaceTimer) -> None:
    _bring_up(run)


def _timer_restart(run: _Run, fence: Fence, p: RestartTimer) -> None:
    """The backoff is over: start the VM in place, unless it changed or a delete began."""
    cur, rec = run.s.cur, run.s.vms.get(p.vm_id)
    if cur is not None and rec is not None and cur.vm_id == p.vm_id and not cur.deleting:
        _command(run, "start", cur.fence, rec.host, p.vm_id, cur.spec)


def _timer_adopt(run: _Run, fence: Fence, p: AdoptTimer) -> None:
    """Inspect again before adopting (rule 8)."""
    cur, rec = run.s.cur, run.s.vms.get(p.vm_id)
    if cur is not None and rec is not None and not cur.deleting:
        _command(run, "adopt", cur.fence, rec.host, p.vm_id, cur.spec)


def _timer_rewrite(run: _Run, fence: Fence, p: RewriteTimer) -> None:
    """Finds the cell of ``_REWRITES`` for the write's verb."""
    cur = run.s.cur
    assert cur is not None  # a current-incarnation timer: _on_timer checked it
    cell = _REWRITES[p.verb]
    if isinstance(cell, CannotHappen):
        _cannot_happen(run, f"timer {purpose_text(p)}", cell, cur.fence.uid)
    else:
        cell(run, cur)


def _rewrite_status(run: _Run, cur: Incarnation) -> None:
    write = KubeWrite(run.effect_id("status"), "status", cur.fence, status=status_of(cur))
    run.add(WriteRequested(write))


def _rewrite_delete(run: _Run, cur: Incarnation) -> None:
    _finish_delete(run, cur)


def _rewrite_bind(run: _Run, cur: Incarnation) -> None:
    """A binding that failed for no named reason: place and bind again, unless the pod got its node
    meanwhile (a scheduler's binding observed) or needs none any more."""
    _bring_up(run)


def _rewrite_evict(run: _Run, cur: Incarnation) -> None:
    """Only while the eviction is still wanted: no delete claim came meanwhile (rule 7)."""
    if cur.evicting and not cur.delete_claim:
        run.add(WriteRequested(KubeWrite(run.effect_id("evict"), "evict", cur.fence, message="VM gone")))


# ------------------------------------------------------------------- hibernation (rule 10)


def _hibernate(run: _Run, cur: Incarnation) -> None:
    rec = run.s.vms.get(cur.vm_id or "")
    if rec is None or rec.state != "running" or not cur.bound or cur.deleting:
        return
    _command(run, "hibernate", cur.fence, rec.host, rec.vm_id, cur.spec)


def _wake(run: _Run, cur: Incarnation) -> None:
    """Waking restores from the snapshot in the log — never a blank VM."""
    s = run.s
    if not cur.hibernated or cur.snapshot is None or cur.deleting or cur.spec.hibernate or s.rebuilding:
        return
    if any(rec for rec in s.vms.values()):
        return
    if cur.vm_id is not None or _place_pending(s, cur.fence):
        return
    if _verify_first(run):
        return
    host = cur.snapshot_host or _place(run.env, cur.spec)[0]
    if host is None:
        _arm(run, cur.fence, PlaceTimer(), PLACE_RETRY_S)
        return
    # a restored VM is a new VM instance: it gets a new name, names are never reused
    vm_id = _vm_name(s.key, cur.fence.uid, cur.gen + 1)
    run.add(Placed(cur.fence, vm_id, host))
    cmd = Command(
        id=run.effect_id(cur.fence.uid, cur.fence.epoch, "wake", vm_id),
        op="wake",
        fence=cur.fence,
        host=host,
        vm_id=vm_id,
        spec=cur.spec,
        snapshot=cur.snapshot,
    )
    run.add(Commanded(cmd))


# ------------------------------------------------------------------------------ helpers


def _command(
    run: _Run, op: CommandOp, fence: Fence, host: str, vm_id: str, spec: Spec | None,
    snapshot: str | None = None,
) -> None:
    cmd = Command(
        # agents dedupe by id across all keys: the uid makes it global (the key stands in for a
        # survey, which belongs to no incarnation)
        id=run.effect_id(fence.uid or fence.key, fence.epoch, op, vm_id),
        op=op,
        fence=fence,
        host=host,
        vm_id=vm_id,
        spec=spec or Spec(),
        snapshot=snapshot,
    )
    run.add(Commanded(cmd))


# what a command re-sent by a RetryTimer carries from the incarnation, by op (as the first one did)
_CARRIES_SPEC: frozenset[CommandOp] = frozenset({"create", "start", "wake", "hibernate", "adopt"})
_CARRIES_SNAPSHOT: frozenset[CommandOp] = frozenset({"wake"})
# ops a RetryTimer re-sends only while their fence is current (an inspect checks a binding)
_RETRY_WHILE_CURRENT: frozenset[CommandOp] = frozenset({"inspect"})


def _cur_of(s: KeyState, fence: Fence) -> Incarnation | None:
    """The current incarnation if ``fence`` is its fence."""
    return s.cur if s.cur is not None and s.cur.fence == fence else None


def _arm(run: _Run, fence: Fence, purpose: TimerPurpose, delay_s: float) -> None:
    """Timers only ever re-check (rule 12); the purpose is stored, and named in the id, as text."""
    text = purpose_text(purpose)
    run.add(TimerArmed(fence, run.effect_id("timer", text), delay_s, text))


def _place_pending(s: KeyState, fence: Fence) -> bool:
    return any(
        isinstance(e, TimerArmed) and e.fence == fence and isinstance(e.timer, PlaceTimer)
        for e in s.outbox.values()
    )


def _event(
    run: _Run, fence: Fence, reason: EventReason, message: str, *, warning: bool = False, count: int = 1
) -> None:
    write = KubeWrite(
        run.effect_id("event"),
        "event",
        fence,
        event_reason=reason,
        event_type="Warning" if warning else "Normal",
        message=message,
        count=count,
    )
    run.add(WriteRequested(write))


def status_of(cur: Incarnation) -> PodStatusIntent:
    """The status a pod (or VirtualMachine) should show, derived from its incarnation."""
    reason: StatusReason | None = None
    if cur.invalid is not None:
        reason = "InvalidSpec"
    elif cur.hibernated:
        reason = "Hibernated"
    return PodStatusIntent(
        phase=cur.phase,
        ready=cur.ready and cur.bound,
        reason=reason,
        message=cur.invalid,
        vm_id=cur.vm_id if (cur.bound or cur.hibernated) else None,
        host=cur.host if cur.bound else None,
        ip=cur.ip if cur.bound else None,
        vnc_port=cur.vnc_port if cur.bound else None,
        restart_count=cur.restart_count,
        hibernated=cur.hibernated,
        invalid=cur.invalid,
    )


def _sync_status(run: _Run) -> None:
    cur = run.s.cur
    if cur is None or cur.delete_claim:
        return
    if cur.phase == "Pending" and not cur.invalid and not cur.hibernated:
        if not _place_pending(run.s, cur.fence):
            return  # nothing worth writing until the VM is up
        # the VM waits for a place: say why on the pod instead of leaving it silent — the last
        # bring-up's real cause while it backs off, else no live host fits
        reason: StatusReason = "FailedCreate" if cur.failures else "Unschedulable"
        message = (cur.failure or "the last bring-up failed") if cur.failures else \
            (cur.unplaced or "no live vmfence host has room for this VM")
        want = msgspec.structs.replace(status_of(cur), reason=reason, message=message)
    else:
        want = status_of(cur)
    if cur.status == want:
        return
    run.add(WriteRequested(KubeWrite(run.effect_id("status"), "status", cur.fence, status=want)))


# ------------------------------------------------------------------------ the policy tables
#
# Every cell of every table is a rule or a named CannotHappen; tests/unit/test_policy_table.py checks
# that each product is covered and that the reading guide above shows these cells.


class CannotHappen(msgspec.Struct, frozen=True):
    """A cell no input reaches, and why. Should one fire after all, it is logged as
    ``Skipped(cannot_happen)`` naming the cell (counted by the audit and the reconciler's
    ``vmfence_pod_lifecycle_total{reason="cannot_happen"}``) and nothing else is done."""

    why: str


def _cannot_happen(run: _Run, cell: str, c: CannotHappen, uid: str | None) -> None:
    run.add(Skipped("cannot_happen", uid or None, f"{cell}: {c.why}"))


InputRule = Callable[[_Run, Any], None]  # each takes its own input type: the key is that type
ResultRule = Callable[[_Run, _Answer], None]
TimerRule = Callable[[_Run, Fence, Any], None]  # each takes its own purpose type
WriteRule = Callable[[_Run, Incarnation, KubeWrite], None]

_INPUTS: dict[type, InputRule] = {
    Observed: _on_observed,
    ConfirmedRead: _on_confirmed,
    CommandResult: _on_result,
    VMExited: _on_exited,
    VMGone: _on_gone,
    ProbeChanged: _on_probe,
    Inventoried: _on_inventory,
    WriteDone: _on_write_done,
    TimerFired: _on_timer,
}



def _row(
    ok: ResultRule | CannotHappen,
    failed: ResultRule | CannotHappen,
    fenced: ResultRule | CannotHappen,
    not_found: ResultRule | CannotHappen,
    inconclusive: ResultRule | CannotHappen,
) -> dict[ResultOutcome, ResultRule | CannotHappen]:
    return {"ok": ok, "failed": failed, "fenced": fenced, "not_found": not_found, "inconclusive": inconclusive}


# the op is the command's as the log holds it, never the answer's own claim
_RESULTS: dict[CommandOp, dict[ResultOutcome, ResultRule | CannotHappen]] = {
    #                ok           failed             fenced   not_found          inconclusive
    "create": _row(_up_ok, _up_failed, _fenced, _up_failed, _retry),
    "start": _row(_up_ok, _up_failed, _fenced, _up_failed, _retry),
    "wake": _row(_up_ok, _up_failed, _fenced, _up_failed, _retry),
    "remove": _row(_removed, _retry, _fenced, _removed, _retry),
    "hibernate": _row(_hibernated, _hibernate_failed, _fenced, _hibernate_failed, _retry),
    "adopt": _row(_adopted, _adopt_lost, _fenced, _adopt_lost, _adopt_again),
    "survey": _row(_surveyed, _resurvey, _fenced, _resurvey, _resurvey),
    "inspect": _row(_inspected, _retry, _fenced, _inspect_gone, _retry),
}

_WRITES: dict[WriteOutcome, WriteRule] = {
    "ok": _written,
    "superseded": _write_superseded,
    "gone": _write_gone,
    "failed": _write_failed,
}

# timers for the key or a VM's owner, whichever incarnation is current
_KEY_TIMERS: dict[type, TimerRule | CannotHappen] = {
    SurveyTimer: _timer_survey,
    RetryTimer: _timer_retry,
    UnknownTimer: CannotHappen("every purpose decide arms is one of the typed ones"),
}
# timers of the current incarnation only: any other fence's is Skipped(superseded | stale_effect)
_CURRENT_TIMERS: dict[type, TimerRule | CannotHappen] = {
    PlaceTimer: _timer_place,
    RestartTimer: _timer_restart,
    AdoptTimer: _timer_adopt,
    RewriteTimer: _timer_rewrite,
}

_REWRITES: dict[WriteVerb, Callable[[_Run, Incarnation], None] | CannotHappen] = {
    "status": _rewrite_status,
    "delete": _rewrite_delete,
    "evict": _rewrite_evict,
    "bind": _rewrite_bind,
    "event": CannotHappen("events are fire-and-forget: never in the outbox, so never answered"),
}
