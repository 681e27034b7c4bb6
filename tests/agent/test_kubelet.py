"""The agent's kubelet endpoint (issue 12 §3): /containerLogs over HTTPS from the VM's console,
only for the API server's client certificate; follow, tailLines, timestamps, sinceSeconds,
previous; exec/attach/portForward answer a message naming vmfence console. Real TLS, a real agent
on a real nats-server, the sim runtime's console files."""

from __future__ import annotations

import asyncio
import re
import ssl
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import aiohttp
import pytest

from services.agent.config import AgentConfig
from services.agent.runtime.sim import SimDriver
from services.agent.service import Agent
from services.testbed.kubecp.pki import _leaf, _save
from services.testbed.kubeletpki import KubeletPki, make_kubelet_pki
from shared.fence.schema import CommandResult, Input

from .conftest import Reports, command, fence, send, sim_driver

NS, POD = "default", "web"


@pytest.fixture
def pki(tmp_path: Path) -> KubeletPki:
    return make_kubelet_pki(tmp_path / "pki")


def client_ctx(pki: KubeletPki, cert: Path | None = None, key: Path | None = None) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(pki.ca))
    ctx.check_hostname = False
    if cert is not None and key is not None:
        ctx.load_cert_chain(str(cert), str(key))
    return ctx


@pytest.fixture
async def agent(make_config: Callable[..., AgentConfig], pki: KubeletPki, nc: object,
                reports: Reports) -> AsyncIterator[tuple[Agent, SimDriver]]:
    cfg = make_config(kubelet_port=0, kubelet_listen="127.0.0.1", kubelet_tls_cert=str(pki.server.cert),
                      kubelet_tls_key=str(pki.server.key), kubelet_client_ca=str(pki.ca))
    driver = sim_driver(cfg)
    async with Agent(cfg, driver=driver) as a:
        yield a, driver


def is_result(cid: str) -> Callable[[Input], bool]:
    return lambda i: isinstance(i, CommandResult) and i.command_id == cid


async def fetch(agent: Agent, path: str, ctx: ssl.SSLContext) -> tuple[int, str]:
    assert agent.kubelet is not None
    async with aiohttp.ClientSession() as s, s.get(f"https://127.0.0.1:{agent.kubelet.port}{path}", ssl=ctx,
                                                   timeout=aiohttp.ClientTimeout(total=10)) as r:
        return r.status, await r.text()


async def test_logs_come_from_the_console_for_the_api_server_s_certificate_only(
    agent: tuple[Agent, SimDriver], nc: object, reports: Reports, pki: KubeletPki, tmp_path: Path
) -> None:
    a, driver = agent
    f = fence(1, key=f"{NS}/{POD}")
    cmd = command("create", "web-1", f)
    await send(nc, cmd)  # type: ignore[arg-type]
    r = await reports.wait(is_result(cmd.id))
    assert isinstance(r, CommandResult) and r.outcome == "ok"
    ok = client_ctx(pki, pki.client.cert, pki.client.key)
    status, body = await fetch(a, f"/containerLogs/{NS}/{POD}/main", ok)
    assert status == 200 and "booting web-1" in body and "VMFENCE-READY" in body, body

    status, body = await fetch(a, f"/containerLogs/{NS}/{POD}/main?tailLines=1", ok)
    assert body == "VMFENCE-READY sim\n"
    status, body = await fetch(a, f"/containerLogs/{NS}/{POD}/main?timestamps=true", ok)
    assert all(re.match(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z ", ln) for ln in body.splitlines()), body
    status, body = await fetch(a, f"/containerLogs/{NS}/{POD}/main?sinceSeconds=3600", ok)
    assert "VMFENCE-READY" in body
    status, body = await fetch(a, f"/containerLogs/{NS}/{POD}/main?previous=true", ok)
    assert status == 400 and "not restarted" in body

    # previous: the console of the boot before a restart in place
    driver.crash_vm("web-1")
    start = command("start", "web-1", f)
    await send(nc, start)  # type: ignore[arg-type]
    assert (await reports.wait(is_result(start.id))).outcome == "ok"  # type: ignore[attr-defined]
    status, body = await fetch(a, f"/containerLogs/{NS}/{POD}/main?previous=true", ok)
    assert status == 200 and "booting web-1" in body

    # no such pod here; exec and friends name vmfence console
    status, body = await fetch(a, f"/containerLogs/{NS}/other/main", ok)
    assert status == 404 and "no VM of pod default/other" in body
    for what in ("exec", "attach", "portForward"):
        status, body = await fetch(a, f"/{what}/{NS}/{POD}/main?command=sh", ok)
        assert status == 501 and "vmfence console default/web" in body, (what, body)

    # the serial console is for the console's certificate only (the API server's is refused); the sim
    # has no interactive console and says so
    status, body = await fetch(a, f"/console/{NS}/{POD}", ok)
    assert status == 403, body
    op = client_ctx(pki, pki.console.cert, pki.console.key)
    status, body = await fetch(a, f"/console/{NS}/{POD}", op)
    assert status == 404 and "serial console" in body, body
    status, body = await fetch(a, f"/containerLogs/{NS}/{POD}/main", op)
    assert status == 403, "the console's certificate reads no logs"

    # another certificate of the same CA is refused; no certificate does not get through TLS
    other = _save(tmp_path / "pki", "intruder", _leaf_of(pki, "system:node:evil"))
    status, body = await fetch(a, f"/containerLogs/{NS}/{POD}/main", client_ctx(pki, other.cert, other.key))
    assert status == 403
    with pytest.raises(aiohttp.ClientError):
        await fetch(a, f"/containerLogs/{NS}/{POD}/main", client_ctx(pki))


def append(path: Path, data: bytes) -> None:
    with path.open("ab") as w:
        w.write(data)


def _leaf_of(pki: KubeletPki, cn: str):  # type: ignore[no-untyped-def]
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    ca_cert = x509.load_pem_x509_certificate(pki.ca.read_bytes())
    ca_key = serialization.load_pem_private_key((pki.ca.parent / "kubelet-ca.key").read_bytes(), None)
    return _leaf((ca_cert, ca_key), cn)  # type: ignore[arg-type]


async def test_follow_streams_what_the_console_writes(
    agent: tuple[Agent, SimDriver], nc: object, reports: Reports, pki: KubeletPki
) -> None:
    a, driver = agent
    f = fence(1, key=f"{NS}/{POD}")
    cmd = command("create", "web-2", f)
    await send(nc, cmd)  # type: ignore[arg-type]
    assert (await reports.wait(is_result(cmd.id))).outcome == "ok"  # type: ignore[attr-defined]
    console = Path(driver.serial_log("web-2"))
    assert a.kubelet is not None
    url = f"https://127.0.0.1:{a.kubelet.port}/containerLogs/{NS}/{POD}/main?follow=true&tailLines=1"
    ctx = client_ctx(pki, pki.client.cert, pki.client.key)
    async with aiohttp.ClientSession() as s, s.get(url, ssl=ctx, timeout=aiohttp.ClientTimeout(total=20)) as r:
        assert r.status == 200
        assert await r.content.readline() == b"VMFENCE-READY sim\n"
        await asyncio.to_thread(append, console, b"guest says hello\n")
        line = await asyncio.wait_for(r.content.readline(), 5)
        assert line == b"guest says hello\n"
        # the VM leaves the host: the stream ends
        rm = command("remove", "web-2", f)
        await send(nc, rm)  # type: ignore[arg-type]
        assert (await reports.wait(is_result(rm.id))).outcome == "ok"  # type: ignore[attr-defined]
        assert await asyncio.wait_for(r.content.read(), 5) == b""
