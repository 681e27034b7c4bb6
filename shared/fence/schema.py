"""Every message and record vmfence puts on the bus or in the log, as msgspec tagged unions.

Three families travel: *inputs* (on VMFENCE_IN: observations, agent reports, effect outcomes,
timer firings), *log entries* (on VMFENCE_LOG: the decisions one input produced) and *commands*
(on VMFENCE_CMD: work for one host's agent). Each carries ``v``, the schema version, so a reader
can refuse what it does not understand instead of misreading it.
"""

from __future__ import annotations

import hashlib
from typing import Literal, get_args

import msgspec

SCHEMA_VERSION = 1

# The named bound of an epoch (+1 per new incarnation of a key, +1 per rebuild). Every reader must
# hold one exactly: the agent's SQLite ledger (a signed 64-bit INTEGER: 2**64 - 1 overflowed it and
# wedged the key), JSON readers that hold numbers as doubles (exact only to 2**53: jq, dashboards,
# the ``vmfence.io/epoch`` annotation read back by tools) and the +1 of the next admission. At a
# thousand recreations of one key every second, 2**53 lasts 285,000 years: no real log gets near it,
# so a fence above it is hostile or corrupt and is never evidence of anything.
MAX_EPOCH = 2**53 - 1
# How far above its log's epoch an agent's fence of a key may be and still prove that the log lost
# entries (decide.cut_evidence). A lost tail is what was appended since the stream's last durable
# point (seconds with R3 and ``sync_interval: always``); each epoch in it is a recreation of that one
# key (or a rebuild), so a real cut spans a handful. A report further ahead is not believed: it is
# ``Skipped(epoch_out_of_bounds)``, never a rebuild, a survey or a re-adoption at its epoch.
MAX_EPOCH_LEAP = 64

# Size bounds, in bytes of a message's JSON. nats-server refuses any message above its max_payload
# (1 MiB in deploy/nats), at every attempt: an input, entry or command that large would be retried
# forever. Each bound is well below it, and what happens above it is designed:
MAX_INPUT_BYTES = 64 * 1024  # one input on VMFENCE_IN: above it, dead-lettered (a truncated copy)
MAX_OBJECT_BYTES = 16 * 1024  # an observation or consistent read: above it, decided as an invalid
#   spec (the object gets a Warning Event and the SpecValid=False condition; its VM keeps its spec)
MAX_ENTRY_BYTES = 512 * 1024  # one log entry (every decision of one input): above it, the input is
#   dead-lettered with its reason and the key goes on
MAX_COMMAND_BYTES = 64 * 1024  # one command: above it, never sent; it ends as a failed result

RestartPolicy = Literal["Always", "OnFailure", "Never"]
RecreatePolicy = Literal["replace", "adopt"]
Phase = Literal["Pending", "Running", "Succeeded", "Failed"]


class Fence(msgspec.Struct, frozen=True, array_like=True):
    """The identity every effect carries: which incarnation, under which epoch."""

    key: str
    uid: str
    epoch: int

    def older_than(self, other: Fence) -> bool:
        return self.epoch < other.epoch


ProbeKind = Literal["tcp", "http"]


class Probe(msgspec.Struct, frozen=True, omit_defaults=True):
    """A readiness or liveness probe from the pod's own ``readinessProbe``/``livenessProbe``
    (``tcpSocket`` or ``httpGet``), with Kubernetes' timing fields and defaults, in seconds."""

    kind: ProbeKind
    port: int
    path: str = "/"  # httpGet only
    scheme: Literal["HTTP", "HTTPS"] = "HTTP"  # httpGet only
    initial_delay_s: int = 0
    period_s: int = 10
    timeout_s: int = 1
    success_threshold: int = 1
    failure_threshold: int = 3


