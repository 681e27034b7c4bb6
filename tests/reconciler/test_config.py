"""Configuration errors stop the reconciler at start with one clear line and exit code 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("args", "env", "words"),
    [
        (["--partitions", "lots"], {}, "VMFENCE_PARTITIONS='lots' is not an integer"),
        (["--replicas", "2"], {}, "must be 1 or 3"),
        ([], {"VMFENCE_NATS_URL": "http://x"}, "must be nats:// URL"),
        (["--kubeconfig", "/nonexistent/kc"], {}, "does not exist"),
        (["--log-format", "xml"], {}, "must be json or text"),
    ],
)
def test_bad_configuration_is_one_line_and_exit_2(args: list[str], env: dict[str, str], words: str) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "services.cli", "reconciler", *args],
        capture_output=True, text=True, cwd=ROOT, timeout=30, env={"PATH": "/usr/bin:/bin", **env},
    )
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and words in lines[0] and "Traceback" not in out.stderr
