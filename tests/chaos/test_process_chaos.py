"""`vmfence chaos --processes`: real processes SIGKILLed while pods churn, judged by the OS.

Each test runs the command as a user would (a subprocess) and asserts the invariants from its JSON:
never two VMs for one key or incarnation (sampled from the process table / sim host files), no
leaked VM, no lost input, a clean audit, and that the faults really happened.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _qemu_usable() -> bool:
    return shutil.which("qemu-system-x86_64") is not None and shutil.which("qemu-img") is not None


CHAOS_S, SETTLE_S = 20, 60
RECHECK_S = 25 + 60  # the command's second look at an end state an inventory has yet to clean
MIN_KILLS, EXTRA_S = 3, 20  # the window stays open until 3 kills happened (slow restarts on a busy machine)
MARGIN_S = 40  # starting (a 3-node cluster, processes, QEMU's accel probe) and stopping everything
RUN_LIMIT_S = CHAOS_S + EXTRA_S + SETTLE_S + RECHECK_S + MARGIN_S


def _text(output: bytes | str | None) -> str:
    return output.decode(errors="replace") if isinstance(output, bytes) else output or ""


def _run(tmp_path: Path, runtime: str) -> dict[str, Any]:
    """The command's own verdict, even for a run that never quiesces: the subprocess may take its
    whole chaos time, its settle timeout, its re-check and a margin (a timeout loses its verdict)."""
    run_dir = tmp_path / "chaos"
    try:
        out = subprocess.run(
            [sys.executable, "-m", "services.cli", "chaos", "--processes", "--minutes", str(CHAOS_S / 60),
             "--runtime", runtime, "--kill-every", "3", "--min-kills", str(MIN_KILLS), "--json", "--dir", str(run_dir),
             "--settle-timeout", str(SETTLE_S)],
            capture_output=True, text=True, cwd=ROOT, timeout=RUN_LIMIT_S,
        )  # fmt: skip
    except subprocess.TimeoutExpired as exc:
        stdout, stderr = (_text(exc.stdout), _text(exc.stderr))
        pytest.fail(f"vmfence chaos did not end within {exc.timeout:g}s; its stdout:\n{stdout[-2000:]}\n"
                    f"its last stderr:\n{stderr[-4000:]}")
    assert out.stdout.strip(), f"no JSON (exit {out.returncode}):\n{out.stderr[-4000:]}"
    result: dict[str, Any] = json.loads(out.stdout)
    assert out.returncode == (0 if result["ok"] else 1)
    assert out.returncode == 0, json.dumps(result, indent=1) + "\n" + out.stderr[-3000:]
    return result


def _assert_invariants(result: dict[str, Any], runtime: str) -> None:
    assert result["runtime"] == runtime
    assert result["quiesced"] is True
    assert result["violations"] == []
    assert result["leaked_vms"] == 0
    assert result["lost_inputs"] == 0
    assert result["pods_without_vm"] == []
    assert result["max_vms_per_key"] == 1
    assert result["max_vms_per_incarnation"] == 1
    assert result["kills_total"] >= MIN_KILLS, result["kills"]
    assert result["pods_churned"] >= 10, result["ops"]
    assert result["oracle_samples"] > 50
    assert result["qemu_killed_at_end"] == 0  # agents with --cleanup-on-stop removed every VM


def _no_qemu_left(run_dir: Path) -> None:
    from services.testbed.chaos.oracles import qemu_pids_under

    assert qemu_pids_under(run_dir) == [], "a QEMU of this run (VM or accel probe) outlived the campaign"


@pytest.mark.timeout(RUN_LIMIT_S + 30)
def test_process_chaos_sim_smoke(tmp_path: Path) -> None:
    result = _run(tmp_path, "sim")
    _assert_invariants(result, "sim")
    assert not (tmp_path / "chaos").exists(), "a clean run removes its directory"


@pytest.mark.qemu
@pytest.mark.timeout(RUN_LIMIT_S + 30)
@pytest.mark.skipif(not _qemu_usable(), reason="needs qemu-system-x86_64 and qemu-img")
def test_process_chaos_qemu(tmp_path: Path) -> None:
    result = _run(tmp_path, "qemu")
    _assert_invariants(result, "qemu")
    _no_qemu_left(tmp_path / "chaos")
    assert os.path.isdir(tmp_path) and result["vms_created"] >= 3
