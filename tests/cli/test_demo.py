"""`vmfence demo` at a small size, as CI runs it: exit 0, the JSON contract, a clean audit."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FIELDS = ("pods", "vms_created", "vms_removed", "vms_running", "decisions", "skipped", "violations", "seconds")


def test_demo_small_is_clean(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "services.cli", "demo", "--runtime", "sim", "--pods", "2", "--json",
         "--dir", str(tmp_path / "demo")],
        capture_output=True, text=True, cwd=ROOT, timeout=240,
    )
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    result = json.loads(out.stdout)
    for field in FIELDS:
        assert field in result, field
    assert result["violations"] == []
    assert result["max_vms_per_key"] == 1
    assert result["vms_running"] == result["pods"] == 2
    assert result["skipped"].get("superseded", 0) > 0, "the race scenarios produced no superseded input"
    assert result["scenarios"]["stale_delete_refused"] == 1
    assert result["reconciler_kills"] == 1
