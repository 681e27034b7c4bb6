"""`vmfence replay` and `vmfence export`: folding and auditing the whole log, and backing it up."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import sys
import time
from pathlib import Path
from typing import BinaryIO

import msgspec
from rich.console import Console
from rich.table import Table

from services.cli.common import CliError, open_bus
from shared.bus.logstream import EXPORT_MAGIC, Record, audit_records, encode_record, iter_export, read_log
from shared.fence.audit import Auditor, AuditReport


def add_parsers(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("replay", help="fold the whole log and check the invariants (exit 1 on a violation)")
    p.add_argument("--nats-url", "--nats", dest="nats", help="NATS URL (default: VMFENCE_NATS_URL or the local stack)")
    p.add_argument("--file", help="replay an export file instead of JetStream ('-': standard input)")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    p.add_argument("--html", metavar="FILE", help="also write a self-contained HTML audit report")
    p.add_argument("--not-final", action="store_true", help="the system is still running: skip end checks")
    p.set_defaults(run=replay)

    p = sub.add_parser("export", help="write the whole log to a file that `replay --file` reads")
    p.add_argument("--nats-url", "--nats", dest="nats", help="NATS URL (default: VMFENCE_NATS_URL or the local stack)")
    p.add_argument("-o", "--output", default="-", help="the file to write ('-', the default: standard output)")
    p.set_defaults(run=export)


def _read_export(path: str) -> bytes:
    """An export file's bytes; ``-`` reads standard input (``vmfence export | vmfence replay --file -``)."""
    if path == "-":
        return sys.stdin.buffer.read()
    return Path(path).read_bytes()


async def _records(args: argparse.Namespace) -> list[Record]:
    if args.file:
        try:
            data = await asyncio.to_thread(_read_export, args.file)
            return list(iter_export(data))
        except (OSError, ValueError) as exc:
            raise CliError(f"cannot read {args.file}: {exc}") from None
    bus = await open_bus(args.nats, "vmfence-replay")
    try:
        return [r async for r in read_log(bus.js, bus.subjects)]
    finally:
        await bus.close()


async def _audit_streaming(args: argparse.Namespace) -> AuditReport:
    """Feed the auditor as entries arrive: no list of every record (whose growth made the garbage
    collector dominate replays of large logs)."""
    auditor = Auditor()
    if args.file:
        try:
            data = await asyncio.to_thread(_read_export, args.file)
            for rec in iter_export(data):
                auditor.feed(rec.entry, rec.seq)
        except (OSError, ValueError) as exc:
            raise CliError(f"cannot read {args.file}: {exc}") from None
    else:
        bus = await open_bus(args.nats, "vmfence-replay")
        try:
            async for rec in read_log(bus.js, bus.subjects):
                auditor.feed(rec.entry, rec.seq)
        finally:
            await bus.close()
    return auditor.report(final=not args.not_final)


async def replay(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    # What exists now is long-lived, and decoded entries are never cyclic garbage (refcounting frees
    # them): the cyclic collector would only re-walk the auditor's growing state, so it is off for
    # the length of the audit.
    gc.freeze()
    gc.disable()
    records: list[Record] = []
    try:
        if args.html:
            records = await _records(args)
            report = audit_records(records, final=not args.not_final)
        else:
            report = await _audit_streaming(args)
    finally:
        gc.enable()
    seconds = time.perf_counter() - start
    if args.html:
        from services.cli.report import write_html

        try:
            write_html(args.html, records, report)
        except OSError as exc:
            raise CliError(f"cannot write {args.html}: {exc.strerror or exc}") from None
    if args.json:
        out = msgspec.to_builtins(report)
        out["clean"] = report.clean
        out["seconds"] = round(seconds, 6)
        sys.stdout.write(msgspec.json.encode(out).decode() + "\n")
    else:
        _print_report(report, seconds)
    return 0 if report.clean else 1


def _print_report(report: AuditReport, seconds: float) -> None:
    console = Console()
    table = Table(title="vmfence audit", show_header=False)
    table.add_row("keys", str(report.keys))
    table.add_row("entries", str(report.entries))
    table.add_row("decisions", str(report.decisions))
    table.add_row("VMs created / released", f"{report.vms_created} / {report.vms_released}")
    table.add_row("VMs bound to live incarnations", str(report.vms_bound_live))
    for reason, n in sorted(report.skipped.items()):
        table.add_row(f"skipped: {reason}", str(n))
    verdict = "[green]clean[/green]" if report.clean else f"[red]{len(report.violations)} violation(s)[/red]"
    table.add_row("verdict", verdict)
    table.add_row("seconds", f"{seconds:.2f}")
    console.print(table)
    for v in report.violations:
        console.print(f"[red]VIOLATION[/red] {v.rule}: key {v.key} entry {v.n}"
                      + (f" (stream seq {v.seq})" if v.seq else "") + f": {v.message}")


async def export(args: argparse.Namespace) -> int:
    bus = await open_bus(args.nats, "vmfence-export")
    n = 0
    to_stdout = args.output == "-"
    try:
        with contextlib.ExitStack() as stack:
            # streamed while the log is read
            f: BinaryIO = sys.stdout.buffer if to_stdout else stack.enter_context(open(args.output, "wb"))  # noqa: ASYNC230
            f.write(EXPORT_MAGIC)
            async for rec in read_log(bus.js, bus.subjects):
                f.write(encode_record(rec))
                n += 1
            f.flush()
    except BrokenPipeError:
        raise CliError("the reader of standard output went away before the export ended") from None
    except OSError as exc:
        raise CliError(f"cannot write {args.output}: {exc.strerror or exc}") from None
    finally:
        await bus.close()
    print(f"exported {n} entries to {'standard output' if to_stdout else args.output}", file=sys.stderr)
    return 0
