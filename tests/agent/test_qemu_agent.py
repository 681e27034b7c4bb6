"""The agent with the real qemu runtime: SIGTERM must leave the QEMU process running."""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
from nats.aio.client import Client

from services.testbed.natsserver import NatsServer
from shared.fence.schema import CommandResult

from .conftest import Reports, command, fence, send
from .test_process import agent_args, agent_process

pytestmark = [
    pytest.mark.qemu,
    pytest.mark.skipif(
        shutil.which("qemu-system-x86_64") is None or shutil.which("qemu-img") is None,
        reason="qemu-system-x86_64 / qemu-img not installed",
    ),
]


def _our_qemu(pidfile: str) -> int | None:
    """The pid in pidfile if /proc confirms it is that QEMU (guards against pid reuse)."""
    try:
        pid = int(Path(pidfile).read_text().strip())
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (OSError, ValueError):
        return None
    return pid if pidfile.encode() in cmd else None


def _proc_state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


@pytest.fixture
def data_dir(tmp_path: Path) -> Iterator[Path]:
    d = tmp_path / "agent"
    yield d
    for pidfile in glob.glob(str(d / "**" / "qemu.pid"), recursive=True):  # kill leftovers
        pid = _our_qemu(pidfile)
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


async def test_sigterm_leaves_qemu_running(
    nats_server: NatsServer, nc: Client, reports: Reports, data_dir: Path
) -> None:
    f = fence(1)
    cmd = command("create", "fw-1", f)  # no image: a firmware-only VM, still a real QEMU process
    args = agent_args(nats_server, data_dir, "--runtime", "qemu", "--accel", "tcg", "--vnc-range", "none")
    async with agent_process(*args) as a:
        await a.wait_event("ready", 60)
        await send(nc, cmd)
        r = await reports.wait(lambda i: isinstance(i, CommandResult) and i.command_id == cmd.id, 60)
        assert isinstance(r, CommandResult) and r.outcome == "ok", r
        pidfile = str(data_dir / "runtime" / "vms" / "fw-1" / "qemu.pid")
        pid = _our_qemu(pidfile)
        assert pid is not None
        assert await a.finish(signal.SIGTERM) == 0
    assert _our_qemu(pidfile) == pid  # the agent stopped; its VM did not
    # a restarted agent rediscovers it and a remove with the owner's fence really kills it
    async with agent_process(*args) as a2:
        await a2.wait_event("ready", 60)
        rm = command("remove", "fw-1", f)
        await send(nc, rm)
        r = await reports.wait(lambda i: isinstance(i, CommandResult) and i.command_id == rm.id, 60)
        assert isinstance(r, CommandResult) and r.outcome == "ok", r
        assert await a2.finish(signal.SIGTERM) == 0
    assert _our_qemu(pidfile) is None
    assert _proc_state(pid) in ("gone", "Z", "X")  # killed before the answer (at most a zombie)
