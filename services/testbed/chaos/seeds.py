"""`vmfence chaos --seeds N [--seed S] --json`: the deterministic fault campaign.

One seed fully determines a run: the workload, the fault schedule and the order in which every
in-flight message (inputs, commands, reads, writes, timers) is delivered — the world is
``services.testbed.world.World`` around the real ``decide``/``fold``/``audit``. Oracles, checked at
every step and at quiescence: at most one VM per key in the agents' own records; the audit of the log
(every command under the fence current at its position, results matching their commands, no
tombstoned uid acted for, contiguous per-key logs); every input delivered and decided; after the
faults stop, exactly one VM per live pod and none for dead ones. A failing seed prints the command
that replays it.

What this campaign is and is not: it searches the *policy* (decide/fold and the effect protocol)
under every interleaving of a modelled environment, thousands of seeds a minute. It does not run
the real services or NATS; ``vmfence chaos --processes`` does that with real processes and SIGKILLs.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from services.testbed.world import World
from shared.fence.schema import Spec

# The fault kinds of the campaign and how the schedule generator reaches each (issue 6, §1).
FAULTS: dict[str, str] = {
    "recreate_then_stale_deleting": "1: same-name recreate, then a stale read of the old uid deleting",
    "stale_own_write": "2: stale read of our own write (an older observation redelivered)",
    "conflict_on_write": "3: 409 on the write that records the VM (gateway gives up: failed)",
    "write_response_lost": "4: write applied, response lost, retried",
    "delete_retried_after_recreate": "5: delete of uid1 times out, recreate uid2, delete retried",
    "reconciler_crash": "6/7/13: reconciler crash after any append or effect; restart from the log",
    "agent_crash_before_report": "8: agent crash between effect and report (redelivery)",
    "duplicate": "9/22: duplicate delivery of inputs, commands, reports (also after dedupe window)",
    "reorder": "10/16: any in-flight message delivered out of order",
    "unobserved_delete": "11: deletion of uid1 never seen, only uid2",
    "relist_missing": "12: relist that misses an object that still exists",
    "split_brain": "14/18: a second writer with a stale copy appends with a stale position",
    "agent_partitioned": "15: an agent's messages held back, then delivered",
    "log_tail_lost": "17: loss of a key's log tail; rebuilt from Kubernetes and inventories",
    "fast_churn": "19: many incarnations of one key inside one decision's latency",
    "stuck_terminating": "20: pod stuck terminating (finalizer), then recreated",
    "timer_early": "21: clock jumps: timers fire whenever",
    "vm_crash": "23 (and rule 7): VM killed, possibly while its status write conflicts",
    "vm_lost": "rule 7: a VM the runtime forgot",
    "hibernate": "rule 10: hibernate and wake",
    "inventory": "rule 8: agent inventory rounds",
}

# Opt-in (``campaign(..., unseen_cuts=True)``, or VMFENCE_CHAOS_UNSEEN_CUTS=1 for the CLI): not in the
# default schedule, which it would reshuffle (the regression seeds replay that schedule), and not
# green at every seed (docs/chaos.md, "Cuts nobody saw"). A cut no reconciler saw is found from the
# agents (decide.cut_evidence: a fence above the log's epoch, or its newest epoch under another uid)
# and by the survey every key loaded from the log sends before its first VM. Still open: a VMGone
# whose entry was lost (nothing reports a lost VM again), and a lost create under exactly the fence
# the cut log re-admits, in flight past the survey while the cut log places the VM on another host.
OPT_IN_FAULTS: dict[str, str] = {
    "log_tail_lost_unseen": "17: a lost log tail no reconciler saw (restart without its data dir)",
}


@dataclass
class SeedResult:
    seed: int
    steps: int
    faults: Counter[str] = field(default_factory=Counter)
    failure: str | None = None


def run_seed(
    seed: int, *, steps: int = 60, keys: int = 2, exclude: frozenset[str] = frozenset(), unseen_cuts: bool = False,
) -> SeedResult:
    rng = random.Random(seed)
    # the unseen-cut variant also spreads VMs over the hosts: a cut nobody saw is most dangerous
    # when the next VM lands on a host that never saw the lost tail's epochs
    world = World(keys=keys, vm_keys=1 if rng.random() < 0.3 else 0, spread=unseen_cuts)
    result = SeedResult(seed, 0)
    try:
        for _ in range(steps):
            _step(world, rng, result.faults, exclude, unseen_cuts=unseen_cuts)
            result.steps += 1
            if world.max_vms_per_key > 1:
                raise AssertionError("two VMs for one key at once (agents' own records)")
        # faults stop: deliver everything, then one more inventory round heals what a lost tail hid
        world.settle(limit=20000)
        world.inventory()
        for key in world.keys:
            world.relist_current(key)
        world.settle(limit=20000)
        _check_quiescent(world)
    except AssertionError as exc:
        result.failure = str(exc) or type(exc).__name__
    for k, v in world.faults.items():
        result.faults[k] += v
    return result


def _step(
    world: World, rng: random.Random, faults: Counter[str], exclude: frozenset[str] = frozenset(),
    *, unseen_cuts: bool = False,
) -> None:
    key = rng.choice(world.keys)
    roll = rng.random()
    if roll < 0.45:
        world.deliver(rng.randrange(1 << 20))
        faults["reorder"] += 1
        return
    kind = rng.choice(
        ["create", "create", "delete", "recreate", "recreate_adopt", "unobserved_delete", "stale",
         "stale_deleting", "duplicate", "drop_report", "crash_reconciler", "lose_tail", "split_brain",
         "conflict", "lost_response", "relist_missing", "finalizer", "clear_finalizer", "vm_crash", "vm_lost",
         "hibernate", "wake", "inventory", "churn", "partition_agent"]
        + (["lose_tail_unseen"] if unseen_cuts else [])
    )
    if kind in exclude:
        return
    match kind:
        case "create":
            world.create(key)
        case "delete":
            world.delete(key)
        case "recreate" | "recreate_adopt":
            world.force_delete(key)
            world.create(key, Spec(on_recreate="adopt" if kind == "recreate_adopt" else "replace"))
            faults["delete_retried_after_recreate"] += 1
        case "unobserved_delete":
            world.force_delete(key, observed=False)
            world.create(key)
            faults["unobserved_delete"] += 1
        case "stale":
            world.stale_replay(key, rng.randrange(5))
            faults["stale_own_write"] += 1
        case "stale_deleting":
            world.stale_deleting(key)
            faults["recreate_then_stale_deleting"] += 1
        case "duplicate":
            world.deliver(rng.randrange(1 << 20), duplicate=True)
            faults["duplicate"] += 1
        case "drop_report":
            world.deliver(rng.randrange(1 << 20), drop_report=True)
            faults["agent_crash_before_report"] += 1
        case "crash_reconciler":
            world.crash_reconciler()
            faults["reconciler_crash"] += 1
        case "lose_tail":
            world.lose_log_tail(key, rng.randrange(1, 4))
            faults["log_tail_lost"] += 1
        case "lose_tail_unseen":
            world.lose_log_tail_unseen(key, rng.randrange(1, 4))
            faults["log_tail_lost_unseen"] += 1
        case "split_brain":
            world.split_brain(key, rng.randrange(1, 4))
            faults["split_brain"] += 1
        case "conflict":
            world.write_faults.append("conflict")
            faults["conflict_on_write"] += 1
        case "lost_response":
            world.write_faults.append("lost")
            faults["write_response_lost"] += 1
        case "relist_missing":
            world.relist_missing(key)
            faults["relist_missing"] += 1
        case "finalizer":
            world.add_finalizer(key)
            faults["stuck_terminating"] += 1
        case "clear_finalizer":
            world.clear_finalizer(key)
        case "vm_crash":
            world.crash_vm(key)
            faults["vm_crash"] += 1
        case "vm_lost":
            world.lose_vm(key)
            faults["vm_lost"] += 1
        case "hibernate" | "wake":
            world.set_hibernate(key, kind == "hibernate")
            faults["hibernate"] += 1
        case "inventory":
            world.inventory()
            faults["inventory"] += 1
        case "churn":
            for _ in range(rng.randrange(2, 6)):
                world.force_delete(key, observed=rng.random() < 0.7)
                world.create(key)
            faults["fast_churn"] += 1
        case "partition_agent":
            # an agent's outbound messages sit in the bag; delivering others first is the partition
            for _ in range(rng.randrange(3, 10)):
                world.deliver(rng.randrange(1 << 20))
            faults["agent_partitioned"] += 1
    if kind not in ("partition_agent",) and rng.random() < 0.1:
        faults["timer_early"] += 1


def _check_quiescent(world: World) -> None:
    assert world.max_vms_per_key <= 1, "two VMs for one key at once (agents' own records)"
    report = world.audit()
    if not report.clean:
        v = report.violations[0]
        raise AssertionError(f"audit: {v.rule} at {v.key}#{v.n}: {v.message}")
    for key in world.keys:
        pod = world.pods.get(key)
        vms = world.vms_of(key)
        if pod is None or pod.deleting:
            if pod is None and vms:
                raise AssertionError(f"leaked VM for deleted {key}: {[vm.vm_id for vm in vms]}")
            continue
        cur = world.states[key].cur
        if cur is None or cur.fence.uid != pod.uid:
            raise AssertionError(f"{key}: live pod {pod.uid} is not the current incarnation")
        want = 0 if (pod.spec.hibernate or cur.phase in ("Failed", "Succeeded")) else 1
        if len(vms) != want:
            raise AssertionError(f"{key}: {len(vms)} VMs for a live pod, expected {want}")
        for vm in vms:
            if vm.owner.uid != cur.fence.uid:
                raise AssertionError(f"{key}: VM {vm.vm_id} owned by {vm.owner.uid}, not the live pod")


def run_campaign(args: Any) -> int:
    """`vmfence chaos --seeds N | --seed S [--steps K] [--keys K] [--json]`: prints the result,
    returns the exit code (1 if any seed broke an invariant)."""
    import json
    import os
    import sys

    steps, keys = int(getattr(args, "steps", None) or 60), int(getattr(args, "keys", None) or 2)
    unseen = bool(getattr(args, "unseen_cuts", False)) or os.environ.get("VMFENCE_CHAOS_UNSEEN_CUTS") == "1"
    result = campaign(int(args.seeds or 0), seed=args.seed, steps=steps, keys=keys, unseen_cuts=unseen)
    if getattr(args, "json", False):
        sys.stdout.write(json.dumps(result) + "\n")
    else:
        print(f"{result['seeds']} seeds, {result['steps']} steps, {result['fault_kinds_reached']}/"
              f"{result['fault_kinds']} fault kinds reached, {len(result['failures'])} failing "
              f"({result['seconds']}s)")
        for f in result["failures"]:
            print(f"  seed {f['seed']}: {f['invariant']}\n    replay: {f['replay']}")
    return 1 if result["failures"] else 0


def campaign(
    seeds: int, *, seed: int | None = None, steps: int = 60, keys: int = 2, unseen_cuts: bool = False,
) -> dict[str, Any]:
    start = time.perf_counter()
    chosen = [seed] if seed is not None else list(range(seeds))
    failures: list[dict[str, Any]] = []
    faults: Counter[str] = Counter()
    total_steps = 0
    for s in chosen:
        r = run_seed(s, steps=steps, keys=keys, unseen_cuts=unseen_cuts)
        total_steps += r.steps
        faults.update(r.faults)
        if r.failure is not None:
            failures.append({
                "seed": s, "invariant": r.failure,
                "replay": f"vmfence chaos --seed {s} --steps {steps} --keys {keys}",
            })
    return {
        "mode": "model",
        "unseen_cuts": unseen_cuts,
        "seeds": len(chosen),
        "failures": failures,
        "steps": total_steps,
        "faults_injected": dict(sorted(faults.items())),
        "fault_kinds_reached": sum(1 for k in FAULTS if faults.get(k)),
        "fault_kinds": len(FAULTS),
        "seconds": round(time.perf_counter() - start, 2),
    }