class Spec(msgspec.Struct, frozen=True, omit_defaults=True):
    """What the user asked for, already validated (see shared.fence.podspec). Fields added after
    version 1 all have defaults, so every entry ever logged still decodes (omitted = default)."""

    cpus: int = 1
    memory_mib: int = 128
    image: str | None = None
    restart_policy: RestartPolicy = "Always"
    hibernate: bool = False
    on_recreate: RecreatePolicy = "replace"
    probe_port: int | None = None
    host_selector: str | None = None
    # a pod's ``spec.nodeName`` (``vmfence-<host>``) once bound, by a scheduler or by vmfence's own
    # binding: the law of its placement — its VM runs on that host or nowhere (decide.bringup._place)
    node: str | None = None
    readiness: Probe | None = None
    liveness: Probe | None = None
    # parts of the pod vmfence reads but does not carry out (an exec probe): a Warning Event says so
    unsupported: str | None = None


# --------------------------------------------------------------------------------------- inputs


class Observed(msgspec.Struct, tag="observed", frozen=True, omit_defaults=True):
    """The watcher saw the object (watch event or list item) — possibly from a lagging cache."""

    key: str
    uid: str
    resource_version: int
    deleting: bool = False
    gone: bool = False  # a DELETED watch event
    spec: Spec = Spec()
    invalid: str | None = None  # why the annotations/spec were rejected, if they were
    node: str | None = None
    v: int = SCHEMA_VERSION


class ConfirmedRead(msgspec.Struct, tag="confirmed", frozen=True, omit_defaults=True):
    """A consistent read (GET without resourceVersion) of the key: the only source that may
    supersede an incarnation."""

    key: str
    request: str
    uid: str | None  # None: the object does not exist
    resource_version: int = 0
    deleting: bool = False
    spec: Spec = Spec()
    invalid: str | None = None
    v: int = SCHEMA_VERSION


# ``Inventoried.state`` of a VM a host's complete inventory round lacked (the reconciler compares a
# round with what the log binds on that host): evidence for an inspect, never proof (rules 8, 12)
ABSENT = "absent"


class Inventoried(msgspec.Struct, tag="inventory", frozen=True, omit_defaults=True):
    """One VM an agent has, with the fence that owns it in the agent's ledger (or, with ``state``
    ``ABSENT``, one the host's inventory round ``round`` lacked)."""

    fence: Fence
    host: str
    vm_id: str
    state: str
    round: str = ""
    ready: bool | None = None  # the host's last probe of it under ``fence`` (None: not probed)
    v: int = SCHEMA_VERSION


ResultOutcome = Literal["ok", "failed", "fenced", "not_found", "inconclusive"]
WriteOutcome = Literal["ok", "superseded", "gone", "failed"]  # rule 6's vocabulary


class CommandResult(msgspec.Struct, tag="result", frozen=True, omit_defaults=True):
    """An agent's answer to one command, stored in its ledger by command id."""

    fence: Fence
    command_id: str
    op: str
    host: str
    vm_id: str
    outcome: ResultOutcome
    error: str | None = None
    ip: str | None = None
    vnc_port: int | None = None
    snapshot: str | None = None
    found: list[Inventoried] = []  # a survey's answer: every VM of the key on this host
    # the newest epoch of the key the answering host has seen (its key mark). Above every epoch
    # the key's log knows, it proves the log lost entries (a cut no reconciler saw).
    key_epoch: int = 0
    # the incarnation that epoch belongs to on this host ("": not known). Epochs are assigned once,
    # so a uid here other than the one the log gave ``key_epoch`` also proves lost entries.
    key_uid: str = ""
    # > 0: not run, because a writer of this partition generation verified the host since the
    # command's writer sent it (PartitionVerify). For the shell, never for decide: the writer of
    # that generation sends its own copy of every command of its outbox (under a Msg-Id of its own)
    floor: int = 0
    # a bring-up's run-state probe, decided with its binding; None: not probed (Prober.first_readiness)
    ready: bool | None = None
    v: int = SCHEMA_VERSION


class VMExited(msgspec.Struct, tag="vm_exited", frozen=True, omit_defaults=True):
    fence: Fence
    host: str
    vm_id: str
    exit_code: int | None = None
    v: int = SCHEMA_VERSION


class VMGone(msgspec.Struct, tag="vm_gone", frozen=True, omit_defaults=True):
    """The runtime no longer knows the VM."""

    fence: Fence
    host: str
    vm_id: str
    v: int = SCHEMA_VERSION


