"""Catalogue mutants of the re-checks that wait and back off (rule 12: a timer only re-checks):
a placement, a survey with no live host, a failed Kubernetes write, a command on a VM sent again,
the reconciler's early checks when a host comes live or has more room, and the pace of a host's
inventory round. Part of ``mutant_catalogue.MUTANTS``."""

from __future__ import annotations

from services.testbed.mutant_catalogue import (
    DECIDE_INVENTORY,
    DECIDE_RESULTS,
    DECIDE_TIMERS,
    DECIDE_WRITES,
    STATE,
    Mutant,
)

BACKOFFS: tuple[Mutant, ...] = (
    Mutant(
        "placement-backoff-kept-once-placed", STATE,
        "        c.unplaced, c.unplaced_tries = None, 0\n",
        "        c.unplaced = None\n",
        "rule 12: a placement check backs off only while no host takes the pod; once placed, its next "
        "wait for a host starts again from the first delay",
        ("tests/unit/test_place_backoff.py",),
    ),
    Mutant(
        "host-waits-left-to-their-backoff", "services/reconciler/service.py",
        "            fired = effects.fire_host_waits(functools.partial(self._worth_checking, views))\n",
        "            fired = 0\n",
        "rule 12: the checks waiting for a host are fired when one comes live or has more room, not "
        "left to a backoff of up to a minute",
        ("tests/reconciler/test_place_again.py",),
    ),
    Mutant(
        "host-waits-fired-for-pods-no-roomier-host-can-take", "services/reconciler/hosts.py",
        "    return placeable(roomier, state.cur.spec)\n",
        "    return True\n",
        "rule 12: a placement check fired early is one that a host that came live or has more room could "
        "answer; a pod bound to a dead node is not checked each time another host frees room",
        ("tests/reconciler/test_place_again.py",),
    ),
    Mutant(
        "survey-without-hosts-never-backs-off", DECIDE_INVENTORY,
        "        _arm(run, fence, SurveyTimer(), min(max(PLACE_RETRY_S, 2 * last), PLACE_RETRY_MAX_S))\n",
        "        _arm(run, fence, SurveyTimer(), PLACE_RETRY_S)\n",
        "rule 12: a survey that finds no live host to ask backs off as placement does, not every 2 s for "
        "as long as the fleet is gone",
        ("tests/unit/test_place_backoff.py",),
    ),
    Mutant(
        "rewrite-never-backs-off", DECIDE_WRITES,
        "    _arm(run, cur.fence, RewriteTimer(write.verb), rewrite_backoff_s(cur.write_failures))\n",
        "    _arm(run, cur.fence, RewriteTimer(write.verb), 1.0)\n",
        "rule 12: a failed Kubernetes write is written again after a backoff that doubles per failure in a "
        "row, not every second for as long as the failure lasts",
        ("tests/unit/test_rewrite_backoff.py",),
    ),
    Mutant(
        "rewrite-backoff-kept-after-a-write-takes", STATE,
        "        c.write_failures = c.write_failures + 1 if d.outcome == \"failed\" else 0\n",
        "        c.write_failures += d.outcome == \"failed\"\n",
        "rule 12: a write that takes ends the rewrite backoff; the next failure waits the first delay again",
        ("tests/unit/test_rewrite_backoff.py",),
    ),
    Mutant(
        "status-rewrite-writes-a-bare-status", DECIDE_TIMERS,
        "    status = wanted_status(run.s, cur) or status_of(cur)\n",
        "    status = status_of(cur)\n",
        "rule 12: a status rewrite writes the status the pod should show, once; a bare one makes the status "
        "sync ask for a second write, and failing writes then double with every rewrite",
        ("tests/unit/test_rewrite_backoff.py",),
    ),
    Mutant(
        "command-retry-never-backs-off", DECIDE_RESULTS,
        "        _arm(run, a.rec.fence, RetryTimer(a.cmd.op, a.cmd.vm_id), retry_backoff_s(a.rec.retries))\n",
        "        _arm(run, a.rec.fence, RetryTimer(a.cmd.op, a.cmd.vm_id), EFFECT_RETRY_S)\n",
        "rule 12: a command on a VM answered inconclusive (or a failed remove) is sent again after a backoff "
        "that doubles per re-send, not every second per VM for as long as its runtime does not answer",
        ("tests/unit/test_retry_backoff.py",),
    ),
    Mutant(
        "adopt-inspect-never-backs-off", DECIDE_RESULTS,
        "        _arm(run, a.cmd.fence, AdoptTimer(a.cmd.vm_id), retry_backoff_s(retries))\n",
        "        _arm(run, a.cmd.fence, AdoptTimer(a.cmd.vm_id), EFFECT_RETRY_S)\n",
        "rules 8 and 12: an inconclusive adopt's inspect is asked again after a backoff, as any re-send",
        ("tests/unit/test_retry_backoff.py",),
    ),
    Mutant(
        "command-retry-backoff-kept-after-an-ok", STATE,
        "        rec.retries = 0\n",
        "        pass\n",
        "rule 12: an ok answer ends a VM's re-send backoff; its next doubt waits the first delay again",
        ("tests/unit/test_retry_backoff.py",),
    ),
    Mutant(
        "rewrites-left-to-their-backoff-when-the-server-answers", "services/reconciler/effects.py",
        "            fired = self.fire_server_waits()\n",
        "            fired = 0\n",
        "rule 12: the writes that failed because the API server did not answer are written again when it "
        "answers again, not left to a backoff of up to 30 s",
        ("tests/reconciler/test_rewrite_early.py",),
    ),
    Mutant(
        "a-refusal-taken-for-the-servers-silence", "services/reconciler/effects.py",
        "                self._write_answered(not done.unanswered, str(key))\n",
        "                self._write_answered(done.outcome != \"failed\", str(key))\n",
        "rule 12: a refused write (a 403, a 422) is an answer; only silence waits for the API server, and its "
        "first answer ends the wait",
        ("tests/reconciler/test_rewrite_early.py",),
    ),
    Mutant(
        "no-canary-while-the-server-is-silent", "services/reconciler/effects.py",
        "            if self.writes.silent and (write := self.writes.canary()) is not None:\n",
        "            if False:\n",
        "rule 12: while the API server is silent one waiting write goes ahead of its backoff now and then, "
        "so that its answer is seen though no other write is made",
        ("tests/reconciler/test_rewrite_early.py",),
    ),
    Mutant(
        "failing-effects-hold-their-workers", "services/reconciler/effects.py",
        "                        parked = True\n"
        "                        self._park(key, exc)\n"
        "                        break\n",
        "                        await asyncio.sleep(RETRY_DELAY_S)\n                        continue\n",
        "an effect that fails (a confirm while the API server is away) waits parked and holds no worker: "
        "as many such keys as workers must not stop every other key's effects",
        ("tests/reconciler/test_effects_parked.py",),
    ),
    Mutant(
        "parked-keys-wait-out-their-delay-when-the-server-answers", "services/reconciler/effects.py",
        "            if self.reads.silent and (read := self.reads.canary()) is not None:\n",
        "            if False:\n",
        "the keys parked while the API server was away go as soon as it answers (a canary finds out), not "
        "at the end of a delay of up to 30 s",
        ("tests/reconciler/test_effects_parked.py",),
    ),
    Mutant(
        "a-survey-retry-per-failed-answer", DECIDE_RESULTS,
        "    if survey_retry_armed(run.s):\n        return\n",
        "",
        "rule 12: one survey retry at a time; a retry per failed answer, each asking every host, doubled the "
        "surveys every round while the hosts did not answer",
        ("tests/unit/test_retry_backoff.py", "tests/unit/test_no_amplification.py"),
    ),
    Mutant(
        "survey-retry-never-backs-off", DECIDE_RESULTS,
        "    _arm(run, a.cmd.fence, SurveyTimer(), retry_backoff_s(run.s.survey_failures - 1))\n",
        "    _arm(run, a.cmd.fence, SurveyTimer(), EFFECT_RETRY_S)\n",
        "rule 12: a survey round with a failed answer is asked again after a backoff that doubles per such "
        "round, not every second while the hosts do not answer",
        ("tests/unit/test_retry_backoff.py",),
    ),
    Mutant(
        "survey-backoff-kept-after-a-round-answered", STATE,
        "            s.survey_failures = 0\n",
        "            pass\n",
        "rule 12: a round every host answered ends the survey backoff",
        ("tests/unit/test_retry_backoff.py",),
    ),
    Mutant(
        "inline-confirm-while-the-server-is-silent", "services/reconciler/entries.py",
        "        if self.effects.reads_silent:\n",
        "        if False:\n",
        "a new pod is confirmed inline only while the API server answers; silent, the read goes to the outbox "
        "rather than hold the partition's inputs for its timeout",
        ("tests/reconciler/test_effects_parked.py",),
    ),
    Mutant(
        "an-early-write-goes-early-again-at-others-pace", "services/reconciler/silence.py",
        "        if (key, kind) in self._early:\n            return False\n",
        "",
        "a write that went early and failed again waits out its own delay before it goes early again: where "
        "the API server answers other keys' writes and not its own (a webhook of one namespace), it must "
        "not be written at their pace",
        ("tests/reconciler/test_silence.py",),
    ),
    Mutant(
        "a-read-answered-fires-the-writes", "services/reconciler/effects.py",
        "            for parked, _ in self.reads.release():\n",
        "            self._heard(self.writes, True, key)\n            self.fire_server_waits()\n"
        "            for parked, _ in self.reads.release():\n",
        "the API server may answer reads and not writes (a webhook that times out): a read's answer does not "
        "release the writes that wait for a write's",
        ("tests/reconciler/test_silence.py",),
    ),
    Mutant(
        "a-canary-held-to-its-delay", "services/reconciler/silence.py",
        "        del self._waiting[ident]\n",
        "        self._early.add((ident[0], self._waiting.pop(ident)))\n",
        "a canary that failed is released with the rest when the server answers: held to its own delay, the "
        "keys that served as canaries during a silence were written up to 30 s after it ended",
        ("tests/reconciler/test_silence.py",),
    ),
    Mutant(
        "a-retry-armed-after-the-silence-ended-waits-its-backoff", "services/reconciler/silence.py",
        "        if self._failed_in.get(key, self._ended) < self._ended:\n",
        "        if False:\n",
        "a write that failed in a silence which another write's answer ended before its retry was armed goes "
        "at once: no answer is coming for it to wait for (in bench waiting, about a hundred of 2 000 pods "
        "were written 30 s after the server came back)",
        ("tests/reconciler/test_silence.py",),
    ),
    Mutant(
        "a-failed-status-write-retried-beside-a-newer-one", DECIDE_WRITES,
        "    if write.verb == \"status\" and status_write_out(run.s, cur.fence):\n",
        "    if False:\n",
        "rule 12: a failed status write is not retried while a newer one is out or a rewrite is armed; each "
        "status change during an API-server outage kept a write and a rewrite of its own",
        ("tests/unit/test_no_amplification.py", "tests/unit/test_rewrite_backoff.py"),
    ),
    Mutant(
        "a-status-rewrite-beside-a-newer-write", DECIDE_TIMERS,
        "    if status_write_out(run.s, cur.fence):\n        return\n    status = wanted_status",
        "    status = wanted_status",
        "rule 12: a status rewrite that finds a newer status write out leaves it to that one, not a "
        "second write beside it",
        ("tests/unit/test_rewrite_backoff.py",),
    ),
    Mutant(
        "an-inventory-round-unpaced", "services/agent/rounds.py",
        "    pace = Pace(max(rate, len(named) / within_s) if rate > 0 else 0.0)\n",
        "    pace = Pace(0.0)\n",
        "a host's inventory round goes at --inventory-rate: all at once, it queued every pod's input behind "
        "it at the reconcilers (p99 to Bound 0.25 s at 50 pods/s, 25 ms paced)",
        ("tests/agent/test_reports.py", "tests/agent/test_pace.py"),
    ),
    Mutant(
        "a-paced-round-names-a-vm-removed-meanwhile", "services/agent/rounds.py",
        "        elif vm_id in in_ledger:\n",
        "        elif False:\n",
        "a paced round reads each VM from the ledger when its item goes: a VM removed since the round began "
        "is not named (a stale running for a VM the log forgot is discovered and removed again)",
        ("tests/agent/test_reports.py",),
    ),
    Mutant(
        "an-inventory-round-outlasts-its-interval", "services/agent/rounds.py",
        "max(rate, len(named) / within_s) if rate > 0",
        "rate if rate > 0",
        "a round is paced no slower than its interval allows: a host with more VMs than the rate times the "
        "interval had rounds far apart, past the reconciler's stale sweep, which inspects VMs no round named",
        ("tests/agent/test_pace.py",),
    ),
)
