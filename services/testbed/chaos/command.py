"""`vmfence chaos`: the fault campaigns' command line (processes, compose containers, seeded model,
seeded stack)."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any

from shared.tasks import run_main


def add_parsers(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("chaos", help="fault campaigns: --processes (real processes), --compose (compose.yaml's "
                                     "containers) or --seeds (deterministic)")
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--processes", action="store_true", help="real processes, SIGKILLs, an OS-level oracle")
    mode.add_argument("--compose", action="store_true",
                      help="compose.yaml's stack in podman containers (make images first): podman kill, network "
                           "partitions and pauses, an oracle on the host's process table")
    p.add_argument("--stack", action="store_true",
                   help="with --seeds/--seed: seeded workload and faults against the real in-process stack")
    p.add_argument("--hostile", action="store_true",
                   help="with --seeds/--seed: hostile messages from every identity and hostile pods against a "
                        "real local stack")
    mode.add_argument("--seeds", type=int, metavar="N", help="deterministic campaign over N seeds (chaos_sim)")
    mode.add_argument("--seed", type=int, metavar="S", help="deterministic campaign, one seed (chaos_sim)")
    p.add_argument("--first", type=int, default=0, help="(--stack --seeds N) the first of the N seeds")
    p.add_argument("--steps", type=int, default=None, help="(--seeds/--seed) steps per seed")
    p.add_argument("--keys", type=int, default=None, help="(--seeds/--seed) pod keys per seed")
    p.add_argument("--minutes", type=float, default=2.0, help="(--processes) how long faults and churn run")
    p.add_argument("--runtime", default="auto", choices=["auto", "sim", "qemu"])
    p.add_argument("--pods", type=int, default=6, help="pod names that churn")
    p.add_argument("--kill-every", type=float, default=4.0, help="mean seconds between SIGKILLs")
    p.add_argument("--min-kills", type=int, default=0,
                   help="(--processes) keep faults and churn going past --minutes until this many SIGKILLs happened "
                        "(at most 30 s longer per kill asked for)")
    p.add_argument("--churn-every", type=float, default=1.0, help="mean seconds between pod operations")
    p.add_argument("--stale-reads", type=int, default=3, help="API server lagging-cache depth during churn (0: off)")
    p.add_argument("--settle-timeout", type=float, default=180.0, help="seconds allowed to quiesce at the end")
    p.add_argument("--rng-seed", type=int, default=None, help="seed of the kill/churn schedule (default: random)")
    p.add_argument("--dir", default=".vmfence/chaos", help="run directory (removed first)")
    p.add_argument("--keep", action="store_true", help="keep the run directory (logs) after a clean run")
    p.add_argument("--targets", default="all",
                   help="comma-separated kinds to SIGKILL: apiserver,watcher,reconciler,agent,nats (default all)")
    p.add_argument("--plan", default="",
                   help="(--compose) these faults in order, then none: KIND:TARGET,... with KIND kill, partition or "
                        "pause and TARGET agent, nats, reconciler, watcher, apiserver or a service name "
                        "(default: seeded random faults for --minutes)")
    p.add_argument("--project", default="vmfence-chaos",
                   help="(--compose) the compose project name (its containers, volumes and networks)")
    p.add_argument("--fault-every", type=float, default=4.0,
                   help="(--compose) mean seconds between one fault's end and the next fault")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    p.set_defaults(run=run_chaos)


def run_chaos(args: argparse.Namespace) -> int:
    if args.compose:
        return _run_compose_campaign(args)
    if not args.processes:
        return _run_sim_campaign(args)
    from services.testbed.chaos.processes import ProcessChaos

    try:
        result = run_main(ProcessChaos(args).run())
    except (RuntimeError, TimeoutError, OSError) as exc:
        print(f"vmfence chaos: {exc}", file=sys.stderr)
        return 1
    except asyncio.CancelledError:
        print("vmfence chaos: interrupted; every process it started was stopped", file=sys.stderr)
        return 130
    if args.json:
        sys.stdout.write(json.dumps(result) + "\n")
        sys.stdout.flush()  # the verdict is out even if the interpreter's exit is slow
    else:
        _print_human(result)
    return 0 if result["ok"] else 1


def _run_compose_campaign(args: argparse.Namespace) -> int:
    from services.testbed.chaos.compose import ComposeError, parse_plan, run_compose_chaos

    try:
        parse_plan(args.plan)
    except ValueError as exc:
        print(f"vmfence chaos: {exc}", file=sys.stderr)
        return 2
    if args.dir == ".vmfence/chaos":
        args.dir = ".vmfence/chaos-compose"
    try:
        result = run_compose_chaos(args)
    except (ComposeError, RuntimeError, TimeoutError, OSError) as exc:
        print(f"vmfence chaos: {exc}", file=sys.stderr)
        return 1
    except asyncio.CancelledError:
        print("vmfence chaos: interrupted; the compose stack was taken down", file=sys.stderr)
        return 130
    if args.json:
        sys.stdout.write(json.dumps(result) + "\n")
        sys.stdout.flush()
    else:
        _print_human(result)
        for k in ("containers", "partitions", "pauses"):
            print(f"{k:>26}: {result.get(k)}")
    return 0 if result["ok"] else 1


def _run_stack_campaign(args: argparse.Namespace) -> int:
    from services.testbed.chaos.stack import run_stack_campaign

    seeds = 1 if args.seed is not None else int(args.seeds or 0)
    first = args.seed if args.seed is not None else args.first
    steps = int(getattr(args, "steps", None) or 25)
    def progress(line: str) -> None:
        if not args.quiet:
            print(f"[chaos --stack] {line}", file=sys.stderr, flush=True)

    result = run_main(run_stack_campaign(seeds, first, steps, root=args.dir + "-stack", progress=progress))
    sys.stdout.write(json.dumps(result) + "\n")
    return 1 if result["failures"] or result["violations"] or result["lost_inputs"] else 0


def _run_hostile_campaign(args: argparse.Namespace) -> int:
    from services.testbed.chaos.hostile import run_hostile_campaign

    seeds = 1 if args.seed is not None else int(args.seeds or 0)
    first = args.seed if args.seed is not None else args.first

    def progress(line: str) -> None:
        if not args.quiet:
            print(f"[chaos --hostile] {line}", file=sys.stderr, flush=True)

    result = run_main(run_hostile_campaign(seeds, first, root=args.dir + "-hostile", progress=progress))
    sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()
    return 0 if result["ok"] else 1


def _run_sim_campaign(args: argparse.Namespace) -> int:
    if getattr(args, "hostile", False):
        return _run_hostile_campaign(args)
    if getattr(args, "stack", False):
        return _run_stack_campaign(args)
    from services.testbed.chaos import seeds

    return seeds.run_campaign(args)


def _print_human(result: dict[str, Any]) -> None:
    keys = ("runtime", "minutes", "seconds", "kills", "pods_churned", "max_vms_per_key", "max_vms_per_incarnation",
            "leaked_vms", "lost_inputs", "oracle_samples", "quiesced")
    for k in keys:
        print(f"{k:>26}: {result.get(k)}")
    for v in result["violations"]:
        print(f"VIOLATION {v}")
    print("OK" if result["ok"] else "INVARIANT BROKEN")


# ------------------------------------------------------------------------------- processes
