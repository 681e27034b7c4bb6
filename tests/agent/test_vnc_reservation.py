"""Issue 10, finding 9 in the agent: a VM's VNC password is stored with its display's reservation in
the ledger, owned by the VM's fence (rule 9): it moves with an adopt, a predecessor can neither
release nor rewrite it, and it is released with the display when its owner's VM is gone. The
ledger that holds it is 0600 in a 0700 data directory. With real QEMU, the password the ledger holds
is the one that opens the VM's display."""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import signal
import stat
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from nats.aio.client import Client

from services.agent.config import AgentConfig
from services.agent.ledger import LEDGER_FILE, ReservationConflict
from services.agent.runtime.pool import VNC_PASSWORD_CHARS, DisplayPool
from services.agent.service import Agent
from shared.fence.schema import CommandResult, Input
from tests.runtime.rfb import OPENSSL, SEC_VNC_AUTH, security_types, vnc_login

from .conftest import Reports, command, fence, send, sim_driver


def is_result(cid: str) -> Callable[[Input], bool]:
    return lambda i: isinstance(i, CommandResult) and i.command_id == cid


async def run(nc: Client, reports: Reports, cmd: object, timeout: float = 10.0) -> CommandResult:  # noqa: ASYNC109
    await send(nc, cmd)  # type: ignore[arg-type]
    r = await reports.wait(is_result(cmd.id), timeout)  # type: ignore[attr-defined]
    assert isinstance(r, CommandResult)
    return r


def mode(path: str) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


async def test_vnc_password_belongs_to_the_vms_fence(
    nc: Client, reports: Reports, make_config: Callable[..., AgentConfig]
) -> None:
    cfg = make_config()
    old, new = fence(1), fence(2)
    driver = sim_driver(cfg)
    async with Agent(cfg, driver=driver) as agent:
        ledger = agent.ledger
        assert (await run(nc, reports, command("create", "v-1", old))).outcome == "ok"
        info = await driver.inspect("v-1")
        assert info is not None and info.vnc_display is not None and info.vnc_password
        assert len(info.vnc_password) == VNC_PASSWORD_CHARS
        (res,) = [r for r in await ledger.reservations("v-1") if r.kind == "vnc"]
        assert (res.resource, res.fence, res.secret) == (str(info.vnc_display), old, info.vnc_password)
        assert await ledger.vnc_password("v-1") == info.vnc_password
        # a second VM has a password of its own
        assert (await run(nc, reports, command("create", "v-2", old))).outcome == "ok"
        other = await ledger.vnc_password("v-2")
        assert other and other != info.vnc_password

        # the successor adopts: the display and its password are its own now
        assert (await run(nc, reports, command("adopt", "v-1", new))).outcome == "ok"
        (res,) = [r for r in await ledger.reservations("v-1") if r.kind == "vnc"]
        assert (res.fence, res.secret) == (new, info.vnc_password)
        # the predecessor can neither release it nor rewrite it (its recovery is fenced)
        with pytest.raises(ReservationConflict):
            await ledger.release("vnc", res.resource, "v-1", old)
        assert (await run(nc, reports, command("start", "v-1", old))).outcome == "fenced"
        assert (await run(nc, reports, command("create", "v-1", old, cid="late-create"))).outcome == "fenced"
        assert await ledger.vnc_password("v-1") == info.vnc_password

        # its owner removes the VM: display and password released together
        assert (await run(nc, reports, command("remove", "v-1", new))).outcome == "ok"
        assert await ledger.reservations("v-1") == []
        assert await ledger.vnc_password("v-1") is None
        assert await ledger.vnc_password("v-2") == other  # nobody else's is touched

        # the ledger holding the passwords is the agent user's alone
        path = os.path.join(cfg.data_dir, LEDGER_FILE)
        for p in (path, f"{path}-wal", f"{path}-shm"):
            assert mode(p) == 0o600, (p, oct(mode(p)))
        assert mode(cfg.data_dir) == 0o700
        assert mode(os.path.join(cfg.data_dir, "agent.lock")) == 0o600


# ---------------------------------------------------------------------------------- real QEMU

QEMU_MISSING = shutil.which("qemu-system-x86_64") is None or shutil.which("qemu-img") is None


@pytest.fixture
def qemu_leftovers(tmp_path: Path) -> Iterator[None]:
    yield
    for pidfile in glob.glob(str(tmp_path / "**" / "qemu.pid"), recursive=True):
        with contextlib.suppress(OSError, ValueError):
            pid = int(Path(pidfile).read_text().strip())
            if pidfile.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                os.kill(pid, signal.SIGKILL)


@pytest.mark.qemu
@pytest.mark.skipif(QEMU_MISSING, reason="qemu-system-x86_64 / qemu-img not installed")
@pytest.mark.skipif(OPENSSL is None, reason="openssl not installed")
async def test_the_ledgers_password_opens_the_qemu_vms_display(
    nc: Client, reports: Reports, make_config: Callable[..., AgentConfig], qemu_leftovers: None
) -> None:
    cfg = make_config(runtime="qemu", accel="tcg", vnc_range=range(90, 100))  # ports 5990-5999
    f = fence(1)
    async with Agent(cfg) as agent:
        r = await run(nc, reports, command("create", "q-vnc", f), 60)
        assert r.outcome == "ok" and r.vnc_port is not None, r
        password = await agent.ledger.vnc_password("q-vnc")
        assert password
        assert await security_types("127.0.0.1", r.vnc_port) == [SEC_VNC_AUTH]
        assert await vnc_login("127.0.0.1", r.vnc_port, password)
        assert not await vnc_login("127.0.0.1", r.vnc_port, password[::-1] if password[::-1] != password else "x")
        assert r.vnc_port - DisplayPool.BASE_PORT in cfg.vnc_range  # type: ignore[operator]
        assert (await run(nc, reports, command("remove", "q-vnc", f), 60)).outcome == "ok"
        assert await agent.ledger.vnc_password("q-vnc") is None


async def test_a_ledger_from_before_passwords_gains_the_column(tmp_path: Path) -> None:
    import sqlite3

    from services.agent.ledger import Claim, Ledger, VMRow
    from shared.fence.schema import Spec

    path = str(tmp_path / LEDGER_FILE)
    with sqlite3.connect(path) as db:  # the reservations table as it was
        db.execute("CREATE TABLE reservations (kind TEXT NOT NULL, resource TEXT NOT NULL, vm_id TEXT NOT NULL, "
                   "uid TEXT NOT NULL, epoch INTEGER NOT NULL, at REAL NOT NULL, PRIMARY KEY (kind, resource))")
        db.execute("INSERT INTO reservations VALUES ('vnc', '11', 'old-1', 'uid-1', 1, 0)")
    os.chmod(path, 0o644)
    ledger = Ledger(path)
    await ledger.open()
    try:
        assert mode(path) == 0o600  # tightened on open
        assert await ledger.vnc_password("old-1") is None  # kept, without a password
        f = fence(1)
        row = VMRow(vm_id="new-1", fence=f, state="running", spec=Spec())
        result = CommandResult(fence=f, command_id="c-1", op="create", host="h1", vm_id="new-1", outcome="ok")
        await ledger.record(result, put=row, claim=[Claim("vnc", "12", "s3cretpw")])
        assert await ledger.vnc_password("new-1") == "s3cretpw"
    finally:
        await ledger.close()
