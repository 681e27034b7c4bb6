"""The agent binary logs in to a nats-server configured from deploy/nats/accounts.conf as its own
per-host user, the way compose.yaml and the Helm chart's ``natsAuth: secret`` run it
(``VMFENCE_NATS_USER``/``VMFENCE_NATS_PASSWORD``): it gets ready, heartbeats and executes a
command within its permissions. A wrong password ends it at once with one clear line, and no
password ever appears in its output, not even at debug level or when it is given inside the URL.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import msgspec
import nats
import pytest

from services.testbed.natsserver import NatsServer, free_port
from shared.bus.provision import StreamsConfig, provision
from shared.fence.heartbeat import HostHeartbeat
from shared.fence.schema import Command, CommandResult, Fence, Spec, decode_input, encode
from shared.subjects import Subjects
from tests.agent.test_process import AgentProc

from .conftest import NATS_PASSWORD_ENV, REPO
from .test_nats_config import NATS_SERVER, single_node_config

pytestmark = pytest.mark.skipif(NATS_SERVER is None, reason="nats-server binary not installed")

VMFENCE = REPO / ".venv" / "bin" / "vmfence"
HOST = "host-a"
USER = "agent-host-a"
PASSWORD = NATS_PASSWORD_ENV["VMFENCE_NATS_AGENT_HOST_A_PASSWORD"]
RECONCILER_PASSWORD = NATS_PASSWORD_ENV["VMFENCE_NATS_RECONCILER_PASSWORD"]
READY_S = 30.0


@pytest.fixture(scope="module")
def nats_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A single-node server with the repository's accounts.conf, provisioned as the reconciler."""
    assert NATS_SERVER is not None
    workdir = tmp_path_factory.mktemp("nats-creds")
    port, http_port = free_port(), free_port()
    server = NatsServer(  # JetStream and its store come from the config, as in deploy/nats
        store_dir=str(workdir), port=port, http_port=http_port, binary=NATS_SERVER, jetstream=False,
        config_text=single_node_config(workdir, port, http_port),
    )
    with mock.patch.dict(os.environ, NATS_PASSWORD_ENV):  # the server resolves its passwords from these
        asyncio.run(server.start())
    try:
        asyncio.run(_provision(server.url))
        yield server.url
    finally:
        asyncio.run(server.stop())


async def _provision(url: str) -> None:
    nc = await nats.connect(url, user="reconciler", password=RECONCILER_PASSWORD, allow_reconnect=False)
    try:
        await provision(nc.jetstream(), Subjects(), StreamsConfig(replicas=1, lease_ttl_s=30, hosts_ttl_s=30))
    finally:
        await nc.close()


