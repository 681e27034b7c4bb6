"""`vmfence replay` and `vmfence export`: folding and auditing the whole log, and backing it up."""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.metadata
import os
import stat
import sys
import time
from typing import Any, BinaryIO

import msgspec
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from services.cli.common import CliError, open_bus
from services.cli.decisions import stamp
from services.cli.replayjobs import (
    MAX_JOBS,
    SHARDED_MIN_BYTES,
    AuditFeed,
    Merged,
    audit_file,
    default_jobs,
    peak_rss_kib,
)
from shared.bus.connect import mask_url
from shared.bus.logstream import EXPORT_MAGIC, Record, encode_record, iter_export_batches, read_log
from shared.fence.audit import Auditor, AuditReport


def add_parsers(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("replay", help="fold the whole log and check the invariants (exit 1 on a violation)")
    p.add_argument("--nats-url", "--nats", dest="nats", help="NATS URL (default: VMFENCE_NATS_URL or the local stack)")
    p.add_argument("--file", help="replay an export file instead of JetStream ('-': standard input)")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    p.add_argument("--html", metavar="FILE", help="also write a self-contained HTML audit report")
    p.add_argument("--not-final", action="store_true", help="the system is still running: skip end checks")
    p.add_argument("--jobs", type=_jobs, default=None, metavar="N",
                   help="processes for a file replay, each auditing a share of the keys (default: the CPUs "
                        f"this process may use, at most 8; 1: one process; files under "
                        f"{SHARDED_MIN_BYTES >> 20} MiB, standard input and --html always use one)")
    p.set_defaults(run=replay)

    p = sub.add_parser("export", help="write the whole log to a file that `replay --file` reads")
    p.add_argument("--nats-url", "--nats", dest="nats", help="NATS URL (default: VMFENCE_NATS_URL or the local stack)")
    p.add_argument("-o", "--output", default="-", help="the file to write ('-', the default: standard output)")
    p.set_defaults(run=export)


def _jobs(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of processes: {text!r}") from None
    if not 1 <= n <= MAX_JOBS:
        raise argparse.ArgumentTypeError(f"--jobs must be 1..{MAX_JOBS}, not {n}")
    return n


class Origin(msgspec.Struct):
    """Where the audited log came from, as a report names it."""

    source: str  # "file" or "jetstream"
    location: str  # the file ("-": standard input), or the NATS URL with any secret masked
    stream: str | None = None
    partitions: int | None = None
    first_seq: int = 0
    last_seq: int = 0
    first_time: str = "-"
    last_time: str = "-"


class AuditRun:
    """One replay: the feed of records into the auditor (or a sharded replay's merged result), and
    the log's origin and span as the report names them."""

    def __init__(self, origin: Origin, *, keep: bool) -> None:
        self.auditor = Auditor()
        self.origin = origin
        self.records: list[Record] | None = [] if keep else None
        self.feed = AuditFeed(self.auditor, self.records)
        self.feed_all = self.feed.feed_all
        self.violation_times = self.feed.violation_times
        self._merged: AuditReport | None = None  # a sharded replay's report, made by its processes
        self.jobs = 1
        self.shard_cpu_seconds = 0.0  # what the shard processes spent (the caller's CPU is apart)
        self.shard_peak_rss_kib = 0

    def take_merged(self, merged: Merged, jobs: int) -> None:
        """The result of a sharded replay of the whole log (``services.cli.replayjobs``)."""
        self._merged = merged.report
        self.violation_times = merged.violation_times
        f = self.feed
        f.first_seq, f.first_t, f.last_seq, f.last_t = merged.first_seq, merged.first_t, merged.last_seq, merged.last_t
        self.jobs, self.shard_cpu_seconds = jobs, merged.cpu_seconds
        self.shard_peak_rss_kib = merged.peak_rss_kib

    def report(self, *, final: bool) -> AuditReport:
        f, o = self.feed, self.origin
        o.first_seq, o.last_seq = f.first_seq, f.last_seq
        o.first_time, o.last_time = stamp(f.first_t), stamp(f.last_t)
        if self._merged is not None:
            return self._merged
        return self.auditor.report(final=final)


def _feed_export(run: AuditRun, path: str) -> None:
    """Feed an export file (``-``: standard input, as in ``vmfence export | vmfence replay --file -``)
    to the audit as it is read, a chunk at a time."""
    with contextlib.nullcontext(sys.stdin.buffer) if path == "-" else open(path, "rb") as f:
        for batch in iter_export_batches(f):
            run.feed_all(batch)


def _jobs_for(args: argparse.Namespace) -> int:
    """How many processes replay this file: one for a pipe, a small file or an HTML report (which
    needs every record in one process)."""
    jobs = args.jobs if args.jobs is not None else default_jobs()
    if jobs == 1 or args.file == "-" or args.html:
        return 1
    try:
        st = os.stat(args.file)
    except OSError:
        return 1  # the one-process path reports the error
    if not stat.S_ISREG(st.st_mode) or (args.jobs is None and st.st_size < SHARDED_MIN_BYTES):
        return 1
    return jobs


async def _audit(args: argparse.Namespace) -> AuditRun:
    if args.file:
        run = AuditRun(Origin("file", args.file), keep=bool(args.html))
        try:
            jobs = _jobs_for(args)
            if jobs > 1:
                run.take_merged(audit_file(args.file, jobs, final=not args.not_final), jobs)
            else:
                _feed_export(run, args.file)  # CPU-bound, and nothing else runs meanwhile
        except (OSError, ValueError, msgspec.DecodeError) as exc:
            raise CliError(f"cannot read {args.file}: {exc}") from None
        return run
    bus = await open_bus(args.nats, "vmfence-replay")
    try:
        connected = bus.nc.connected_url
        url = connected.geturl() if connected is not None else "nats"
        origin = Origin("jetstream", mask_url(url), bus.subjects.stream_log, bus.subjects.partitions)
        run = AuditRun(origin, keep=bool(args.html))
        async for rec in read_log(bus.js, bus.subjects):
            run.feed_all((rec,))
    finally:
        await bus.close()
    return run


def _peak_rss_mib(run: AuditRun) -> float:
    """The largest resident memory of this replay's processes (itself, or a shard it ran)."""
    return round(max(peak_rss_kib(), run.shard_peak_rss_kib) / 1024, 1)


def _version() -> str:
    try:
        return importlib.metadata.version("vmfence")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def report_json(run: AuditRun, report: AuditReport, *, seconds: float, cpu_seconds: float,
                created: str) -> dict[str, Any]:
    """The report as ``replay --json`` prints it: the audit, its origin, when and by what it was made."""
    out: dict[str, Any] = msgspec.to_builtins(report)
    for v, t in zip(out["violations"], [*run.violation_times, *([0.0] * len(report.violations))], strict=False):
        v["time"] = stamp(t)
    out["clean"] = report.clean
    out["seconds"] = round(seconds, 6)
    out["cpu_seconds"] = round(cpu_seconds, 6)
    out["jobs"] = run.jobs
    out["peak_rss_mib"] = _peak_rss_mib(run)
    out["origin"] = msgspec.to_builtins(run.origin)
    out["created"] = created
    out["vmfence_version"] = _version()
    return out


async def replay(args: argparse.Namespace) -> int:
    start, cpu_start = time.perf_counter(), time.process_time()
    created = stamp(time.time())
    # What exists now is long-lived, and decoded entries are never cyclic garbage (refcounting frees
    # them): the cyclic collector would only re-walk the auditor's growing state, so it is off for
    # the length of the audit.
    gc.freeze()
    gc.disable()
    try:
        run = await _audit(args)
        report = run.report(final=not args.not_final)
    finally:
        gc.enable()
    seconds = time.perf_counter() - start
    cpu_seconds = time.process_time() - cpu_start + run.shard_cpu_seconds
    if args.html:
        from services.cli.report import ReportContext, write_html

        context = ReportContext(origin=run.origin, created=created, version=_version(),
                                violation_times=run.violation_times)
        try:
            write_html(args.html, run.records or [], report, context)
        except OSError as exc:
            raise CliError(f"cannot write {args.html}: {exc.strerror or exc}") from None
    if args.json:
        sys.stdout.write(msgspec.json.encode(report_json(run, report, seconds=seconds, cpu_seconds=cpu_seconds,
                                                      created=created)).decode()
                         + "\n")
    else:
        _print_report(run, report, seconds)
    return 0 if report.clean else 1


def _print_report(run: AuditRun, report: AuditReport, seconds: float) -> None:
    console = Console(highlight=False)
    o = run.origin
    table = Table(title="vmfence audit", show_header=False)
    table.add_row("log", escape(f"{o.source} {o.location}" + (f" ({o.stream}, {o.partitions} partitions)"
                                                               if o.stream else "")))
    table.add_row("sequences", f"{o.first_seq}..{o.last_seq} ({o.first_time} .. {o.last_time})")
    table.add_row("keys", str(report.keys))
    table.add_row("entries", str(report.entries))
    table.add_row("decisions", str(report.decisions))
    table.add_row("VMs created / released", f"{report.vms_created} / {report.vms_released}")
    table.add_row("VMs bound to live incarnations", str(report.vms_bound_live))
    for reason, n in sorted(report.skipped.items()):
        table.add_row(f"skipped: {escape(reason)}", str(n))
    for inv in report.invariants:
        table.add_row(f"checked: {inv.name}", f"{inv.positions} positions, {inv.violations} violations")
    verdict = "[green]clean[/green]" if report.clean else f"[red]{len(report.violations)} violation(s)[/red]"
    table.add_row("verdict", verdict)
    table.add_row("seconds", f"{seconds:.2f}" + (f" ({run.jobs} processes)" if run.jobs > 1 else ""))
    console.print(table)
    times = [*run.violation_times, *([0.0] * len(report.violations))]
    for v, t in zip(report.violations, times, strict=False):
        where = f" (stream seq {v.seq}, {stamp(t)})" if v.seq else ""
        console.print("[red]VIOLATION[/red] " + escape(f"{v.rule}: key {v.key} entry {v.n}{where}: {v.message}"))


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