class ProbeChanged(msgspec.Struct, tag="probe", frozen=True, omit_defaults=True):
    fence: Fence
    host: str
    vm_id: str
    ready: bool
    v: int = SCHEMA_VERSION


class WriteDone(msgspec.Struct, tag="write_done", frozen=True, omit_defaults=True):
    """Outcome of one Kubernetes write the reconciler made for a decision (rule 6 vocabulary)."""

    fence: Fence
    write_id: str
    outcome: WriteOutcome
    detail: str | None = None
    # a binding's answer: the node the pod is bound to now (the write's own on ok; another
    # binder's when the pod was bound first — the pod's nodeName is law, never a VM elsewhere)
    node: str | None = None
    # a failure because the API server did not answer (a transport error, a timeout, 429 or 5xx
    # after the gateway's own retries): the reconciler writes again early once it answers. decide
    # reads nothing of it
    unanswered: bool = False
    v: int = SCHEMA_VERSION


class TimerFired(msgspec.Struct, tag="timer", frozen=True, omit_defaults=True):
    """A timer armed by a decision came due. Timers only ever trigger re-checks (rule 12)."""

    fence: Fence
    timer_id: str
    v: int = SCHEMA_VERSION


Input = (
    Observed
    | ConfirmedRead
    | CommandResult
    | VMExited
    | VMGone
    | ProbeChanged
    | Inventoried
    | WriteDone
    | TimerFired
)

# ------------------------------------------------------------------------------------- commands

CommandOp = Literal["create", "start", "remove", "hibernate", "wake", "adopt", "inspect", "survey"]
SURVEY_VM_ID = "survey"  # a survey names no VM: it asks a host for every VM of the command's key
# the owner of an epoch the log gave to no incarnation (a Rebuilt with none current): an agent's key
# mark holds it after a survey under such an epoch (fence uid ""), so no command at that epoch is let
# through — only a log that lost entries can have given that epoch to a uid
NO_INCARNATION = "-"


class Command(msgspec.Struct, frozen=True, omit_defaults=True):
    """Work for one host. ``id`` is deterministic so a redelivery is answered from the ledger."""

    id: str
    op: CommandOp
    fence: Fence
    host: str
    vm_id: str
    spec: Spec = Spec()
    snapshot: str | None = None
    # the lease generation of the writer that sent it (stamped by the shell at send time, never by
    # decide): a host refuses what a partition's older writer sent once a newer one verified it
    # (PartitionVerify). 0: unstamped (below every floor but a host's first)
    gen: int = 0
    v: int = SCHEMA_VERSION


# The named bound of a lease generation (a KV revision): as MAX_EPOCH, exact in every reader.
MAX_GEN = 2**53 - 1
H_KIND = "Vmfence-Kind"  # header on the command subject: "verify" for a PartitionVerify
VERIFY_KIND = "verify"


class PartitionVerify(msgspec.Struct, frozen=True, omit_defaults=True):
    """A partition's writer, once per lease and per host (and again when a host joins), asks one
    host, on that host's command stream behind whatever an earlier writer sent it: raise the
    partition's floor to ``gen`` -- nothing sent under an older generation may make, wake,
    hibernate, adopt or look at a VM here afterwards -- and name every key of the partition the
    host has a VM of. With every live host's answer in, a key the writer meets for the first time
    and no host named cannot have a VM or a command of a lost log tail anywhere that is still
    live: it makes its first VM without a survey of its own (KeyState.unverified stays False)."""

    partition: int
    gen: int
    host: str
    writer: str
    v: int = SCHEMA_VERSION


class PartitionVerified(msgspec.Struct, frozen=True, omit_defaults=True):
    """A host's answer to PartitionVerify, on ``Subjects.host_partition_report``: its floor after
    the raise (above ``gen``: a later writer verified first) and the keys of the partition with a
    VM here. ``truncated``: more keys than one message carries -- the host is not verified by it."""

    partition: int
    gen: int
    floor: int
    host: str
    keys: list[str] = []
    truncated: bool = False
    v: int = SCHEMA_VERSION


# --------------------------------------------------------------------------------- k8s writes


