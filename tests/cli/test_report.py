"""The HTML audit report renders a log with a violation and shows it where it happened."""

from __future__ import annotations

from pathlib import Path

from services.cli.report import write_html
from shared.bus.logstream import Record, audit_records
from shared.fence.schema import Bound, Commanded, Fence, LogEntry
from tests.unit.driver import Driver


def _records() -> list[Record]:
    d = Driver()
    d.run_up("u1")
    d.admit("u2")
    records = [Record(100 + i, e) for i, e in enumerate(d.log)]
    # an intruder binds a VM under a fence that was never current
    cmd = next(x.command for r in records for x in r.entry.decisions if isinstance(x, Commanded))
    bad = LogEntry(d.key, len(records) + 1, [Bound(Fence(d.key, "intruder", 7), "vm-x", "host-a", cmd.id)])
    return [*records, Record(999, bad)]


def test_html_report_shows_the_violation(tmp_path: Path) -> None:
    records = _records()
    report = audit_records(records, final=False)
    assert not report.clean
    out = tmp_path / "audit.html"
    write_html(str(out), records, report)
    page = out.read_text()
    assert page.startswith("<!doctype html>") and "<script" not in page and "http" not in page.split("<body>")[0]
    assert "violation(s)" in page and "result_fence_mismatch" in page
    assert "intruder" in page and "seq 999" in page
    # the summary links to the entry's anchor in the key's timeline
    anchor = "k-default-web-v1-" + str(len(records))
    assert f"href='#{anchor}'" in page and f"id='{anchor}'" in page
    assert page.count("class='entry'") == len(records)
