"""The HTML audit report in a real browser (Debian's Chromium, headless, no network): a report with a
planted violation shows the verdict, the violation's row with its time, the invariants checked and
the log's origin, as the browser parsed them."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from services.cli.replay import Origin
from services.cli.report import ReportContext, write_html
from shared.bus.logstream import audit_records
from tests.cli.test_report import _records

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
# what the machine's closed network needs (docs: no background connections, no first-run fetches)
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync")


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (scripts/bootstrap.sh installs it)")
def test_a_planted_violation_and_the_verdict_are_on_the_page(tmp_path: Path) -> None:
    assert CHROMIUM is not None
    records = _records()
    report = audit_records(records, final=False)
    origin = Origin("file", "/backups/vmfence-log.export", first_seq=records[0].seq, last_seq=records[-1].seq)
    page = tmp_path / "audit.html"
    write_html(str(page), records, report,
               ReportContext(origin=origin, created="2026-12-01T20:00:00.000Z", version="0.1.0",
                             violation_times=[1796155200.0] * len(report.violations)))
    dom = subprocess.run(
        [CHROMIUM, *FLAGS, f"--user-data-dir={tmp_path / 'profile'}", "--dump-dom", page.as_uri()],
        capture_output=True, text=True, timeout=120,
    )
    assert dom.returncode == 0, dom.stderr[-2000:]
    html = dom.stdout
    assert re.search(r"id=\"verdict\"[^>]*>\d+ violation\(s\)<", html), html[:2000]
    row = re.search(r"<tr class=\"violation-row\">(.*?)</tr>", html, re.S)
    assert row is not None
    cells = re.findall(r"<td[^>]*>(.*?)</td>", row.group(1), re.S)
    assert cells[0] == "result_fence_mismatch" and "intruder" in cells[-1]
    assert cells[4] == "2026-12-01T20:00:00.000Z"  # the violation's wall-clock time
    assert "/backups/vmfence-log.export" in html and "made 2026-12-01T20:00:00.000Z by vmfence 0.1.0" in html
    assert html.count("<tr") >= 8 and "results_match_their_commands" in html  # the invariants table
    # the summary links to the entry's anchor in the key's timeline, which the browser kept
    link = re.search(r"<a href=\"#(k-[^\"]+)\">", row.group(1))
    assert link is not None and f"id=\"{link.group(1)}\"" in html