# why a pod is not simply Running/Pending (the container status reason vmfence writes)
# (FailedCreate: the last bring-up failed and the next waits out its backoff; the message is the cause)
StatusReason = Literal["InvalidSpec", "Hibernated", "Unschedulable", "FailedCreate"]
# (Unschedulable: no live host fits, or the host the pod is bound to is dead, unknown or full)
# the reason of every Kubernetes Event decide writes
EventReason = Literal[
    "InvalidSpec", "Superseded", "Hibernated", "Started", "FailedCreate", "Adopted", "BackOff", "VMGone",
    "Scheduled",  # vmfence bound an unscheduled pod to a host (pods/binding), as a scheduler says it
    "FailedPlacement",  # the pod's node (or a VirtualMachine's host selector) is dead, unknown or full
    "Unsupported",  # a part of the pod vmfence does not carry out (an exec probe)
]


class PodStatusIntent(msgspec.Struct, frozen=True, omit_defaults=True):
    """The status (and runtime annotations) vmfence wants the object to have. Recorded in the log
    *before* it is written, and re-applied to a fresh object on a resourceVersion conflict."""

    phase: Phase
    ready: bool = False
    reason: StatusReason | None = None
    message: str | None = None
    vm_id: str | None = None
    host: str | None = None
    ip: str | None = None
    vnc_port: int | None = None
    restart_count: int = 0
    hibernated: bool = False
    invalid: str | None = None


WriteVerb = Literal["status", "evict", "delete", "event", "bind"]  # bind: pods/binding to ``node``


class KubeWrite(msgspec.Struct, frozen=True, omit_defaults=True):
    """One Kubernetes write; every one carries the incarnation's uid as its precondition."""

    id: str
    verb: WriteVerb
    fence: Fence
    status: PodStatusIntent | None = None
    event_reason: EventReason | None = None
    event_type: Literal["Normal", "Warning"] = "Normal"
    message: str | None = None
    count: int = 1  # an event: which repeat of the same text (one Event counts them, as Kubernetes does)
    node: str | None = None  # a bind: the node (vmfence-<host>) the pod is bound to


# ------------------------------------------------------------------------------------ decisions

# The closed vocabularies of the log. Decoding refuses a value outside them, so each lists every
# value any writer ever logged (also those no longer produced: exported logs must still replay).
SkipReason = Literal[
    "superseded",  # an input for a tombstoned uid (rule 3)
    "stale_effect",  # work reported for a fence that is no longer current (rule 4)
    "stale_read",  # an absent answer to a read asked before the current admission
    "superseded_write",  # a uid-carrying write hit another incarnation (rule 6)
    "delete_in_flight",  # a second delete while one is claimed (rule 5)
    "fenced",  # the agent refused a command (its fence is older than the VM's owner)
    "no_host",  # nothing fits; a place timer re-checks
    "hibernate_failed",  # the VM stays bound (or is removed if its fence ended)
    "orphan",  # a VM no live incarnation owns: removed
    "cannot_happen",  # a policy cell decide/tables.py names impossible fired after all (a bug: look)
    "invalid_spec",  # older writers only: a rejected spec change (now SpecChanged(invalid))
    "epoch_out_of_bounds",  # a report's fence above MAX_EPOCH, below 0, or far above the log's epoch
    "wrong_host",  # a report about a VM from a host other than the one the log placed it on
    # a force-deleted predecessor's VM still being removed on a host that is not live (detail: its
    # vm_id): the successor starts on a live host meanwhile — the operator's force delete is the
    # confirmation, as for a kubelet whose node is down; the remove stays queued for that host
    "stranded",
]
ReleaseReason = Literal[
    "removed", "gone", "lost", "fenced", "create_failed", "start_failed", "wake_failed"
]
FailReason = Literal["InvalidSpec", "VMExited"]
# how an effect ended: an agent's or a write's outcome, a consistent read's answer, a timer firing,
# or a deferred eviction that the delete it waited for resolved
DoneOutcome = Literal[ResultOutcome, WriteOutcome, "confirmed", "absent", "fired", "resolved_by_delete"]



