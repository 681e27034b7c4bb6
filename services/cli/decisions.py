"""`vmfence decisions`: print (and follow) decisions from the log, one line each.

Plain text, never markup: a fence like ``[e1b2c3d4/e1]`` is data, and every uid shows whatever its
first character (rich took ``[abc…]`` for a style tag and dropped it). Lines are never wrapped or cut
by the program; a header names the columns.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import sys
import time
from collections.abc import Iterator
from typing import TextIO

import msgspec

from services.cli.common import CliError, open_bus
from shared.bus.logstream import Filter, Record, Since, follow_log, parse_since, read_log
from shared.fence.keys import Key
from shared.fence.schema import Commanded, Decision, Skipped, decision_name

COLUMNS = ("SEQ", "TIME", "KEY", "FENCE", "DECISION", "REASON")
WIDTHS = (8, 24, 28, 14, 40)  # the last column takes what it needs
_DETAIL_FIELDS = ("op", "vm_id", "host", "snapshot", "outcome", "effect_id")
_REASON_FIELDS = ("reason", "message", "detail")


def add_parsers(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("decisions", help="print decisions from the log, optionally following it")
    p.add_argument("--nats-url", "--nats", dest="nats", help="NATS URL (default: VMFENCE_NATS_URL or the local stack)")
    p.add_argument("--key", help="one key: namespace/name, or vm:namespace/name for a VirtualMachine")
    p.add_argument("--namespace", help="keys of this namespace only")
    p.add_argument("--host", help="decisions naming this host only")
    p.add_argument("--since", metavar="WHEN",
                   help="start at a stream sequence (123), a duration back (90s, 10m, 2h, 1d) or an RFC 3339 time")
    p.add_argument("--follow", "-f", action="store_true", help="keep printing decisions as they are appended")
    p.add_argument("--json", action="store_true", help="one JSON object per entry, with the columns' text")
    p.set_defaults(run=decisions)


def describe(d: Decision) -> str:
    """One decision in a few words, with its fence: the HTML report's and the chaos logs' form."""
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


def stamp(t: float) -> str:
    """A UTC time to the millisecond, ``-`` when not known."""
    if t <= 0:
        return "-"
    return datetime.datetime.fromtimestamp(t, datetime.UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def columns(rec: Record, d: Decision) -> dict[str, str]:
    """The text of one decision's row, by column name (the JSON form carries the same)."""
    fence = d.command.fence if isinstance(d, Commanded) else getattr(d, "fence", None)
    source = d.command if isinstance(d, Commanded) else d
    details = [str(getattr(source, f)) for f in _DETAIL_FIELDS if getattr(source, f, None)]
    if isinstance(d, Skipped) and d.uid:
        details.append(f"uid {d.uid}")
    reasons = [str(getattr(d, f)) for f in _REASON_FIELDS if getattr(d, f, None)]
    return {
        "SEQ": str(rec.seq),
        "TIME": stamp(rec.written_at()),
        "KEY": f"{rec.entry.key}#{rec.entry.n}",
        "FENCE": f"{fence.uid[:8]}/e{fence.epoch}" if fence is not None else "-",
        "DECISION": " ".join([decision_name(d), *details]),
        "REASON": " ".join(reasons) or "-",
    }


def format_row(cells: dict[str, str] | tuple[str, ...]) -> str:
    values = tuple(cells[c] for c in COLUMNS) if isinstance(cells, dict) else cells
    padded = [v.ljust(w) for v, w in zip(values, WIDTHS, strict=False)]
    return "  ".join([*padded, *values[len(WIDTHS):]]).rstrip()


def lines(rec: Record) -> Iterator[str]:
    if rec.error:  # a stored entry that did not decode: shown where it is, not skipped
        yield format_row({"SEQ": str(rec.seq), "TIME": stamp(rec.ts), "KEY": rec.entry.key, "FENCE": "-",
                          "DECISION": "UNDECODABLE", "REASON": rec.error})
    for d in rec.entry.decisions:
        yield format_row(columns(rec, d))


def _json_line(rec: Record) -> str:
    out = msgspec.to_builtins(rec)
    out["time"] = stamp(rec.written_at())
    out["rows"] = [columns(rec, d) for d in rec.entry.decisions]
    return msgspec.json.encode(out).decode()


def _options(args: argparse.Namespace) -> tuple[Filter, Since | None]:
    if args.key is not None:
        try:
            Key.parse(args.key)
        except ValueError as exc:
            raise CliError(str(exc)) from None
    since = None
    if args.since is not None:
        try:
            since = parse_since(args.since, time.time())
        except ValueError as exc:
            raise CliError(str(exc)) from None
    return Filter(key=args.key, namespace=args.namespace, host=args.host), since


async def decisions(args: argparse.Namespace, out: TextIO | None = None) -> int:
    flt, since = _options(args)
    out = sys.stdout if out is None else out
    bus = await open_bus(args.nats, "vmfence-decisions")
    try:
        if args.follow:
            source = follow_log(bus.js, bus.subjects, flt, since=since)
        else:
            source = read_log(bus.js, bus.subjects, flt, since=since)
        if not args.json:
            out.write(format_row(COLUMNS) + "\n")
        async with contextlib.aclosing(source) as records:
            async for rec in records:
                if args.json:
                    out.write(_json_line(rec) + "\n")
                else:
                    out.writelines(line + "\n" for line in lines(rec))
                out.flush()
    except BrokenPipeError:  # `vmfence decisions | head`: the reader has all it wanted
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), out.fileno())  # no second error at exit
        return 0
    finally:
        await bus.close()
    return 0
