"""`vmfence decisions`: print (and follow) decisions from the log, one line each."""

from __future__ import annotations

import argparse
import contextlib
import sys

import msgspec
from rich.console import Console

from services.cli.common import open_bus
from shared.bus.logstream import Filter, follow_log, read_log
from shared.fence.schema import Commanded, Decision, Skipped, decision_name


def add_parsers(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("decisions", help="print decisions from the log, optionally following it")
    p.add_argument("--nats")
    p.add_argument("--key")
    p.add_argument("--namespace")
    p.add_argument("--host")
    p.add_argument("--since", type=float, metavar="SECONDS", help="start this many seconds back (with --follow)")
    p.add_argument("--follow", "-f", action="store_true")
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=decisions)


def describe(d: Decision) -> str:
    name = decision_name(d)
    match d:
        case Commanded(command=c):
            return f"{name} {c.op} {c.vm_id} on {c.host} [{c.fence.uid[:8]}/e{c.fence.epoch}]"
        case Skipped(reason=r, uid=uid, detail=detail):
            return f"{name}({r}) {uid or ''} {detail}".rstrip()
    fence = getattr(d, "fence", None)
    extra = " ".join(
        str(getattr(d, f)) for f in ("vm_id", "host", "reason", "snapshot") if getattr(d, f, None)
    )
    tag = f" [{fence.uid[:8]}/e{fence.epoch}]" if fence is not None else ""
    return f"{name}{(' ' + extra) if extra else ''}{tag}"


async def decisions(args: argparse.Namespace) -> int:
    flt = Filter(key=args.key, namespace=args.namespace, host=args.host)
    bus = await open_bus(args.nats, "vmfence-decisions")
    console = Console()
    try:
        if args.follow:
            source = follow_log(bus.js, bus.subjects, flt, since_s=args.since)
        else:
            source = read_log(bus.js, bus.subjects, flt)
        async with contextlib.aclosing(source) as records:
            async for rec in records:
                if args.json:
                    sys.stdout.write(msgspec.json.encode(rec).decode() + "\n")
                    sys.stdout.flush()
                else:
                    for d in rec.entry.decisions:
                        console.print(f"{rec.seq:>8} {rec.entry.key}#{rec.entry.n} {describe(d)}", highlight=False)
    finally:
        await bus.close()
    return 0