class ConfirmRequested(msgspec.Struct, tag="confirm_requested", frozen=True):
    request: str
    seen_uid: str
    at: int = 0  # the log position that asked: an answer never outranks a later admission


class Admitted(msgspec.Struct, tag="admitted", frozen=True):
    fence: Fence
    spec: Spec
    invalid: str | None = None
    resource_version: int = 0


class Superseded(msgspec.Struct, tag="superseded", frozen=True):
    """The old incarnation is tombstoned; nothing for it is ever applied again."""

    fence: Fence
    by_uid: str | None  # None: the object is gone


class Placed(msgspec.Struct, tag="placed", frozen=True):
    fence: Fence
    vm_id: str
    host: str


class Commanded(msgspec.Struct, tag="commanded", frozen=True):
    command: Command


class Bound(msgspec.Struct, tag="bound", frozen=True):
    fence: Fence
    vm_id: str
    host: str
    command_id: str
    ip: str | None = None
    vnc_port: int | None = None


class Adopted(msgspec.Struct, tag="adopted", frozen=True):
    """The agent confirmed the VM exists and moved its ownership to ``fence`` (rule 8)."""

    fence: Fence
    vm_id: str
    host: str
    command_id: str


class Discovered(msgspec.Struct, tag="discovered", frozen=True):
    """An agent reported a VM this log did not know (a lost tail, a crash before the log caught
    up): it is recorded under the fence that owns it at the agent, then adopted or removed."""

    fence: Fence
    vm_id: str
    host: str


class Released(msgspec.Struct, tag="released", frozen=True):
    """A VM is no longer anyone's: removed, lost, or hibernated away."""

    fence: Fence
    vm_id: str
    host: str
    reason: ReleaseReason
    command_id: str | None = None


class DeleteClaimed(msgspec.Struct, tag="delete_claimed", frozen=True):
    fence: Fence


class EvictionRequested(msgspec.Struct, tag="eviction_requested", frozen=True):
    fence: Fence
    vm_id: str


class EvictionDeferred(msgspec.Struct, tag="eviction_deferred", frozen=True):
    fence: Fence
    vm_id: str


class WriteRequested(msgspec.Struct, tag="write_requested", frozen=True):
    write: KubeWrite


class Hibernated(msgspec.Struct, tag="hibernated", frozen=True):
    fence: Fence
    vm_id: str
    host: str
    snapshot: str


class Restarting(msgspec.Struct, tag="restarting", frozen=True):
    fence: Fence
    vm_id: str
    restart_count: int
    backoff_s: float


class BringUpFailed(msgspec.Struct, tag="bring_up_failed", frozen=True):
    """The ``failures``-th bring-up in a row of the incarnation failed (a create, start or wake
    answered failed or not_found) for ``cause``: the next is placed after ``backoff_s``."""

    fence: Fence
    vm_id: str
    failures: int
    backoff_s: float
    cause: str
    repeats: int = 1  # failures in a row with this same cause: the count of its Event


class Failed(msgspec.Struct, tag="failed", frozen=True):
    fence: Fence
    reason: FailReason
    message: str = ""


class Succeeded(msgspec.Struct, tag="succeeded", frozen=True):
    fence: Fence


class ReadyChanged(msgspec.Struct, tag="ready_changed", frozen=True):
    fence: Fence
    ready: bool


class SpecChanged(msgspec.Struct, tag="spec_changed", frozen=True):
    fence: Fence
    spec: Spec
    resource_version: int
    invalid: str | None = None  # a change that was rejected: the spec stays, the condition shows why


class PlaceTimer(msgspec.Struct, frozen=True):
    """Place the current incarnation's VM again (no host fitted, or a bring-up failed)."""


class SurveyTimer(msgspec.Struct, frozen=True):
    """Survey every host again (none was live, or a survey failed)."""


class RestartTimer(msgspec.Struct, frozen=True):
    """A restart's backoff is over: start the exited VM again (rule 7)."""

    vm_id: str


class AdoptTimer(msgspec.Struct, frozen=True):
    """An adopt's inspect was inconclusive: ask again, never trust it (rule 8)."""

    vm_id: str