@contextlib.asynccontextmanager
async def agent(tmp_path: Path, *args: str, **env: str) -> AsyncIterator[AgentProc]:
    """``vmfence agent`` (the installed console script) as compose runs it: settings from VMFENCE_*."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("VMFENCE_")}
    proc = await asyncio.create_subprocess_exec(
        str(VMFENCE), "agent", "--runtime", "sim", "--host", HOST, "--data-dir", str(tmp_path / "agent"),
        "--http-host", "127.0.0.1", "--http-port", "0", "--log-level", "debug", "--connect-timeout", "20", *args,
        env={**clean, **env}, cwd=str(tmp_path), stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    a = AgentProc(proc)
    try:
        yield a
    finally:
        try:
            await a.finish(signal.SIGTERM if proc.returncode is None else None)
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
            assert proc.stdout is not None
            a.raw.extend((await proc.stdout.read()).decode(errors="replace").splitlines())


def output(a: AgentProc) -> str:
    return "\n".join(a.raw)


async def _heartbeat_and_command(url: str) -> None:
    """As the reconciler: the agent's heartbeat is in KV, and a create sent to it is executed (its
    result, a report the agent publishes, is watched as admin)."""
    rec = await nats.connect(url, user="reconciler", password=RECONCILER_PASSWORD, allow_reconnect=False)
    admin = await nats.connect(url, user="admin", password=NATS_PASSWORD_ENV["VMFENCE_NATS_ADMIN_PASSWORD"],
                               allow_reconnect=False)
    try:
        js = rec.jetstream()
        kv = await js.key_value("vmfence_hosts")
        beat = msgspec.json.decode((await kv.get(HOST)).value, type=HostHeartbeat)
        assert beat.host == HOST and beat.runtime == "sim"
        results: asyncio.Queue[CommandResult] = asyncio.Queue()

        async def on_report(msg: Any) -> None:
            inp = decode_input(msg.data)
            if isinstance(inp, CommandResult):
                await results.put(inp)

        await admin.subscribe(f"vmfence.in.*.agent.{HOST}.>", cb=on_report)
        await admin.flush()
        f = Fence("default/web", "uid-1", 1)
        cmd = Command(id="uid-1:1:create:web-1", op="create", fence=f, host=HOST, vm_id="web-1",
                      spec=Spec(cpus=1, memory_mib=64))
        await js.publish(Subjects().command(HOST), encode(cmd), headers={"Nats-Msg-Id": cmd.id}, timeout=5)
        result = await asyncio.wait_for(results.get(), READY_S)
        assert result.command_id == cmd.id and result.outcome == "ok", result
    finally:
        await rec.close()
        await admin.close()


async def test_agent_logs_in_as_its_host_user(nats_url: str, tmp_path: Path) -> None:
    async with agent(tmp_path, "--nats-url", nats_url, VMFENCE_NATS_USER=USER, VMFENCE_NATS_PASSWORD=PASSWORD) as a:
        await a.wait_event("ready")
        await _heartbeat_and_command(nats_url)
    assert a.proc.returncode == 0, output(a)
    assert not [e for e in a.lines if "Authorization" in str(e.get("msg")) or "permissions" in str(e.get("msg"))]
    debug = [e for e in a.lines if str(e.get("msg", "")).startswith("effective configuration")]
    assert debug and "nats_password=***" in debug[0]["msg"] and f"nats_user={USER}" in debug[0]["msg"]
    assert PASSWORD not in output(a)


async def test_a_password_in_the_url_works_and_is_never_shown(nats_url: str, tmp_path: Path) -> None:
    url = nats_url.replace("nats://", f"nats://{USER}:{PASSWORD}@")
    async with agent(tmp_path, VMFENCE_NATS_URL=url) as a:
        await a.wait_event("ready")
    assert a.proc.returncode == 0, output(a)
    assert PASSWORD not in output(a)
    assert f"{USER}:***@" in output(a)  # the connecting line and the debug config show it masked


async def test_a_wrong_password_is_one_clear_line(nats_url: str, tmp_path: Path) -> None:
    wrong = "not-the-password-0123"
    started = time.monotonic()
    async with agent(tmp_path, "--nats-url", nats_url, VMFENCE_NATS_USER=USER, VMFENCE_NATS_PASSWORD=wrong) as a:
        rc = await asyncio.wait_for(a.proc.wait(), READY_S)
    assert rc == 1, output(a)
    assert time.monotonic() - started < 15, "a refused login is not retried until the connect timeout"
    plain = [line for line in a.raw if line and not line.startswith("{")]
    assert len(plain) == 1, output(a)
    assert plain[0].startswith("vmfence agent: error:") and "refused user 'agent-host-a'" in plain[0], plain
    assert "authorization violation" in plain[0]
    warnings = [e for e in a.lines if e.get("level") in ("warning", "error")]
    assert not warnings, warnings  # no retry storm of "nats error" lines before it
    assert wrong not in output(a) and PASSWORD not in output(a)


async def test_a_user_without_a_password_is_a_config_error(tmp_path: Path) -> None:
    async with agent(tmp_path, "--nats-url", "nats://127.0.0.1:1", VMFENCE_NATS_USER=USER) as a:
        rc = await asyncio.wait_for(a.proc.wait(), READY_S)
    assert rc == 2
    assert a.raw == ["vmfence agent: error: --nats-user/VMFENCE_NATS_USER and "
                     "--nats-password/VMFENCE_NATS_PASSWORD go together"], a.raw


@pytest.mark.parametrize("password", [NATS_PASSWORD_ENV["VMFENCE_NATS_AUDIT_PASSWORD"], "not-the-audit-password"])
def test_operator_commands_log_in_through_the_same_settings(nats_url: str, tmp_path: Path, password: str) -> None:
    """``vmfence decisions`` as the read-only audit user, from the same VMFENCE_NATS_* variables."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("VMFENCE_")}
    env = {**clean, "VMFENCE_NATS_URL": nats_url, "VMFENCE_NATS_USER": "audit", "VMFENCE_NATS_PASSWORD": password}
    out = subprocess.run([str(VMFENCE), "decisions", "--json"], env=env, cwd=tmp_path, capture_output=True,
                         text=True, timeout=60)
    right = password == NATS_PASSWORD_ENV["VMFENCE_NATS_AUDIT_PASSWORD"]
    assert out.returncode == (0 if right else 2), out.stderr
    if not right:
        assert out.stderr.count("\n") == 1 and "refused user 'audit'" in out.stderr, out.stderr
    assert password not in out.stdout + out.stderr


