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

Entries for ``shared/fence/decide.py`` and ``services/agent/executor.py`` were written against
the code as committed when the catalogue was last revised (see the commit that touched them).
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
    "tests/unit/test_audit.py",
    "tests/unit/test_audit_rebuild.py",
    "tests/unit/test_properties.py",
)
APPEND = ("tests/bus/test_fenced_append.py",)
KUBE = ("tests/kube/test_fence_regressions.py", "tests/kube/test_gateway.py")
LEDGER = ("tests/agent/test_ledger.py", "tests/agent/test_fence_regressions.py")
AGENT = (
    "tests/agent/test_fence_regressions.py",
    "tests/agent/test_ledger.py",
    "tests/unit/test_agent_key_epoch.py",
    "tests/agent/test_agent.py",
)

STATE = "shared/fence/state.py"
APPEND_PY = "shared/bus/append.py"
KUBE_PY = "services/reconciler/kube.py"
LEDGER_PY = "services/agent/ledger.py"
DECIDE = "shared/fence/decide.py"
EXECUTOR = "services/agent/executor.py"


MUTANTS: tuple[Mutant, ...] = (
    # ------------------------------------------------------------------ fold (shared/fence/state.py)
    Mutant(
        "state-superseded-not-tombstoned", STATE,
        "        case Superseded(fence=f):\n            _tombstone(s, f.uid)\n",
        "        case Superseded(fence=f):\n            pass\n",
        "rule 3: a superseded uid is tombstoned; every later input for it is Skipped(superseded)",
        KERNEL,
    ),
    Mutant(
        "state-forgotten-not-tombstoned", STATE,
        "        case Forgotten(fence=f):\n            _tombstone(s, f.uid)\n",
        "        case Forgotten(fence=f):\n            pass\n",
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
        "if _effect_fence(eff) == f and not isinstance(eff, Commanded):",
        "if _effect_fence(eff) == f:",
        "rule 11/never a leak: a forgotten incarnation's commands stay outstanding, so a late result "
        "(a VM made after all) is still collected",
        KERNEL,
    ),
    Mutant(
        "state-rebuild-keeps-the-epoch", STATE,
        "            s.epoch = max(s.epoch, floor) + 1\n",
        "            s.epoch = max(s.epoch, floor)\n",
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
        "                return await self._retrying(self.core.read_namespaced_pod, key.name, key.namespace)\n",
        "                return await self._retrying(\n"
        "                    self.core.read_namespaced_pod, key.name, key.namespace, resource_version=\"0\"\n"
        "                )\n",
        "rule 3: confirmation is a consistent read (no resourceVersion), never the lagging cache",
        KUBE,
    ),
    Mutant(
        "kube-delete-without-uid-precondition", KUBE_PY,
        '            body = {"gracePeriodSeconds": 0, "preconditions": {"uid": fence.uid}}\n',
        '            body = {"gracePeriodSeconds": 0}\n',
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
        "        uid = _meta(obj).get(\"uid\")\n"
        "        if uid != fence.uid:\n"
        '            raise _Outcome("superseded", f"uid is now {uid}")\n',
        "",
        "rule 4/6: a status write is built only on the fence's own incarnation (read consistently)",
        KUBE,
        equivalent=(
            "redundant with the uid in both patch bodies: built on a successor, the status patch (uid + "
            "that successor's resourceVersion) or the annotations patch (uid) is refused with 409, the "
            "re-read names the other uid and the outcome is superseded all the same; both diffs are "
            "never empty for another incarnation, because vmfence.io/epoch (pods) and status.epoch "
            "(VirtualMachines) differ — epochs strictly increase per key"
        ),
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
        '                "metadata": {"uid": fence.uid, "resourceVersion": m.get("resourceVersion")},\n'
        '                "status": diff,\n',
        '                "metadata": {"uid": fence.uid},\n'
        '                "status": diff,\n',
        "rule 6: a status patch carries the resourceVersion it was built on, so a concurrent change is a "
        "409 and the intent is re-applied to the fresh object — never a silent overwrite",
        KUBE,
    ),
    Mutant(
        "kube-status-patch-without-uid", KUBE_PY,
        '                "metadata": {"uid": fence.uid, "resourceVersion": m.get("resourceVersion")},\n',
        '                "metadata": {"resourceVersion": m.get("resourceVersion")},\n',
        "rule 4: a status patch carries metadata.uid",
        KUBE,
        equivalent=(
            "the same patch carries metadata.resourceVersion of the object just read, whose uid was "
            "checked (_current): resourceVersions are etcd revisions, global to the store, so a "
            "successor under the name never has that resourceVersion and the patch is refused (409) "
            "with or without the uid; the uid stays as defence in depth"
        ),
    ),
    Mutant(
        "kube-annotations-patch-without-uid", KUBE_PY,
        '            body = {"metadata": {"uid": fence.uid, "annotations": ann}}\n',
        '            body = {"metadata": {"annotations": ann}}\n',
        "rule 4: the runtime annotations patch carries metadata.uid",
        KUBE,
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
        "        \"DELETE FROM reservations WHERE vm_id = ? AND uid = ? AND epoch = ? AND kind != 'snapshot'\",\n"
        "        (vm_id, owner.uid, owner.epoch),\n",
        "        \"DELETE FROM reservations WHERE vm_id = ? AND kind != 'snapshot'\",\n"
        "        (vm_id,),\n",
        "rule 9: burying a VM releases only what its owner holds on it (a predecessor's recovery cannot "
        "free a successor's reservations)",
        LEDGER,
    ),
    Mutant(
        "ledger-bury-drops-snapshots", LEDGER_PY,
        "        \"DELETE FROM reservations WHERE vm_id = ? AND uid = ? AND epoch = ? AND kind != 'snapshot'\",\n",
        "        \"DELETE FROM reservations WHERE vm_id = ? AND uid = ? AND epoch = ?\",\n",
        "rule 9/10: a snapshot reservation outlives its VM (the hibernated pod wakes from it)",
        LEDGER,
    ),
    Mutant(
        "ledger-adopt-keeps-old-owner", LEDGER_PY,
        "            if transfer_to is not None:\n",
        "            if False:\n",
        "rule 8/9: an adopt moves the VM's reservations to the adopting fence",
        (*LEDGER, "tests/agent/test_agent.py"),
    ),
    Mutant(
        "ledger-key-mark-lowered", LEDGER_PY,
        "        if epoch < old or (epoch == old and (old_uid or not uid)):\n",
        "        if epoch == old and (old_uid or not uid):\n",
        "rule 4: a key's mark only rises (an old survey round re-sent never re-opens older epochs)",
        LEDGER,
    ),
)

# run by tests/unit/test_mutants_sample.py in CI: fast kills (a few seconds each), several modules
SAMPLE: tuple[str, ...] = (
    "state-superseded-not-tombstoned",
    "state-rebuild-keeps-the-epoch",
    "ledger-anyone-releases",
)
