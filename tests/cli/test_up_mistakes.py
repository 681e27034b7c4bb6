"""Ordinary mistakes with `vmfence up`, `vmfence demo` and `vmfence status` are one clear line on
stderr and a non-zero exit, never a traceback (issue 10, finding 14): a kubeconfig that is missing,
not a file, not YAML or not a kubeconfig (before anything is started or created), a --dir that
cannot be a directory, no local stack, a local stack whose NATS is gone."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from services.testbed.natsserver import free_port

CLI_TIMEOUT_S = 60.0
POLL_S = 0.1


def _vmfence(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VMFENCE_")}
    return subprocess.run([sys.executable, "-m", "services.cli", *args], capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=CLI_TIMEOUT_S)


def _one_line(out: subprocess.CompletedProcess[str], prefix: str) -> str:
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode != 0, out.stderr
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith(prefix), out.stderr
    assert "Traceback" not in out.stderr + out.stdout
    return lines[0]


@pytest.mark.parametrize(("kubeconfig", "content", "says"), [
    ("missing.yaml", None, "no such file"),
    ("a-directory", "", "not a readable file"),
    ("broken.yaml", "clusters: [", "not a usable kubeconfig (while parsing"),
    ("not-kube.yaml", "a: 1\n", "not a usable kubeconfig (Invalid kube-config file"),
])
def test_up_with_a_bad_kubeconfig_is_one_line_before_anything_starts(
    tmp_path: Path, kubeconfig: str, content: str | None, says: str
) -> None:
    path = tmp_path / kubeconfig
    if content == "":
        path.mkdir()
    elif content is not None:
        path.write_text(content)
    out = _vmfence(tmp_path, "up", "--runtime", "sim", "--kubeconfig", str(path))
    line = _one_line(out, f"vmfence up: kubeconfig {path}: ")
    assert says in line and "ConfigException" not in line
    assert not (tmp_path / ".vmfence").exists(), "nothing is created for a mistake found up front"


def test_demo_in_a_dir_that_cannot_be_one_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "taken").write_text("a file, not a directory")
    out = _vmfence(tmp_path, "demo", "--runtime", "sim", "--json", "--dir", str(tmp_path / "taken" / "run"))
    _one_line(out, "vmfence demo: ")
    assert out.stdout == ""


def test_status_without_a_stack_or_with_its_nats_gone_is_one_line(tmp_path: Path) -> None:
    _one_line(_vmfence(tmp_path, "status"), "vmfence status: no --nats given")
    (tmp_path / ".vmfence").mkdir()
    dead = f"nats://audit:secret@127.0.0.1:{free_port()}"  # a stack killed without cleaning up
    (tmp_path / ".vmfence" / "stack.json").write_text(json.dumps({"nats_url": dead, "partitions": 16}))
    line = _one_line(_vmfence(tmp_path, "status"), "vmfence status: cannot connect to NATS at ")
    assert "secret" not in line and "audit:***@" in line


def test_demo_interrupted_with_ctrl_c_stops_its_stack_in_one_line(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith("VMFENCE_")}
    proc = subprocess.Popen([sys.executable, "-m", "services.cli", "demo", "--runtime", "sim", "--json",
                             "--dir", str(run_dir)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=tmp_path, env=env)
    try:
        deadline = time.monotonic() + CLI_TIMEOUT_S
        # the stack is up once its reconcilers log (an external process: bounded polling of its files)
        while not list((run_dir / "logs").glob("reconciler-*.log")) and proc.poll() is None:
            assert time.monotonic() < deadline, "the demo never started its stack"
            time.sleep(POLL_S)
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=CLI_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert proc.returncode == 130 and lines == ["vmfence demo: interrupted; the stack was stopped"], stderr
    assert stdout == ""
    alive = subprocess.run(["pgrep", "-f", str(run_dir)], capture_output=True, text=True)
    assert alive.stdout == "", "a process of the interrupted stack is still running"