class RetryTimer(msgspec.Struct, frozen=True):
    """A command on the VM answered inconclusive (or a remove failed): send it again for its owner."""

    op: CommandOp
    vm_id: str


class RewriteTimer(msgspec.Struct, frozen=True):
    """A Kubernetes write failed for no reason rule 6 names: write it again."""

    verb: WriteVerb


class UnknownTimer(msgspec.Struct, frozen=True):
    """A stored purpose this version cannot read (no writer arms one): kept, never acted on."""

    text: str


TimerPurpose = PlaceTimer | SurveyTimer | RestartTimer | AdoptTimer | RetryTimer | RewriteTimer | UnknownTimer

# str -> the Literal member it spells: how a stored string becomes typed without a cast
_OPS: dict[str, CommandOp] = {op: op for op in get_args(CommandOp)}
_VERBS: dict[str, WriteVerb] = {verb: verb for verb in get_args(WriteVerb)}


_PLACE, _SURVEY = PlaceTimer(), SurveyTimer()  # the commonest purposes, read on every input


def purpose_text(p: TimerPurpose) -> str:
    """The stored form of a purpose (``TimerArmed.purpose``, and part of the timer's id)."""
    match p:
        case PlaceTimer():
            return "place"
        case SurveyTimer():
            return "survey"
        case RestartTimer(vm_id=vm_id):
            return f"restart/{vm_id}"
        case AdoptTimer(vm_id=vm_id):
            return f"adopt/{vm_id}"
        case RetryTimer(op=op, vm_id=vm_id):
            return f"retry/{op}/{vm_id}"
        case RewriteTimer(verb=verb):
            return f"rewrite/{verb}"
        case UnknownTimer(text=text):
            return text


def parse_purpose(text: str) -> TimerPurpose:
    """The one place a stored purpose string is read: every log ever written keeps the string form,
    so old entries decode unchanged. Total: what it cannot read is an ``UnknownTimer``."""
    if text == "place":
        return _PLACE
    if text == "survey":
        return _SURVEY
    kind, _, rest = text.partition("/")
    if rest:
        if kind == "restart":
            return RestartTimer(rest)
        if kind == "adopt":
            return AdoptTimer(rest)
        if kind == "rewrite" and (verb := _VERBS.get(rest)) is not None:
            return RewriteTimer(verb)
        name, _, vm_id = rest.partition("/")
        if kind == "retry" and (op := _OPS.get(name)) is not None and vm_id:
            return RetryTimer(op, vm_id)
    return UnknownTimer(text)


class TimerArmed(msgspec.Struct, tag="timer_armed", frozen=True):
    """A re-check due after ``delay_s``. ``purpose`` is the stored string form (see purpose_text);
    code reads the typed ``timer``."""

    fence: Fence
    timer_id: str
    delay_s: float
    purpose: str

    @property
    def timer(self) -> TimerPurpose:
        return parse_purpose(self.purpose)


class Done(msgspec.Struct, tag="done", frozen=True):
    """An effect (command, write, confirm, timer) is finished and leaves the outbox."""

    effect_id: str
    outcome: DoneOutcome


class Forgotten(msgspec.Struct, tag="forgotten", frozen=True):
    """The incarnation ended (object gone, its VMs released): the key is idle."""

    fence: Fence


class Skipped(msgspec.Struct, tag="skipped", frozen=True):
    """An input that was not applied, logged because an auditor needs to see it."""

    reason: SkipReason
    uid: str | None = None
    detail: str = ""


class Rebuilt(msgspec.Struct, tag="rebuilt", frozen=True):
    """The log was found behind what its writer had seen (a lost tail): the state is re-derived
    from what the log still holds, Kubernetes and agent inventories. ``epoch_floor`` is the highest
    epoch the writer knew, so no new incarnation ever reuses an epoch an agent may still hold."""

    reason: str
    epoch_floor: int = 0


