"""`vmfence up` and `vmfence demo` in a directory another stack holds (issue 10, finding 13): one
line on stderr, a non-zero exit, and nothing of the other stack's touched — its files, its logs
beside the directory, the `.vmfence/stack.json` operator commands read."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from services.testbed.stack import DirLock

CLI_TIMEOUT_S = 60.0  # without the lock the command would start a whole stack (and `up` never ends)


@pytest.mark.parametrize("command", [["up", "--runtime", "sim"], ["demo", "--runtime", "sim", "--json"]])
def test_a_second_stack_in_a_held_directory_is_one_line_and_touches_nothing(tmp_path: Path,
                                                                           command: list[str]) -> None:
    run_dir = tmp_path / ".vmfence" / "run"
    holder = DirLock(run_dir)
    holder.acquire()  # what a live `vmfence up` in this directory holds
    try:
        (run_dir / "nats").mkdir()
        sentinel = run_dir / "nats" / "store.dat"
        sentinel.write_bytes(b"the first stack's data")
        record = tmp_path / ".vmfence" / "stack.json"
        record.write_text('{"nats_url": "nats://127.0.0.1:4222"}')

        proc = subprocess.Popen([sys.executable, "-m", "services.cli", *command, "--dir", str(run_dir)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
        try:
            stdout, stderr = proc.communicate(timeout=CLI_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGTERM)  # a stack it started stops itself on SIGTERM
            proc.communicate(timeout=CLI_TIMEOUT_S)
            pytest.fail(f"vmfence {command[0]} started in a directory another stack holds")
    finally:
        holder.release()
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert proc.returncode != 0
    assert len(lines) == 1 and lines[0].startswith(f"vmfence {command[0]}: another stack is running in "), stderr
    assert "Traceback" not in stderr and stdout == ""
    assert sentinel.read_bytes() == b"the first stack's data"
    assert record.read_text() == '{"nats_url": "nats://127.0.0.1:4222"}'
    assert not (tmp_path / ".vmfence" / "run-logs").exists()


def test_the_lock_is_free_again_once_its_holder_lets_go(tmp_path: Path) -> None:
    first, second = DirLock(tmp_path / "run"), DirLock(tmp_path / "run")
    first.acquire()
    with pytest.raises(RuntimeError, match="another stack is running"):
        second.acquire()
    first.release()
    second.acquire()
    assert second.held and (tmp_path / "run" / "stack.lock").stat().st_mode & 0o777 == 0o600
    second.release()