# --------------------------------------------------------------------------------------------
# TLS: the servers' CA and a client certificate, from the same settings


OPENSSL = shutil.which("openssl")


def _openssl(*args: str, cwd: Path) -> None:
    assert OPENSSL is not None
    subprocess.run([OPENSSL, *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _certificates(d: Path) -> None:
    """A throw-away CA, a server certificate for 127.0.0.1 and a client certificate, in ``d``."""
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "1",
             "-subj", "/CN=vmfence-test-ca", cwd=d)
    for name, ext in (("server", "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth\n"),
                      ("client", "extendedKeyUsage=clientAuth\n")):
        (d / f"{name}.ext").write_text(ext)
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
                 "-subj", f"/CN=vmfence-test-{name}", cwd=d)
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                 "-out", f"{name}.pem", "-days", "1", "-extfile", f"{name}.ext", cwd=d)


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """A nats-server that requires TLS with a client certificate signed by the test CA."""
    if OPENSSL is None:
        pytest.skip("openssl not installed")
    assert NATS_SERVER is not None
    d = tmp_path_factory.mktemp("nats-tls")
    _certificates(d)
    conf = (f'tls {{ cert_file: "{d / "server.pem"}", key_file: "{d / "server.key"}", '
            f'ca_file: "{d / "ca.pem"}", verify: true }}\n')
    server = NatsServer(store_dir=str(d / "store"), port=free_port(), http_port=free_port(), binary=NATS_SERVER,
                        config_text=conf)
    asyncio.run(server.start())
    try:
        yield f"tls://127.0.0.1:{server.port}", d
    finally:
        asyncio.run(server.stop())


async def test_agent_connects_over_tls_with_a_client_certificate(
    tls_server: tuple[str, Path], tmp_path: Path
) -> None:
    url, d = tls_server
    tls = ["--nats-tls-ca", str(d / "ca.pem"), "--nats-tls-cert", str(d / "client.pem"),
           "--nats-tls-key", str(d / "client.key")]
    async with agent(tmp_path, "--nats-url", url, "--provision", *tls) as a:
        await a.wait_event("ready")
    assert a.proc.returncode == 0, output(a)
    # without a client certificate the server refuses the handshake: a bounded start, one line
    async with agent(tmp_path, "--nats-url", url, "--connect-timeout", "3", *tls[:2]) as b:
        rc = await asyncio.wait_for(b.proc.wait(), READY_S)
    assert rc == 1 and b.raw[-1].startswith("vmfence agent: error:") and "NATS" in b.raw[-1], output(b)