Decision = (
    ConfirmRequested
    | Admitted
    | Superseded
    | Placed
    | Commanded
    | Bound
    | Adopted
    | Discovered
    | Released
    | DeleteClaimed
    | EvictionRequested
    | EvictionDeferred
    | WriteRequested
    | Hibernated
    | Restarting
    | BringUpFailed
    | Failed
    | Succeeded
    | ReadyChanged
    | SpecChanged
    | TimerArmed
    | Done
    | Forgotten
    | Skipped
    | Rebuilt
)


class LogEntry(msgspec.Struct, frozen=True, omit_defaults=True):
    """One append to a key's log: everything one input decided, atomically.

    ``n`` counts entries of this key from 1 with no gap; the Msg-Id is ``<key>#<n>@<writer>:<digest>`` (see
    entry_msg_id) so a benign retry of the same append is recognised.
    """

    key: str
    n: int
    decisions: list[Decision]
    input: str = ""  # short description of the input that caused it (kind and id)
    writer: str = ""  # the appending reconciler's identity
    at: float = 0.0  # the writer's wall-clock time (seconds since the epoch): informational, no rule reads it
    v: int = SCHEMA_VERSION


# ------------------------------------------------------------------------------------ encoders

_json_encoder = msgspec.json.Encoder()
_input_decoder = msgspec.json.Decoder(Input)
_entry_decoder = msgspec.json.Decoder(LogEntry)
_command_decoder = msgspec.json.Decoder(Command)
_verify_decoder = msgspec.json.Decoder(PartitionVerify)
_verified_decoder = msgspec.json.Decoder(PartitionVerified)


def encode(obj: msgspec.Struct) -> bytes:
    return _json_encoder.encode(obj)


class UnknownVersion(ValueError):
    """A message of a schema version this reader does not know: refused, never misread."""


# the input versions this reader understands (a writer newer than the reader is refused, as the
# agent refuses a newer command: its fields may mean what this version cannot tell)
INPUT_VERSIONS = range(1, SCHEMA_VERSION + 1)


def decode_input(data: bytes) -> Input:
    """Decode one input; ``UnknownVersion`` for a ``v`` (its own or a survey find's) not in
    ``INPUT_VERSIONS``, msgspec's errors for anything else that is not an input."""
    inp = _input_decoder.decode(data)
    if inp.v not in INPUT_VERSIONS:
        raise UnknownVersion(f"{tag_of(inp)} of schema version {inp.v}; this reader reads "
                             f"{INPUT_VERSIONS.start}..{INPUT_VERSIONS.stop - 1}")
    if isinstance(inp, CommandResult):
        for item in inp.found:
            if item.v not in INPUT_VERSIONS:
                raise UnknownVersion(f"inventory item of schema version {item.v} in a result")
    return inp


def tag_of(obj: msgspec.Struct) -> str:
    """The tag a tagged struct (an input or a decision) travels under."""
    return str(type(obj).__struct_config__.tag)


def decode_entry(data: bytes) -> LogEntry:
    return _entry_decoder.decode(data)


def decode_command(data: bytes) -> Command:
    return _command_decoder.decode(data)


def decode_verify(data: bytes) -> PartitionVerify:
    """A PartitionVerify; ``UnknownVersion`` for a newer ``v``, msgspec's errors for anything else."""
    ask = _verify_decoder.decode(data)
    if ask.v not in INPUT_VERSIONS:
        raise UnknownVersion(f"partition verify of schema version {ask.v}")
    return ask


def decode_verified(data: bytes) -> PartitionVerified:
    """A PartitionVerified; ``UnknownVersion`` for a newer ``v``, msgspec's errors for anything else."""
    answer = _verified_decoder.decode(data)
    if answer.v not in INPUT_VERSIONS:
        raise UnknownVersion(f"partition verified of schema version {answer.v}")
    return answer


def entry_msg_id(key: str, n: int, writer: str, payload: bytes) -> str:
    """The Msg-Id of a key's n-th entry: a retry of the same append (same bytes) is recognised; a
    competing writer's entry, or a different entry at a position a lost tail freed, never is."""
    return f"{key}#{n}@{writer}:{hashlib.blake2b(payload, digest_size=8).hexdigest()}"


def decision_name(d: Decision) -> str:
    return type(d).__struct_config__.tag  # type: ignore[return-value]
