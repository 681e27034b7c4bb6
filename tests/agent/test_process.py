"""The agent as a real process: SIGKILL mid-create, SIGTERM keeps VMs, config errors exit 2."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
from nats.aio.client import Client

from services.agent.runtime.sim import load_host
from services.testbed.natsserver import NatsServer
from shared.fence.schema import CommandResult, Inventoried

from .conftest import HOST, Reports, command, fence, send

REPO = Path(__file__).resolve().parents[2]
START_S = 20.0
STOP_S = 20.0


class AgentProc:
    """``python -m services.agent`` with its JSON log lines collected (the events we wait on)."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.lines: list[dict[str, Any]] = []
        self.raw: list[str] = []
        self._cond = asyncio.Condition()
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        assert self.proc.stderr is not None
        async for line in self.proc.stderr:
            text = line.decode(errors="replace").rstrip()
            self.raw.append(text)
            with contextlib.suppress(ValueError):
                async with self._cond:
                    self.lines.append(json.loads(text))
                    self._cond.notify_all()

    async def wait_log(self, pred: Callable[[dict[str, Any]], bool], timeout: float = START_S) -> None:  # noqa: ASYNC109
        try:
            async with asyncio.timeout(timeout), self._cond:
                await self._cond.wait_for(lambda: any(pred(x) for x in self.lines) or self.proc.returncode is not None)
        except TimeoutError:
            raise AssertionError("agent log never showed it:\n" + "\n".join(self.raw[-30:])) from None
        assert any(pred(x) for x in self.lines), "agent exited:\n" + "\n".join(self.raw[-30:])

    async def wait_event(self, event: str, timeout: float = START_S) -> None:  # noqa: ASYNC109
        await self.wait_log(lambda x: x.get("event") == event, timeout)

    async def finish(self, sig: int | None = signal.SIGTERM) -> int:
        if sig is not None and self.proc.returncode is None:
            self.proc.send_signal(sig)
        rc = await asyncio.wait_for(self.proc.wait(), STOP_S)
        await asyncio.wait_for(self._reader, STOP_S)
        return rc


@contextlib.asynccontextmanager
async def agent_process(*args: str) -> AsyncIterator[AgentProc]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "services.agent", *args, cwd=str(REPO),
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
    )
    ap = AgentProc(proc)
    try:
        yield ap
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        ap._reader.cancel()


def agent_args(nats: NatsServer, data_dir: Path, *extra: str) -> list[str]:
    return ["--nats-url", nats.url, "--host", HOST, "--data-dir", str(data_dir), "--http-host", "127.0.0.1",
            "--http-port", "0", "--ack-wait", "2", "--probe-interval", "0.2", *extra]


def sim_host(data_dir: Path) -> dict[str, Any]:
    raw: dict[str, Any] = msgspec.to_builtins(load_host(str(data_dir / "runtime")))
    return raw


def sim_creates(data_dir: Path, vm_id: str) -> int:
    return sum(1 for h in sim_host(data_dir)["history"] if h["op"] == "create" and h["vm_id"] == vm_id
               and h["outcome"] in ("ok", "crashed_after"))


