"""The test bench's commands (demo, up, chaos, bench), registered with the ``vmfence`` entry point
through the ``vmfence.commands`` entry-point group declared in pyproject.toml.

Only the parsers are built here; a command's module (which may start whole stacks and import every
service) is imported when that command runs, so `vmfence replay` and the other operator commands
neither pay for the bench nor depend on it importing cleanly.
"""

from __future__ import annotations

import argparse

from services.testbed.bench.suite import ALL_FIGURES, SIZES
from services.testbed.chaos import command as chaos


def _run_demo(args: argparse.Namespace) -> int:
    from services.testbed.demo import run_demo

    return run_demo(args)


def _run_up(args: argparse.Namespace) -> int:
    from services.testbed.demo import run_up

    return run_up(args)


def add_demo_parsers(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("demo", help="a local stack and the race scenarios, ending with the audit")
    p.add_argument("--pods", type=int, default=6, help="steady pods besides the race scenarios")
    p.add_argument("--runtime", default="auto", choices=["auto", "sim", "qemu"],
                   help="VM runtime: qemu if installed (auto), or the simulated one")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout, nothing else")
    p.add_argument("--dir", default=".vmfence/demo", help="where the stack keeps its files")
    p.set_defaults(run=_run_demo)
    u = sub.add_parser("up", help="the whole stack on this machine, in the foreground")
    u.add_argument("--runtime", default="auto", choices=["auto", "sim", "qemu"],
                   help="VM runtime: qemu if installed (auto), or the simulated one")
    u.add_argument("--kubeconfig", help="use this cluster instead of starting a control plane")
    u.add_argument("--control-plane", choices=["dev", "kube"], default="dev",
                   help="without --kubeconfig: the development API server (dev), or the real etcd, "
                        "kube-apiserver, kube-scheduler and kube-controller-manager built by `make kube` (kube)")
    u.add_argument("--kubeconfig-out", default=".vmfence/kubeconfig", help="write a kubeconfig for kubectl here")
    u.add_argument("--dir", default=".vmfence/run", help="where the stack keeps its files")
    u.set_defaults(run=_run_up)


def _bench_decisions(args: argparse.Namespace) -> int:
    from services.testbed.bench.command import bench_decisions

    return bench_decisions(args)


def _bench_vm(args: argparse.Namespace) -> int:
    from services.testbed.bench.command import bench_vm

    return bench_vm(args)


def _bench_all(args: argparse.Namespace) -> int:
    if args.control_plane == "kube":
        from services.testbed.bench.kube import bench_all_kube

        return bench_all_kube(args)
    from services.testbed.bench.suite import bench_all

    return bench_all(args)


def _bench_replay(args: argparse.Namespace) -> int:
    from services.testbed.bench.replayfile import replay_bench
    from services.testbed.output import emit

    emit(replay_bench(args.entries), args.json)
    return 0


def _bench_append(args: argparse.Namespace) -> int:
    from services.testbed.bench.appendbatch import run_append_bench
    from services.testbed.output import emit
    from shared.tasks import run_main

    emit(run_main(run_append_bench(args.keys, args.batch, args.rounds)), args.json)
    return 0


def add_bench_parsers(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("bench", help="benchmarks (JSON results)")
    bsub = p.add_subparsers(dest="bench", metavar="BENCH")
    d = bsub.add_parser("decisions", help="keys through the reconciler vs raw JetStream publish")
    d.add_argument("--keys", type=int, default=1000, help="pod keys taken to bound")
    d.add_argument("--partitions", type=int, default=16, help="partitions of the streams")
    d.add_argument("--json", action="store_true", help="one JSON object on stdout")
    d.set_defaults(run=_bench_decisions)
    v = bsub.add_parser("vm", help="VM create/hibernate/wake latency vs a bare qemu")
    v.add_argument("--runtime", default="qemu", help="qemu or sim")
    v.add_argument("--count", type=int, default=5, help="VMs taken through the lifecycle")
    v.add_argument("--guest-boots", type=int, default=3, help="guest VMs booted for guest_boot_p50_s (qemu)")
    v.add_argument("--network", default="user", choices=("user", "bridge"),
                   help="bridge: also create-to-reachable on a pod network bridge vs a bare QEMU on the same tap")
    v.add_argument("--json", action="store_true", help="one JSON object on stdout")
    v.set_defaults(run=_bench_vm)
    r = bsub.add_parser("replay", help="replay of an export file of N entries vs decoding the same file")
    r.add_argument("--entries", type=int, default=100_000, help="entries in the generated log")
    r.add_argument("--json", action="store_true", help="one JSON object on stdout")
    r.set_defaults(run=_bench_replay)
    b = bsub.add_parser("append", help="fenced log appends one request each vs JetStream atomic batches")
    b.add_argument("--keys", type=int, default=400, help="keys appended to once per round, concurrently")
    b.add_argument("--batch", type=int, default=20, help="appends (of distinct keys) per atomic batch")
    b.add_argument("--rounds", type=int, default=100, help="rounds: every key appends once per round")
    b.add_argument("--json", action="store_true", help="one JSON object on stdout")
    b.set_defaults(run=_bench_append)
    a = bsub.add_parser("all", help="every figure beside a baseline from the same run (JSON)")
    a.add_argument("--size", choices=sorted(SIZES), default="smoke", help="smoke (CI), or larger runs")
    a.add_argument("--only", default=",".join(ALL_FIGURES), help=f"comma-separated subset of {','.join(ALL_FIGURES)}")
    a.add_argument("--pods", type=int, help="override the size's pod count (pods/decisions figures)")
    a.add_argument("--control-plane", choices=["dev", "kube"], default="dev",
                   help="the development API server (dev), or the real control plane of `make kube` "
                        "(kube: the pods and latency figures only, beside a bare real API server)")
    a.add_argument("--sim-persist", action="store_true",
                   help="keep the sim driver's per-op host file (O(ops) per op; see docs/benchmarks.md)")
    a.add_argument("--json", action="store_true", help="one JSON object on stdout")
    a.set_defaults(run=_bench_all)


def add_parsers(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    add_demo_parsers(sub)
    chaos.add_parsers(sub)
    add_bench_parsers(sub)
