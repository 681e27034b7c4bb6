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
``-`` is a named CannotHappen). A create/start/wake that took is Bound if its fence is current (and
ReadyChanged with it when the answer carries the runtime probe's ``ready``), else
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

The package has one module per section of the policy: ``run`` (``_Run``, ``DecideEnv``, ``HostView``,
the named bounds and the helpers every rule uses), ``observations``, ``confirmation`` (rule 3),
``bringup`` (rule 2, placement), ``results``, ``deletes`` (rule 5), ``lifecycle`` (rule 7),
``inventory`` (rule 8, lost tails), ``writes`` (rule 6), ``timers`` (rule 12), ``hibernation``
(rule 10), and ``tables``: the tables above and the dispatch over them, ``decide`` itself. This
module re-exports the public names.
"""

from __future__ import annotations

from shared.fence.decide.bringup import NODE_PREFIX, node_of, placeable
from shared.fence.decide.inventory import agent_epoch, cut_evidence, epoch_out_of_bounds, rebuild
from shared.fence.decide.run import (
    CREATE_BACKOFF_BASE_S,
    CREATE_BACKOFF_MAX_S,
    EFFECT_RETRY_S,
    MAX_CAUSE_CHARS,
    PLACE_RETRY_MAX_S,
    PLACE_RETRY_S,
    RETRY_MAX_S,
    REWRITE_MAX_S,
    DecideEnv,
    HostView,
    create_backoff_s,
    doubling_s,
    place_retry_s,
    retry_backoff_s,
    rewrite_backoff_s,
    status_of,
    within_bounds,
)
from shared.fence.decide.tables import (
    _CURRENT_TIMERS,
    _INPUTS,
    _KEY_TIMERS,
    _RESULTS,
    _REWRITES,
    _WRITES,
    CannotHappen,
    InputRule,
    ResultRule,
    TimerRule,
    WriteRule,
    decide,
)

__all__ = [
    "CREATE_BACKOFF_BASE_S",
    "CREATE_BACKOFF_MAX_S",
    "EFFECT_RETRY_S",
    "MAX_CAUSE_CHARS",
    "NODE_PREFIX",
    "PLACE_RETRY_MAX_S",
    "PLACE_RETRY_S",
    "RETRY_MAX_S",
    "REWRITE_MAX_S",
    "_CURRENT_TIMERS",
    "_INPUTS",
    "_KEY_TIMERS",
    "_RESULTS",
    "_REWRITES",
    "_WRITES",
    "CannotHappen",
    "DecideEnv",
    "HostView",
    "InputRule",
    "ResultRule",
    "TimerRule",
    "WriteRule",
    "agent_epoch",
    "create_backoff_s",
    "cut_evidence",
    "decide",
    "doubling_s",
    "epoch_out_of_bounds",
    "node_of",
    "place_retry_s",
    "placeable",
    "rebuild",
    "retry_backoff_s",
    "rewrite_backoff_s",
    "status_of",
    "within_bounds",
]
