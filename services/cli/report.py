"""`vmfence replay --html FILE`: a self-contained HTML audit report.

A summary on top (verdict; where the log came from and its span; when and by which vmfence the report
was made; counts; the invariants checked, each with its meaning, the positions it was checked at and
its violations; skips by reason; every violation with its time, linked to its place), then per key a
timeline: each entry with its time and decisions, incarnations (admitted / superseded) as bands of
colour, commands and their results, skips, and the violations found at that entry. One file, no
script, nothing fetched: it opens offline.
"""

from __future__ import annotations

import html
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from services.cli.decisions import describe, stamp
from shared.bus.logstream import Record
from shared.fence.audit import AuditReport, Violation
from shared.fence.schema import (
    Admitted,
    Adopted,
    Bound,
    Commanded,
    Decision,
    Forgotten,
    Hibernated,
    Released,
    Skipped,
    Superseded,
    decision_name,
)

CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:24px;color:#1d2433;background:#fafbfc}
h1{margin:0 0 4px} .muted{color:#6b7385}
.verdict{display:inline-block;padding:4px 12px;border-radius:12px;font-weight:600;color:#fff}
.clean{background:#1f8a4c} .dirty{background:#c0392b}
table{border-collapse:collapse;margin:12px 0;background:#fff}
td,th{border:1px solid #dde1e8;padding:4px 8px;text-align:left;vertical-align:top}
th{background:#f0f2f6} .num{text-align:right}
.key{margin:24px 0;border:1px solid #dde1e8;border-radius:8px;background:#fff}
.key h2{font-size:15px;margin:0;padding:8px 12px;background:#f0f2f6;border-radius:8px 8px 0 0}
.key.bad h2{background:#fbe3e0}
.entry{display:flex;gap:12px;padding:4px 12px;border-top:1px solid #eef0f4}
.entry .pos{width:190px;flex:none;color:#6b7385;font-family:monospace;font-size:12px}
tr.bad td{background:#fbe3e0}
.d{display:inline-block;margin:1px 4px 1px 0;padding:1px 6px;border-radius:4px;font-family:monospace;font-size:12px}
.incarnation{background:#dbe9ff} .superseded{background:#e4e4e4;text-decoration:line-through}
.command{background:#fff2cc} .result{background:#d9f2e0} .released{background:#efe0ff}
.skip{background:#f4f4f4;color:#6b7385} .other{background:#f7f7fa}
.violation{background:#c0392b;color:#fff;padding:2px 8px;border-radius:4px;margin:2px 0;display:block}
"""


def _cls(d: Decision) -> str:
    match d:
        case Admitted():
            return "incarnation"
        case Superseded() | Forgotten():
            return "superseded"
        case Commanded():
            return "command"
        case Bound() | Adopted() | Hibernated():
            return "result"
        case Released():
            return "released"
        case Skipped():
            return "skip"
    return "other"


@dataclass
class ReportContext:
    """What a report says besides the audit: the log's origin, when and by what it was made, and the
    time of the entry at which each violation was found (in the order of ``report.violations``)."""

    origin: Any = None  # replay.Origin (any struct with those fields)
    created: str = "-"
    version: str = "-"
    violation_times: list[float] = field(default_factory=list)


def _origin_rows(origin: Any) -> list[tuple[str, str]]:
    if origin is None:
        return []
    rows = [("source", f"{origin.source}: {origin.location}")]
    if origin.stream:
        rows.append(("stream", f"{origin.stream} ({origin.partitions} partitions)"))
    rows.append(("sequences", f"{origin.first_seq} .. {origin.last_seq}"))
    rows.append(("written", f"{origin.first_time} .. {origin.last_time}"))
    return rows


def render(records: list[Record], report: AuditReport, *, title: str = "vmfence audit",
           context: ReportContext | None = None) -> str:
    ctx = context or ReportContext()
    by_key: dict[str, list[Record]] = defaultdict(list)
    for r in records:
        by_key[r.entry.key].append(r)
    times = [*ctx.violation_times, *([0.0] * len(report.violations))]
    when: dict[int, float] = {}
    bad: dict[tuple[str, int], list[Violation]] = defaultdict(list)
    for i, v in enumerate(report.violations):
        bad[(v.key, v.n)].append(v)
        when[id(v)] = times[i]
    bad_keys = {v.key for v in report.violations}
    e = html.escape
    out: list[str] = [
        "<!doctype html><html><head><meta charset='utf-8'>",
        f"<title>{e(title)}</title><style>{CSS}</style></head><body>",
        f"<h1>{e(title)}</h1>",
    ]
    verdict = "clean" if report.clean else f"{len(report.violations)} violation(s)"
    out.append(f"<p><span class='verdict {'clean' if report.clean else 'dirty'}' id='verdict'>{e(verdict)}</span>"
               f" <span class=muted>made {e(ctx.created)} by vmfence {e(ctx.version)}"
               f"{'' if report.final else ' — the system was running: end checks skipped'}</span></p>")
    origin = _origin_rows(ctx.origin)
    if origin:
        out.append("<table id='origin'><tr><th colspan=2>the log</th></tr>")
        out.extend(f"<tr><td>{e(k)}</td><td>{e(v)}</td></tr>" for k, v in origin)
        out.append("</table>")
    out.append("<table><tr><th>keys</th><th>entries</th><th>decisions</th><th>VMs created</th>"
               "<th>VMs released</th><th>bound to live incarnations</th></tr>")
    out.append(
        f"<tr><td class=num>{report.keys}</td><td class=num>{report.entries}</td>"
        f"<td class=num>{report.decisions}</td><td class=num>{report.vms_created}</td>"
        f"<td class=num>{report.vms_released}</td><td class=num>{report.vms_bound_live}</td></tr></table>"
    )
    out.append("<table id='invariants'><tr><th>invariant checked</th><th>meaning</th><th>positions</th>"
               "<th>violations</th></tr>")
    for inv in report.invariants:
        cls = " class=bad" if inv.violations else ""
        out.append(f"<tr{cls}><td>{e(inv.name)}</td><td>{e(inv.meaning)}</td><td class=num>{inv.positions}</td>"
                   f"<td class=num>{inv.violations}</td></tr>")
    out.append("</table>")
    if report.skipped:
        out.append("<table><tr><th>inputs skipped, by reason</th><th>count</th></tr>")
        for reason, n in sorted(report.skipped.items()):
            out.append(f"<tr><td>{e(reason)}</td><td class=num>{n}</td></tr>")
        out.append("</table>")
    if report.violations:
        out.append("<h2>Violations</h2><table id='violations'><tr><th>rule</th><th>key</th><th>entry</th>"
                   "<th>seq</th><th>time</th><th>what</th></tr>")
        for v in report.violations:
            anchor = _anchor(v.key, v.n)
            out.append(
                f"<tr class='violation-row'><td>{e(v.rule)}</td><td><a href='#{anchor}'>{e(v.key)}</a></td>"
                f"<td class=num>{v.n}</td><td class=num>{v.seq or ''}</td><td>{e(stamp(when[id(v)]))}</td>"
                f"<td>{e(v.message)}</td></tr>"
            )
        out.append("</table>")
    out.append("<h2>Timelines</h2>")
    for key in sorted(by_key, key=lambda k: (k not in bad_keys, k)):
        out.append(f"<div class='key{' bad' if key in bad_keys else ''}' id='{_anchor(key, 0)}'>")
        out.append(f"<h2>{e(key)}</h2>")
        for r in by_key[key]:
            out.append(f"<div class='entry' id='{_anchor(key, r.entry.n)}'>")
            out.append(f"<div class='pos'>#{r.entry.n} seq {r.seq}<br>{e(stamp(r.written_at()))}</div><div>")
            for d in r.entry.decisions:
                out.append(f"<span class='d {_cls(d)}' title='{e(decision_name(d))}'>{e(describe(d))}</span>")
            for v in bad.get((key, r.entry.n), []):
                out.append(f"<span class='violation'>{e(v.rule)}: {e(v.message)}</span>")
            out.append("</div></div>")
        out.append("</div>")
    out.append("</body></html>")
    return "\n".join(out)


def _anchor(key: str, n: int) -> str:
    safe = "".join(ch if ch.isalnum() else "-" for ch in key)
    return f"k-{safe}-{n}"


def write_html(path: str, records: list[Record], report: AuditReport, context: ReportContext | None = None) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(render(records, report, context=context))
