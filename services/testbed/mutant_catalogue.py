"""The catalogue of rule mutants: each takes one fence check out of the code.

A mutant is (file, an exact snippet of it that must occur exactly once, its replacement, the rule
the replacement removes, the fast tests that must fail without it). Run them with
``python -m services.testbed.mutants`` (``make mutants``); ``tests/unit/test_mutants_sample.py``
checks in CI that every snippet still occurs exactly once — a refactoring that moves or rewrites a
check turns into a failing test that points at the entry to rewrite, never into a mutant that
silently mutates nothing — and runs a few of them.

Why a catalogue and not mutmut or cosmic-ray: the question is "does every fence rule have a test
that fails without it", not "does every ``<`` have one". A generic tool mutates every operator of
these ~3 000 lines (thousands of mutants, hours on two cores, most in logging, status building and
docstrings-adjacent code) and leaves a person to sort equivalent from real survivors each run; the
catalogue names the checks the design cares about, each with its rule and its killing tests, runs
in minutes, and its equivalent mutants carry their argument in the code review, not in a tool's
cache. The cost — a check nobody listed is not mutated — is what the review of each new fence
check (and the exactly-once test) is for.

The entries for code that was being restructured while the catalogue was written —
``shared/fence/decide.py`` (as of 3eb5b24; since split into the package ``shared/fence/decide/``,
one module per section of the policy), ``services/agent/executor.py`` (c58fcde), the agent's
fence tables ``shared/fence/agentfence.py`` (808f2b5) and its op steps ``services/agent/ops``
(2328562) — were written last, against those commits; the exactly-once test says when they drift.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Mutant:
    id: str
    file: str
    original: str
    replacement: str
    rule: str
    tests: tuple[str, ...]
    equivalent: str = ""  # why the change alters no behaviour (argued; it is run all the same)


# the fast tests each group of mutants must be killed by (never tests/unit/test_mutants_sample.py:
# it runs this catalogue)
KERNEL = (
    "tests/unit/test_fence_regressions.py",
    "tests/unit/test_rules.py",
    "tests/unit/test_rule2_claim.py",
    "tests/unit/test_audit.py",
    "tests/unit/test_audit_rebuild.py",
    "tests/unit/test_properties.py",
)
APPEND = ("tests/bus/test_fenced_append.py",)
SCHEDULING = ("tests/unit/test_scheduling.py", *KERNEL)
KUBE = ("tests/kube/test_fence_regressions.py", "tests/kube/test_gateway.py", "tests/kube/test_status_last_seen.py")
LEDGER = ("tests/agent/test_ledger.py", "tests/agent/test_fence_regressions.py")
AGENT = (
    "tests/agent/test_fence_regressions.py",
    "tests/unit/test_agent_fence.py",
    "tests/agent/test_ledger.py",
    "tests/unit/test_agent_key_epoch.py",
    "tests/agent/test_agent.py",
)

STATE = "shared/fence/state.py"
APPEND_PY = "shared/bus/append.py"
KUBE_PY = "services/reconciler/kube.py"
LEDGER_PY = "services/agent/ledger.py"
PARTITION_PY = "services/reconciler/partition.py"
IMAGES_PY = "services/reconciler/images.py"
PROBES_PY = "services/agent/probes.py"
ENTRIES_PY = "services/reconciler/entries.py"
VERIFICATION_PY = "services/reconciler/verification.py"
# the policy package shared/fence/decide/: one constant per module a mutant names
DECIDE_BRINGUP = "shared/fence/decide/bringup.py"
DECIDE_CONFIRMATION = "shared/fence/decide/confirmation.py"
DECIDE_DELETES = "shared/fence/decide/deletes.py"
DECIDE_INVENTORY = "shared/fence/decide/inventory.py"
DECIDE_LIFECYCLE = "shared/fence/decide/lifecycle.py"
DECIDE_OBSERVATIONS = "shared/fence/decide/observations.py"
DECIDE_RESULTS = "shared/fence/decide/results.py"
DECIDE_TABLES = "shared/fence/decide/tables.py"
DECIDE_TIMERS = "shared/fence/decide/timers.py"
DECIDE_WRITES = "shared/fence/decide/writes.py"
EXECUTOR = "services/agent/executor.py"
AGENTFENCE = "shared/fence/agentfence.py"
BRINGUP = "services/agent/ops/bringup.py"
ADOPT = "services/agent/ops/adopt.py"
TEARDOWN = "services/agent/ops/teardown.py"


_FENCE_CHECKS: tuple[Mutant, ...] = (
    # ------------------------------------------------------------------ fold (shared/fence/state.py)
    Mutant(
        "state-superseded-not-tombstoned", STATE,
        "def _superseded(s: KeyState, d: Superseded) -> None:\n    f = d.fence\n    _tombstone(s, f.uid)\n",
        "def _superseded(s: KeyState, d: Superseded) -> None:\n    f = d.fence\n",
        "rule 3: a superseded uid is tombstoned; every later input for it is Skipped(superseded)",
        KERNEL,
    ),
    Mutant(
        "state-forgotten-not-tombstoned", STATE,
        "def _forgotten(s: KeyState, d: Forgotten) -> None:\n    f = d.fence\n    _tombstone(s, f.uid)\n",
        "def _forgotten(s: KeyState, d: Forgotten) -> None:\n    f = d.fence\n",
        "rule 3/5: a deleted incarnation is tombstoned; a late observation never re-admits it",
        KERNEL,
    ),
    Mutant(
        "state-decisions-apply-to-any-fence", STATE,
        "    return s.cur if s.cur is not None and s.cur.fence == fence else None\n",
        "    return s.cur\n",
        "rule 4: a decision changes the current incarnation only under its own fence",
        KERNEL,
    ),
    Mutant(
        "state-forgotten-drops-its-commands", STATE,
        "if _effect_fence(eff) == f and not isinstance(eff, Commanded) and not _is_survey(eff):",
        "if _effect_fence(eff) == f and not _is_survey(eff):",
        "rule 11/never a leak: a forgotten incarnation's commands stay outstanding, so a late result "
        "(a VM made after all) is still collected",
        KERNEL,
    ),
    Mutant(
        "state-rebuild-keeps-the-epoch", STATE,
        "    s.epoch = max(s.epoch, floor) + 1\n",
        "    s.epoch = max(s.epoch, floor)\n",
        "lost tail: a rebuild fences the key above every epoch its writer knew",
        KERNEL,
    ),
    Mutant(
        "state-no-tombstones-kept", STATE,
        "TOMBSTONE_LIMIT = 64\n",
        "TOMBSTONE_LIMIT = 0\n",
        "rule 3: superseded uids are remembered (bounded, but not to nothing)",
        KERNEL,
    ),
    # ------------------------------------------------------- the fenced append (shared/bus/append.py)
    Mutant(
        "append-without-expected-sequence", APPEND_PY,
        "    hdrs[H_EXPECTED_LAST_SUBJECT_SEQ] = str(expected_last_subject_seq)\n",
        "",
        "rule 1: every append carries the key's expected last subject sequence",
        APPEND,
    ),
    Mutant(
        "append-10071-always-ours", APPEND_PY,
        "    if last is not None and last.headers.get(H_MSG_ID) == msg_id:\n",
        "    if last is not None:\n",
        "rule 1: on 10071 the subject's last message must carry our Msg-Id to count as a benign retry; "
        "anything else is a lost race",
        APPEND,
    ),
    Mutant(
        "append-10071-always-lost", APPEND_PY,
        "                return await _resolve_wrong_last(js, stream, subject, msg_id, expected_last_subject_seq)\n",
        "                raise LostRace(subject, expected_last_subject_seq, None)\n",
        "rule 1 (measured fact): on an R1 stream a benign retry of a landed append also gets 10071; "
        "it is resolved by Msg-Id, not taken for a lost race",
        APPEND,
    ),
    # --------------------------------------- the Kubernetes gateway (services/reconciler/kube.py)
    Mutant(
        "kube-write-without-a-uid-fence", KUBE_PY,
        "                if not write.fence.uid:\n",
        "                if False:\n",
        "rule 4: a write with no uid in its fence is refused (an empty precondition is no precondition)",
        KUBE,
    ),
    Mutant(
        "kube-confirm-from-the-cache", KUBE_PY,
        '            return await self._retrying("GET", _object_path(key))\n',
        '            return await self._retrying("GET", _object_path(key), query={"resourceVersion": "0"})\n',
        "rule 3: confirmation is a consistent read (no resourceVersion), never the lagging cache",
        KUBE,
    ),
    Mutant(
        "kube-delete-without-uid-precondition", KUBE_PY,
        '            body: JSON = {"gracePeriodSeconds": 0, "preconditions": {"uid": fence.uid}}\n',
        '            body: JSON = {"gracePeriodSeconds": 0}\n',
        "rule 4: the final delete carries preconditions.uid; it never removes a successor",
        KUBE,
    ),
    Mutant(
        "kube-evict-without-uid-precondition", KUBE_PY,
        '            "deleteOptions": {"preconditions": {"uid": fence.uid}},\n',
        '            "deleteOptions": {},\n',
        "rule 4/7: an eviction carries preconditions.uid; it never evicts a successor",
        KUBE,
    ),
    Mutant(
        "kube-conflict-never-superseded", KUBE_PY,
        "        if uid != fence.uid:\n"
        '            raise _Outcome("superseded", f"{exc.status} {exc.reason}: {key} is now uid {uid}")\n',
        "",
        "rule 6: Conflict/Invalid on a uid-carrying write whose re-read shows another uid = superseded",
        KUBE,
    ),
    Mutant(
        "kube-status-of-a-successor", KUBE_PY,
        "        uid = meta(obj).get(\"uid\")\n"
        "        if uid != fence.uid:\n"
        '            raise _Outcome("superseded", f"uid is now {uid}")\n',
        "",
        "rule 4/6: a status write is built only on the fence's own incarnation (read consistently)",
        KUBE,  # once argued equivalent; killed since tests/kube/test_status_last_seen.py joined KUBE
    ),
    Mutant(
        "kube-not-found-is-failed", KUBE_PY,
        "                if exc.status == 404:\n"
        '                    raise _Outcome("gone", str(exc)) from exc\n'
        "                if exc.status not in (409, 422):\n"
        "                    raise\n"
        "                await self._classify(key, fence, exc)\n"
        "                if exc.status == 422:\n"
        '                    raise _Outcome("failed", f"rejected as invalid: {exc.message}") from exc\n'
        "        raise _Outcome(\"failed\", f\"still conflicting after {CONFLICT_ATTEMPTS} attempts\")\n",
        "                if exc.status not in (409, 422):\n"
        "                    raise\n"
        "                await self._classify(key, fence, exc)\n"
        "                if exc.status == 422:\n"
        '                    raise _Outcome("failed", f"rejected as invalid: {exc.message}") from exc\n'
        "        raise _Outcome(\"failed\", f\"still conflicting after {CONFLICT_ATTEMPTS} attempts\")\n",
        "rule 6: NotFound on a delete or eviction means the pod is gone (the delete path), not a failure",
        KUBE,
    ),
    Mutant(
        "kube-invalid-same-uid-superseded", KUBE_PY,
        "                if exc.status == 422:\n"
        '                    raise _Outcome("failed", f"rejected as invalid: {exc.message}") from exc\n'
        '                log.info("status of %s: resourceVersion conflict, re-applying the intent", key)\n',
        "                if exc.status == 422:\n"
        '                    raise _Outcome("superseded", f"rejected as invalid: {exc.message}") from exc\n'
        '                log.info("status of %s: resourceVersion conflict, re-applying the intent", key)\n',
        "rule 6: a 422 whose re-read shows the same uid is our own invalid body (failed) — calling it "
        "superseded would tombstone a live incarnation",
        KUBE,
    ),
    Mutant(
        "kube-conflict-resends-the-fresh-object", KUBE_PY,
        '        precondition = {"uid": fence.uid, "resourceVersion": meta(obj).get("resourceVersion")}\n',
        '        precondition = {"uid": fence.uid}\n',
        "rule 6: a status patch carries the resourceVersion it was built on, so a concurrent change is a "
        "409 and the intent is re-applied to the fresh object — never a silent overwrite",
        KUBE,
    ),
    Mutant(
        "kube-status-patch-without-uid", KUBE_PY,
        '        precondition = {"uid": fence.uid, "resourceVersion": meta(obj).get("resourceVersion")}\n',
        '        precondition = {"resourceVersion": meta(obj).get("resourceVersion")}\n',
        "rule 4: a status patch carries metadata.uid",
        KUBE,
        equivalent=(
            "the same patch carries metadata.resourceVersion of an object whose uid was checked (_current "
            "after a read, _LastSeen.take for a kept one): resourceVersions are etcd revisions, global to "
            "the store, so a successor under the name never has that resourceVersion and the patch is refused (409) "
            "with or without the uid; the uid stays as defence in depth"
        ),
    ),
    Mutant(
        "kube-last-seen-of-another-uid", KUBE_PY,
        '        return obj if obj is not None and meta(obj).get("uid") == uid else None\n',
        "        return obj\n",
        "rule 4/6: a kept object serves only its own incarnation's writes (uid == the fence's uid)",
        KUBE,
    ),
    Mutant(
        "kube-unchanged-judged-from-a-kept-object", KUBE_PY,
        "        if not diff:\n            obj = None\n",
        "",
        "rule 6: a kept object is trusted only through the status patch's resourceVersion; when it shows "
        "nothing to write, the object is read again consistently (a stale view never hides a change)",
        KUBE,
    ),
    Mutant(
        "kube-status-patch-without-preconditions", KUBE_PY,
        '        precondition = {"uid": fence.uid, "resourceVersion": meta(obj).get("resourceVersion")}\n',
        "        precondition = {}\n",
        "rule 4: the status patch, which carries a pod's runtime annotations too, is fenced by the uid and "
        "resourceVersion it was built on: a successor under the name never shows its predecessor's VM",
        KUBE,
    ),
    # ------------------------------------------------------- the kernel's rules (shared/fence/decide/)
    Mutant(
        "decide-node-name-ignored", DECIDE_BRINGUP,
        "    if spec.node is not None:\n        if not spec.node.startswith(NODE_PREFIX):\n",
        "    if False:\n        if not spec.node.startswith(NODE_PREFIX):\n",
        "scheduling: a pod's spec.nodeName is law — its VM runs on that host or nowhere (never the emptiest "
        "host instead, never a dead or full node's detour)",
        SCHEDULING,
    ),
    Mutant(
        "decide-create-before-binding", DECIDE_BRINGUP,
        "    if _is_pod(s.key) and cur.spec.node is None:\n        _bind(run, cur)",
        "    if False:\n        _bind(run, cur)",
        "scheduling / rule 11: an unscheduled pod is bound (pods/binding, a write in the outbox) before its VM "
        "is commanded, so its nodeName is always true",
        SCHEDULING,
    ),
    Mutant(
        "decide-lost-binding-places-anyway", DECIDE_WRITES,
        "    if write.verb == \"bind\" and node is not None:\n        _bound_to(run, cur, node)\n",
        "    if write.verb == \"bind\" and node is not None:\n"
        "        _bound_to(run, cur, node.replace(\"-b\", \"-a\"))\n",
        "scheduling: a binding refused because the pod is bound already leads to that node, never to the host "
        "the refused binding picked",
        SCHEDULING,
    ),
    Mutant(
        "decide-write-done-of-any-fence", DECIDE_TABLES,
        "    if cur is None or cur.fence != w.fence:\n        return\n",
        "    if cur is None:\n        return\n",
        "rule 4/5: a write's answer is applied only to the incarnation it was written for (a superseded "
        "incarnation's final delete answer must not forget its successor)",
        KERNEL,
    ),
    Mutant(
        "decide-probe-of-any-fence", DECIDE_LIFECYCLE,
        "if cur is None or cur.fence != p.fence or cur.vm_id != p.vm_id",
        "if cur is None or cur.vm_id != p.vm_id",
        "rule 4: probe results count only under the current fence (after adoption the same VM is probed "
        "under the predecessor's fence)",
        KERNEL,
    ),
    Mutant(
        "decide-restart-timer-after-delete-claim", DECIDE_TIMERS,
        "cur.vm_id == p.vm_id and not cur.deleting:",
        "cur.vm_id == p.vm_id:",
        "rule 12/5: a restart timer firing after a delete claim re-checks and sends nothing",
        KERNEL,
    ),
    Mutant(
        "decide-restart-backoff-uncapped", DECIDE_LIFECYCLE,
        "run.env.restart_backoff_base_s * (2 ** (count - 1)), run.env.restart_backoff_max_s",
        "run.env.restart_backoff_base_s * (2 ** (count - 1)), float(\"inf\")",
        "rule 7: exponential restart backoff, capped (300 s by default)",
        KERNEL,
    ),
    Mutant(
        "decide-superseded-observation-applied", DECIDE_OBSERVATIONS,
        "    if s.is_tombstoned(o.uid):\n"
        "        run.add(Skipped(\"superseded\", o.uid, \"observation of a superseded incarnation\"))\n"
        "        return\n",
        "",
        "rule 3/5: every later input for a tombstoned uid is Skipped(superseded), never applied",
        KERNEL,
    ),
    Mutant(
        "decide-admitted-without-confirmation", DECIDE_OBSERVATIONS,
        "        return  # deletion of an incarnation we never admitted: nothing of ours to undo\n"
        "    _request_confirm(run, o.uid)\n",
        "        return  # deletion of an incarnation we never admitted: nothing of ours to undo\n"
        "    _admit(run, ConfirmedRead(s.key, \"\", o.uid, o.resource_version, spec=o.spec))\n",
        "rule 3: a new uid becomes current only on a consistent read, never on a watch event",
        KERNEL,
    ),
    Mutant(
        "decide-epoch-reused", DECIDE_CONFIRMATION,
        "    fence = Fence(s.key, r.uid, s.epoch + 1)\n",
        "    fence = Fence(s.key, r.uid, s.epoch)\n",
        "rule 3/4: every new incarnation gets a new epoch (never reuse)",
        KERNEL,
    ),
    Mutant(
        "decide-result-of-another-fence-applied", DECIDE_TABLES,
        "    if cmd.fence != r.fence or cmd.vm_id != r.vm_id:\n",
        "    if False:\n",
        "rule 4: a result whose fence or VM contradicts its command is Skipped(stale_effect), never applied",
        KERNEL,
    ),
    Mutant(
        "decide-stale-bring-up-bound", DECIDE_RESULTS,
        "    if cur is not None and cur.fence == cmd.fence and not cur.deleting and cur.vm_id == cmd.vm_id:\n",
        "    if cur is not None and not cur.deleting and cur.vm_id == cmd.vm_id:\n",
        "rule 4: a create/start/wake that took is bound only under the current fence, else removed",
        KERNEL,
    ),
    Mutant(
        "decide-delete-claimed-twice", DECIDE_DELETES,
        "    if cur.delete_claim:\n        if gone and not _vms_of(s, cur):\n",
        "    if False:\n        if gone and not _vms_of(s, cur):\n",
        "rule 5: a delete already in flight waits; it is never claimed (and its VMs removed) twice",
        KERNEL,
    ),
    Mutant(
        "decide-eviction-under-a-delete-claim", DECIDE_LIFECYCLE,
        "    if cur.delete_claim:\n        run.add(EvictionDeferred(cur.fence, g.vm_id))\n",
        "    if False:\n        run.add(EvictionDeferred(cur.fence, g.vm_id))\n",
        "rule 7: VM-gone under a delete claim defers the eviction (resolved by the delete), never evicts",
        KERNEL,
    ),
    Mutant(
        "decide-second-vm-beside-the-first", DECIDE_BRINGUP,
        "    if s.vms and not _stranded(run, cur):\n        return  # another VM of the key",
        "    if False:\n        return  # another VM of the key",
        "never two VMs for one key: a successor's VM waits until every other VM of the key is released",
        KERNEL,
    ),
    Mutant(
        "decide-stranded-on-a-live-host", DECIDE_BRINGUP,
        " or r.fence.uid == cur.fence.uid or r.host in live for r in others):",
        " or r.fence.uid == cur.fence.uid for r in others):",
        "rule 12 / never two VMs: a force-deleted predecessor's VM being removed on a live host is waited for; "
        "only one stranded on a host that is not live lets the successor start elsewhere",
        SCHEDULING,
    ),
    Mutant(
        "decide-old-absent-read-deletes", DECIDE_CONFIRMATION,
        "        if cur is not None and asked.at < cur.admitted_at:\n",
        "        if False:\n",
        "rule 3/12: an absent answer to a read asked before the current admission deletes nothing",
        KERNEL,
    ),
    Mutant(
        "decide-exit-of-any-fence", DECIDE_LIFECYCLE,
        "    if rec is None or rec.fence != e.fence or cur is None or cur.fence != e.fence:\n",
        "    if rec is None or cur is None:\n",
        "rule 4/7: a VM exit is acted on only under the fence that owns the VM and is current",
        KERNEL,
    ),
    Mutant(
        "decide-inconclusive-adopt-trusted", DECIDE_TABLES,
        "_row(_adopted, _adopt_lost, _fenced, _adopt_lost, _adopt_again)",
        "_row(_adopted, _adopt_lost, _fenced, _adopt_lost, _adopted)",
        "rule 8: an inconclusive inspect is retried, never trusted",
        KERNEL,
    ),
    Mutant(
        "decide-failed-bring-up-releases-any-claim", DECIDE_RESULTS,
        "    if rec is not None and rec.fence == cmd.fence:\n",
        "    if rec is not None:\n",
        "rule 2: a failed bring-up releases only a claim it still owns",
        KERNEL,
    ),
    # ------------------------------------- the agent's fence checks (executor, its steps, the tables)
    Mutant(
        "exec-ledger-owner-unchecked", EXECUTOR,
        "row.fence if row else None,",
        "None,",
        "rule 4: the agent refuses a command the VM's owner fence in its ledger does not allow",
        AGENT,
    ),
    Mutant(
        "exec-key-mark-unchecked", EXECUTOR,
        "                self._check_mark(cmd)\n",
        "",
        "rule 4: nothing decided under a fence older than the key's mark (or a rival at it) makes or "
        "wakes a VM",
        AGENT,
    ),
    Mutant(
        "exec-key-mark-never-raised", EXECUTOR,
        "                if raises_mark(cmd.op):\n",
        "                if False:\n",
        "rule 4: a command raises the key's mark to its fence (so an older one is refused afterwards)",
        AGENT,
    ),
    Mutant(
        "exec-buried-vm-brought-back", EXECUTOR,
        "tomb.reason if tomb else None))",
        "None))",
        "rule 4/11: a removed, hibernated or lost vm_id is never brought back by a late create/start/wake",
        AGENT,
    ),
    Mutant(
        "agentfence-other-keys-vm", AGENTFENCE,
        "    if fence.key != owner.key:\n        return \"other_key\"\n",
        "",
        "rule 4: a command of another key never touches the VM",
        AGENT,
    ),
    Mutant(
        "agentfence-older-than-owner", AGENTFENCE,
        "    if fence.epoch < owner.epoch:\n        return \"older\"\n",
        "",
        "rule 4: a command older than the VM's owner is refused (a remove too: cleanup is the owner's own)",
        AGENT,
    ),
    Mutant(
        "agentfence-rival-at-the-owners-epoch", AGENTFENCE,
        "    if fence.epoch == owner.epoch:\n        return \"rival\"\n",
        "",
        "rule 4: at the owner's epoch only the owner's uid may touch the VM",
        AGENT,
    ),
    Mutant(
        "agentfence-newer-fence-brings-up", AGENTFENCE,
        '    "bring_up":  ("allow", "allow", "other_key", "older_than_owner", "epoch_owned", "only_adopt_moves"),\n',
        '    "bring_up":  ("allow", "allow", "other_key", "older_than_owner", "epoch_owned", "allow"),\n',
        "rule 4/8: only adopt moves a VM to a newer incarnation",
        AGENT,
    ),
    Mutant(
        "agentfence-below-the-mark", AGENTFENCE,
        "    if fence.epoch < mark:\n        return \"below\"\n",
        "",
        "rule 4: a fence older than the key's mark is refused",
        AGENT,
    ),
    Mutant(
        "agentfence-rival-at-the-mark", AGENTFENCE,
        "    if fence.epoch == mark and mark_uid and fence.uid and fence.uid != mark_uid:\n        return \"rival\"\n",
        "",
        "lost tail: the key's mark epoch under another uid is refused (and shows a cut nobody saw)",
        AGENT,
    ),
    Mutant(
        "agentfence-buried-brought-back", AGENTFENCE,
        "    \"bring_up\": \"buried\",\n",
        "    \"bring_up\": \"allow\",\n",
        "rule 4/11: a buried vm_id is never brought back",
        AGENT,
    ),
    Mutant(
        "ops-wake-without-a-snapshot", BRINGUP,
        "        if not snapshot:\n"
        '            raise Answer("failed", "wake without a snapshot (never a blank VM)")\n',
        "",
        "rule 10: a wake restores from a snapshot, never a blank VM",
        AGENT,
    ),
    Mutant(
        "ops-create-over-a-labelled-vm", BRINGUP,
        "                ex.check_owner(cmd, labels_fence(info.labels))\n",
        "                pass\n",
        "rule 4: a create finding a VM the ledger lost checks the owner fence on its labels",
        AGENT,
    ),
    Mutant(
        "ops-adopt-doubt-taken-as-failure", ADOPT,
        "        info = await ex.inspect(cmd.vm_id, failure=\"inconclusive\")",
        "        info = await ex.inspect(cmd.vm_id)",
        "rule 8: an adopt's inspect that fails is inconclusive (retried), never a failure that "
        "releases the VM",
        AGENT,
    ),
    Mutant(
        "ops-adopt-buried-vm", ADOPT,
        "        if tomb is not None:\n            raise Answer(\"fenced\", f\"vm {cmd.vm_id} was {tomb.reason}\")\n",
        "",
        "rule 4/8: a buried vm_id is never adopted, even if the runtime still shows it",
        AGENT,
    ),
    Mutant(
        "ops-adopt-over-a-labelled-vm", ADOPT,
        "        if row is None:\n            ex.check_owner(cmd, labels_fence(info.labels))\n",
        "",
        "rule 4: an adopt of a VM the ledger lost checks the owner fence on its labels",
        AGENT,
    ),
    Mutant(
        "ops-remove-over-a-labelled-vm", TEARDOWN,
        "            owner = labels_fence(info.labels)\n            ex.check_owner(cmd, owner)\n",
        "            owner = labels_fence(info.labels)\n",
        "rule 4: a remove of a VM the ledger lost checks the owner fence on its labels",
        AGENT,
    ),
    # -------------------------------------------- the agent's ledger (services/agent/ledger.py)
    Mutant(
        "ledger-anyone-releases", LEDGER_PY,
        "            if (raw[0], raw[1], int(raw[2])) != (vm_id, owner.uid, owner.epoch):\n",
        "            if False:\n",
        "rule 9: a reservation is released only by its owner (vm_id, uid, epoch)",
        LEDGER,
    ),
    Mutant(
        "ledger-claim-takes-over", LEDGER_PY,
        '        raise ReservationConflict(f"{kind} {resource} is held by {raw[0]}/{raw[1]}/{raw[2]}")\n',
        "        await db.execute(\"DELETE FROM reservations WHERE kind = ? AND resource = ?\", (kind, resource))\n",
        "rule 9: a reservation another owner holds is never claimed (a successor never gets a "
        "predecessor's address)",
        LEDGER,
    ),
    Mutant(
        "ledger-bury-releases-anyones", LEDGER_PY,
        "        f\"DELETE FROM reservations WHERE vm_id = ? AND uid = ? AND epoch = ? \"\n"
        "        f\"AND kind NOT IN ({', '.join('?' for _ in kept)})\",\n"
        "        (vm_id, owner.uid, owner.epoch, *kept),\n",
        "        f\"DELETE FROM reservations WHERE vm_id = ? \"\n"
        "        f\"AND kind NOT IN ({', '.join('?' for _ in kept)})\",\n"
        "        (vm_id, *kept),\n",
        "rule 9: burying a VM releases only what its owner holds on it (a predecessor's recovery cannot "
        "free a successor's reservations)",
        LEDGER,
    ),
    Mutant(
        "ledger-bury-drops-snapshots", LEDGER_PY,
        "    kept = (\"snapshot\", ADDRESS_KIND) if reason == \"hibernated\" else (\"snapshot\",)\n",
        "    kept = (ADDRESS_KIND,) if reason == \"hibernated\" else (\"\",)\n",
        "rule 9/10: a snapshot reservation outlives its VM (the hibernated pod wakes from it)",
        LEDGER,
    ),
    Mutant(
        "ledger-bury-drops-hibernated-address", LEDGER_PY,
        "    kept = (\"snapshot\", ADDRESS_KIND) if reason == \"hibernated\" else (\"snapshot\",)\n",
        "    kept = (\"snapshot\",)\n",
        "rule 9: a hibernated VM keeps its address with its snapshot (the restored guest has it configured)",
        ("tests/agent/test_network.py",),
    ),
    Mutant(
        "ledger-adopt-keeps-old-owner", LEDGER_PY,
        "            if transfer_to is not None:\n                db.execute(\n",
        "            if False:\n                db.execute(\n",
        "rule 8/9: an adopt moves the VM's reservations to the adopting fence",
        (*LEDGER, "tests/agent/test_agent.py"),
    ),
    Mutant(
        "ledger-key-mark-lowered", LEDGER_PY,
        "    return epoch > old or (epoch == old and not old_uid and bool(uid))\n",
        "    return epoch != old or (epoch == old and not old_uid and bool(uid))\n",
        "rule 4: a key's mark only rises (an old survey round re-sent never re-opens older epochs)",
        LEDGER,
    ),
    # ------------------------ the partition (services/reconciler/partition.py) and its write path (entries.py)
    Mutant(
        "partition-reread-owes-nothing", ENTRIES_PY,
        "            # send what they owe\n            self._owe(slot)\n",
        "            # send what they owe\n            pass\n",
        "rule 1: an entry of ours stored whose answer was lost is folded by the re-read of the lost race, "
        "and its outbox carried out (nobody else owes it)",
        ("tests/reconciler/test_fencing.py",),
    ),
    Mutant(
        "partition-verified-ignores-named-keys", PARTITION_PY,
        "            named = key in self._named\n",
        "            named = False\n",
        "rule 2 after a lost tail: a key a host named in its PartitionVerified answer (it has a VM of "
        "it) surveys every host before its first VM",
        ("tests/reconciler/test_partition_verify.py",),
    ),
    Mutant(
        "partition-trusts-another-generations-answer", VERIFICATION_PY,
        "        if answer.gen == self.gen and self.held:\n",
        "        if self.held:\n",
        "rule 1/2: only an answer to this writer's own generation verifies a host (an older lease's "
        "answer says nothing of what was sent since)",
        ("tests/reconciler/test_partition_verify.py",),
    ),
    Mutant(
        "partition-decides-floor-refusals", PARTITION_PY,
        "        if isinstance(inp, CommandResult) and inp.floor > 0:\n",
        "        if False:\n",
        "rule 11: a host's refusal of an older writer's copy of a command says nothing about this "
        "writer's own copy; it is never decided",
        ("tests/reconciler/test_partition_verify.py",),
    ),
    Mutant(
        "partition-never-resends-a-refused-command", VERIFICATION_PY,
        "            self.effects.submit(key, pending)\n",
        "            pass\n",
        "rule 11: a command of our outbox whose predecessor's copy (same Msg-Id) a host refused for "
        "its generation goes again under ours, or it would never be answered",
        ("tests/reconciler/test_partition_verify.py",),
    ),
    Mutant(
        "partition-forgets-a-refusal-of-a-command-not-yet-read", VERIFICATION_PY,
        "        self.effects.refused_copy(key, r.command_id, r.host)\n",
        "        pass\n",
        "rule 11: a refusal that arrives before this writer read the predecessor's entry that "
        "commanded it still makes our copy go under our generation, or the stream's dedupe drops it",
        ("tests/reconciler/test_partition_verify.py",),
    ),
    Mutant(
        "partition-acks-a-refusal-meant-for-a-newer-writer", VERIFICATION_PY,
        "            self._outgrown(r.host, r.floor)\n            return False\n",
        "            self._outgrown(r.host, r.floor)\n            return True\n",
        "rule 11: a refusal above this writer's generation is for a newer writer (or for us at the "
        "generation we now take); acked here, the writer that owns the command never resends it",
        ("tests/reconciler/test_partition_verify.py",),
    ),
    Mutant(
        "partition-decides-held-inputs-out-of-order", VERIFICATION_PY,
        "            inp, msg = queue.pop(0)\n",
        "            inp, msg = queue.pop()\n",
        "rule 1: a key's inputs held while its partition is verified are decided in arrival order, as "
        "its single writer would have decided them",
        ("tests/reconciler/test_partition_verify.py",),
    ),
    Mutant(
        "partition-verifies-early-keys-with-a-survey-out", VERIFICATION_PY,
        "            if s.unverified and not s.rebuilding and not survey_pending(s):\n",
        "            if s.unverified and not s.rebuilding:\n",
        "conservative (the model campaign finds no violation without it): a key whose survey is out "
        "waits for that survey's answers, which may carry the cut evidence its rebuild needs",
        ("tests/reconciler/test_partition_verify.py",),
    ),
    Mutant(
        "partition-never-verifies-early-keys", VERIFICATION_PY,
        "                    self._verify_early_keys()\n",
        "                    pass\n",
        "throughput, not safety: keys first seen while the partition was verified need no survey of "
        "their own once it is",
        ("tests/reconciler/test_partition_verify.py",),
    ),
    Mutant(
        "partition-loaded-keys-always-survey", PARTITION_PY,
        "            slot.state.unverified = True\n            self._early.add(key)\n",
        "            slot.state.unverified = True\n",
        "throughput, not safety: a key loaded from the log needs no survey of its own once every live "
        "host has verified the partition and none named it",
        ("tests/reconciler/test_partition_verify.py",),
    ),
    Mutant(
        "partition-holds-no-new-key", PARTITION_PY,
        "        if key in self._held_inputs or ((key not in self.keys or key in self._early) and self._holding()):\n",
        "        if key in self._held_inputs:\n",
        "throughput, not safety: a key first seen while its partition is verified waits for the "
        "verification instead of surveying every host (the survey stays correct, and is the fallback)",
        ("tests/reconciler/test_partition_verify.py",),
    ),
    Mutant(
        "agent-ignores-the-partition-floor", EXECUTOR,
        "            why = floor_verdict(cmd.op, cmd.gen, floor)\n",
        "            why = None\n",
        "rule 1/4: once a newer writer of the partition verified the host, nothing its predecessor "
        "sent makes, wakes or looks at a VM there",
        ("tests/agent/test_partition_floor.py",),
    ),
    Mutant(
        "partition-fetch-failure-cancels-appends", PARTITION_PY,
        "                        failed = exc\n                        break\n",
        "                        raise\n",
        "rule 1: a failed fetch never cancels an input mid-append (an entry stored, never folded)",
        ("tests/reconciler/test_fencing.py",),
    ),
    Mutant(
        "probe-reports-for-a-superseded-fence", PROBES_PY,
        "        if self.ledger.owner(vm_id) != fence:\n            log.info(",
        "        if False:\n            log.info(",
        "rule 4: a probe change is published only while the fence it ran under still owns the VM",
        ("tests/agent/test_probes.py", "tests/agent/test_probe_spec.py"),
    ),
    Mutant(
        "new-run-probed-before-its-result", "services/agent/service.py",
        "        told = None  # the readiness the published result carries\n        try:\n",
        "        told = None\n        if new_run:\n"
        "            self.prober.restart(cmd.vm_id, None if ready is None else (result.fence, ready))\n        try:\n",
        "a new run's readiness is never reported before its result, which binds it (a probe decided "
        "before the binding is dropped, and the VM stays not Ready)",
        ("tests/agent/test_agent.py",),
    ),
    Mutant(
        "hibernating-pod-made-ready-by-its-bring-up", DECIDE_RESULTS,
        "        elif a.r.ready and not cur.ready:\n",
        "        if a.r.ready and not cur.ready:\n",
        "a bring-up's ready verdict makes Ready only a pod that stays up (a hibernating one is not)",
        ("tests/unit/test_ready_with_binding.py",),
    ),
    Mutant(
        "probe-begun-before-a-restart-reported", PROBES_PY,
        "        if self._swept.get(vm_id) is not swept or swept.gen != gen:\n",
        "        if self._swept.get(vm_id) is not swept:\n",
        "rule 4: a probe that began before the VM's new run never reports for that run",
        ("tests/agent/test_probes.py",),
    ),
    Mutant(
        "image-of-another-stream-loaded", IMAGES_PY,
        "        if image.stream != self.stream_identity:\n",
        "        if False:\n",
        "rule 11: the outbox is re-derived from the state of this log; an image of another log (a "
        "recreated bus) is never loaded as that state",
        ("tests/reconciler/test_images.py",),
    ),
    Mutant(
        "image-load-leaves-the-snapshot-partial", PARTITION_PY,
        "                self._snapshot_whole = True  # our file holds none of these rows yet\n",
        "                pass\n",
        "rule 11: a restart re-derives the outbox from the whole state; a snapshot taken after a load "
        "from an image holds every row, not only those that changed since",
        ("tests/reconciler/test_images.py",),
    ),
    Mutant(
        "image-row-of-another-partition-loaded", IMAGES_PY,
        "                if self.subjects.partition(Key.parse(key)) != p:\n",
        "                if Key.parse(key) is None:\n",
        "rule 1: a partition's writer holds only its own keys; an image row of another partition's "
        "key is not loaded into it",
        ("tests/reconciler/test_images.py",),
    ),
)

# the re-checks that wait (rule 12) back off: their own module (imported here, after what it uses)
from services.testbed.mutant_catalogue_backoff import BACKOFFS  # noqa: E402

MUTANTS: tuple[Mutant, ...] = _FENCE_CHECKS + BACKOFFS

# run by tests/unit/test_mutants_sample.py in CI: fast kills (a few seconds each), several modules
SAMPLE: tuple[str, ...] = (
    "state-superseded-not-tombstoned",
    "state-rebuild-keeps-the-epoch",
    "ledger-anyone-releases",
)
