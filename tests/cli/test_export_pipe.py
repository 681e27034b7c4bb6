"""The backup step of docs/operations.md as written there: `vmfence export > file` and
`vmfence export | vmfence replay --file -`; a report path that cannot be written is one line."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

from services.testbed.natsserver import NatsServer
from shared.bus.logstream import iter_export
from tests.cli.test_replay import ROOT, _make_log, vmfence


def _sh(script: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", "-o", "pipefail", "-c", script], capture_output=True, text=True, cwd=ROOT,
                          timeout=120)


async def test_export_to_standard_output_and_replay_from_standard_input(nats_server: NatsServer,
                                                                       tmp_path: Path) -> None:
    await _make_log(nats_server.url, tmp_path)
    cli = f"{sys.executable} -m services.cli"
    backup = tmp_path / "vmfence-log.export"
    out = await asyncio.to_thread(_sh, f"{cli} export --nats-url {nats_server.url} > {backup}")
    assert out.returncode == 0, out.stderr
    assert "exported" in out.stderr and "standard output" in out.stderr
    records = list(iter_export(backup.read_bytes()))
    assert records and all(r.ts > 0 for r in records)  # the stored time travels with the export
    piped = await asyncio.to_thread(
        _sh, f"{cli} export --nats-url {nats_server.url} | {cli} replay --file - --json")
    assert piped.returncode == 0, piped.stderr
    report = json.loads(piped.stdout)
    assert report["clean"] and report["entries"] == len(records)
    from_file = await asyncio.to_thread(vmfence, "replay", "--file", str(backup), "--json")
    assert json.loads(from_file.stdout)["entries"] == len(records)


async def test_a_report_path_that_cannot_be_written_is_one_line(nats_server: NatsServer, tmp_path: Path) -> None:
    await _make_log(nats_server.url, tmp_path)
    out = await asyncio.to_thread(vmfence, "replay", "--nats-url", nats_server.url, "--html", "/nonexistent/x.html")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip() == "vmfence replay: cannot write /nonexistent/x.html: No such file or directory"