@pytest.mark.parametrize("fault", ["delay:create:60", "crash_after:create"])
async def test_sigkill_mid_create_then_restart(
    nats_server: NatsServer, nc: Client, reports: Reports, tmp_path: Path, fault: str
) -> None:
    """Killed while a create is in flight (before the effect, or after it but before the report):
    the restarted agent inventories the half-made VM and the redelivered create makes no second."""
    data = tmp_path / "agent"
    f = fence(1)
    cmd = command("create", "half-1", f)
    async with agent_process(*agent_args(nats_server, data, "--sim-fault", fault)) as a1:
        await a1.wait_event("ready")
        await send(nc, cmd)
        await a1.wait_event("create_intent")
        if fault.startswith("delay"):
            rc = await a1.finish(signal.SIGKILL)  # the create is sleeping inside the runtime
            assert rc == -signal.SIGKILL
            assert "half-1" not in sim_host(data)["vms"]
        else:
            rc = await a1.finish(None)  # the agent dies on its own right after the effect
            assert rc == 137
            assert "half-1" in sim_host(data)["vms"]
    assert not reports.of(CommandResult, command_id=cmd.id)
    async with agent_process(*agent_args(nats_server, data)) as a2:
        inv = await reports.wait(lambda i: isinstance(i, Inventoried) and i.vm_id == "half-1", START_S)
        assert isinstance(inv, Inventoried) and inv.fence == f and inv.state == "creating"
        r = await reports.wait(lambda i: isinstance(i, CommandResult) and i.command_id == cmd.id, START_S)
        assert isinstance(r, CommandResult) and r.outcome == "ok"
        assert list(sim_host(data)["vms"]) == ["half-1"]
        assert sim_creates(data, "half-1") == (1 if fault.startswith("delay") else 2)  # 2nd is a no-op
        assert await a2.finish() == 0
    assert sim_host(data)["vms"]["half-1"]["state"] == "running"


async def test_sigterm_leaves_sim_vms_running(
    nats_server: NatsServer, nc: Client, reports: Reports, tmp_path: Path
) -> None:
    data = tmp_path / "agent"
    async with agent_process(*agent_args(nats_server, data)) as a:
        await a.wait_event("ready")
        for vm in ("keep-1", "keep-2"):
            c = command("create", vm, fence(1))
            await send(nc, c)
            await reports.wait(lambda i, c=c: isinstance(i, CommandResult) and i.command_id == c.id)
        assert await a.finish(signal.SIGTERM) == 0
        assert any(x.get("event") == "stopped" for x in a.lines)
    vms = sim_host(data)["vms"]
    assert sorted(vms) == ["keep-1", "keep-2"] and all(v["state"] == "running" for v in vms.values())


@pytest.mark.parametrize(
    ("args", "env", "needle"),
    [
        (["--http-port", "http"], {}, "--http-port"),
        (["--runtime", "docker"], {}, "runtime"),
        ([], {"VMFENCE_PARTITIONS": "zero"}, "VMFENCE_PARTITIONS"),
        ([], {"VMFENCE_VNC_PORTS": "9-3"}, "VNC ports"),
        ([], {"VMFENCE_VNC_PORTS": "10-109"}, "VNC ports"),  # display numbers where ports are asked
        ([], {"VMFENCE_VNC_RANGE": "5900-5919"}, "VMFENCE_VNC_RANGE is not read any more"),
        (["--vnc-listen", "localhost"], {}, "--vnc-listen"),
        (["--host", "bad.host"], {}, "host"),
        (["--no-such-flag"], {}, "unrecognized"),
    ],
)
async def test_bad_config_exits_2_with_one_line(
    tmp_path: Path, args: list[str], env: dict[str, str], needle: str
) -> None:
    full_env = {**os.environ, "VMFENCE_DATA_DIR": str(tmp_path / "d"), **env}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "services.agent", *args, cwd=str(REPO), env=full_env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    lines = err.decode().strip().splitlines()
    assert proc.returncode == 2, err
    assert len(lines) == 1 and needle in lines[0] and lines[0].startswith("vmfence agent: error:"), lines
    assert out == b""


async def test_unreachable_nats_fails_bounded_and_sigterm_stops_startup(tmp_path: Path) -> None:
    args = ["--nats-url", "nats://127.0.0.1:1", "--host", HOST, "--http-port", "0"]
    async with agent_process(*args, "--data-dir", str(tmp_path / "a"), "--connect-timeout", "1") as a:
        assert await a.finish(None) == 1
        assert a.raw[-1].startswith("vmfence agent: error:") and "NATS" in a.raw[-1]
    async with agent_process(*args, "--data-dir", str(tmp_path / "b")) as b:
        await b.wait_event("connecting")
        try:
            rc = await b.finish(signal.SIGTERM)
        except TimeoutError:
            raise AssertionError("\n".join(b.raw)) from None
        assert rc == 0  # heard at once, not after the connect gives up
