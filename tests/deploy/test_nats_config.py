"""The NATS configuration compose.yaml runs is accepted by a real nats-server, and its subject
permissions hold: each service's user can do its job and nothing that belongs to another.

A single-node variant of nats-1.conf (cluster block removed, loopback port, temporary store) is
started with the very same deploy/nats/accounts.conf, and nats-py clients log in as the services.
Denials are asserted on the server's "permissions violation" error, not on a timeout alone.
"""

from __future__ import annotations

import asyncio
import os
import re
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import nats
import nats.aio.msg
import nats.errors
import nats.js.errors
import pytest
import yaml
from nats.js.api import RetentionPolicy, StreamConfig

from .conftest import NATS_DIR, NATS_PASSWORD_ENV, REPO, find_tool

NATS_SERVER = find_tool("nats-server")
pytestmark = pytest.mark.skipif(NATS_SERVER is None, reason="nats-server binary not installed")

NODE_CONFS = [NATS_DIR / f"nats-{n}.conf" for n in (1, 2, 3)]


def _server_env() -> dict[str, str]:
    return {**os.environ, **NATS_PASSWORD_ENV}


# --------------------------------------------------------------------------------------------
# syntax: every node configuration compose.yaml mounts


def test_compose_mounts_the_node_configs() -> None:
    compose = yaml.safe_load((REPO / "compose.yaml").read_text())
    mounted: set[str] = set()
    for n in (1, 2, 3):
        svc = compose["services"][f"nats-{n}"]
        cmd = " ".join(svc["command"]) if isinstance(svc["command"], list) else svc["command"]
        conf = re.search(r"-c\s+(\S+)", cmd)
        assert conf, f"nats-{n} must start with -c <conf>"
        for vol in svc["volumes"]:
            src, _, rest = (vol if isinstance(vol, str) else f"{vol['source']}:{vol['target']}").partition(
                ":"
            )
            target = rest.split(":")[0]
            if src.startswith("./deploy/nats") and conf.group(1).startswith(target):
                mounted.add(f"nats-{n}")
                assert (REPO / src / Path(conf.group(1)).relative_to(target)).is_file()
    assert mounted == {"nats-1", "nats-2", "nats-3"}


@pytest.mark.parametrize("conf", NODE_CONFS, ids=lambda p: p.name)
def test_node_config_syntax(conf: Path) -> None:
    res = subprocess.run(
        [NATS_SERVER, "-c", str(conf), "-t"], env=_server_env(), capture_output=True, text=True, timeout=20
    )
    assert res.returncode == 0, res.stderr + res.stdout
    text = conf.read_text()
    assert re.search(r"sync_interval:\s*always", text), "JetStream must fsync before acknowledging"
    assert "include ./accounts.conf" in text
    for n in (1, 2, 3):
        assert f"nats-route://nats-{n}-route:6222" in text, "every node routes to all three (route-only names)"
    assert re.search(r"^\s+advertise:\s*nats-[123]-route:6222$", text, re.M), "peers learn the route-only name"
    # a client whose network is gone is dropped within about 30 s (3 pings 10 s apart)
    assert re.search(r'^ping_interval:\s*"10s"$', text, re.M) and re.search(r"^ping_max:\s*3$", text, re.M)


def test_node_config_refuses_to_start_without_passwords() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VMFENCE_NATS_")}
    res = subprocess.run(
        [NATS_SERVER, "-c", str(NODE_CONFS[0]), "-t"], env=env, capture_output=True, text=True, timeout=20
    )
    assert res.returncode != 0
    assert "VMFENCE_NATS_" in (res.stderr + res.stdout)


# --------------------------------------------------------------------------------------------
# a running single-node server with the same users and permissions


def _strip_block(text: str, name: str) -> str:
    m = re.search(rf"^{name}\s*\{{", text, re.M)
    assert m, f"no {name} block"
    depth, i = 0, m.end() - 1
    while True:
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[: m.start()] + text[i + 1 :]
        i += 1


def single_node_config(workdir: Path, port: int, http_port: int) -> str:
    """nats-1.conf with the cluster block removed, loopback ports, a temporary store, and the
    include pointing (relatively: nats-server only resolves relative includes) at the repository's
    deploy/nats/accounts.conf itself."""
    text = _strip_block(NODE_CONFS[0].read_text(), "cluster")
    text = re.sub(r"^listen:.*$", f"listen: 127.0.0.1:{port}", text, flags=re.M)
    text = re.sub(r"^http:.*$", f"http: 127.0.0.1:{http_port}", text, flags=re.M)
    text = re.sub(r"store_dir:.*$", f"store_dir: {workdir / 'js'}", text, flags=re.M)
    # max_file_store stays the deployment's: the streams reserve their byte bounds against it
    rel = os.path.relpath(NATS_DIR / "accounts.conf", workdir)
    text = text.replace("include ./accounts.conf", f"include {rel}")
    assert "cluster" not in re.sub(r"#.*", "", text)
    return text


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def nats_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    workdir = tmp_path_factory.mktemp("nats")
    port, http_port = _free_port(), _free_port()
    conf = workdir / "single.conf"
    conf.write_text(single_node_config(workdir, port, http_port))
    log = (workdir / "server.log").open("w")
    proc = subprocess.Popen([NATS_SERVER, "-c", str(conf)], env=_server_env(), stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + 15
        while True:
            if proc.poll() is not None:
                raise RuntimeError("nats-server exited:\n" + (workdir / "server.log").read_text())
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        url = f"nats://127.0.0.1:{port}"
        asyncio.run(_provision(url))
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


async def _provision(url: str) -> None:
    """The reconciler provisions streams and buckets: with the project's own provisioning code
    when it exists (shared.bus.provision), else with equivalent nats-py calls."""
    nc = await nats.connect(
        url, user="reconciler", password=NATS_PASSWORD_ENV["VMFENCE_NATS_RECONCILER_PASSWORD"]
    )
    try:
        js = nc.jetstream()
        try:
            from shared.bus.provision import StreamsConfig, provision
            from shared.subjects import Subjects
        except ImportError:
            await js.add_stream(StreamConfig(name="VMFENCE_IN", subjects=["vmfence.in.>"]))
            await js.add_stream(StreamConfig(name="VMFENCE_LOG", subjects=["vmfence.log.>"]))
            await js.add_stream(
                StreamConfig(
                    name="VMFENCE_CMD", subjects=["vmfence.cmd.>"], retention=RetentionPolicy.WORK_QUEUE
                )
            )
            await js.add_stream(StreamConfig(name="VMFENCE_DLQ", subjects=["vmfence.dlq.>"]))
            await js.create_key_value(bucket="vmfence_leases", ttl=30)
            await js.create_key_value(bucket="vmfence_hosts", ttl=30)
        else:
            cfg = StreamsConfig(replicas=1, lease_ttl_s=30, hosts_ttl_s=30)
            await provision(js, Subjects(), cfg)
            await provision(js, Subjects(), cfg)  # idempotent: the update path is permitted too
        # one command for each agent host
        for host in ("host-a", "host-b"):
            ack = await js.publish(
                f"vmfence.cmd.{host}", f"start vm for {host}".encode(), stream="VMFENCE_CMD"
            )
            assert ack.stream == "VMFENCE_CMD"
    finally:
        await nc.close()


@dataclass
class Client:
    nc: nats.NATS
    errors: list[Exception] = field(default_factory=list)

    def violations(self) -> list[str]:
        return [str(e) for e in self.errors if "permissions violation" in str(e).lower()]

    async def wait_violation(self, subject: str, within: float = 2.0) -> str:
        """Wait for the server's permissions violation naming `subject` (it arrives asynchronously)."""
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            for v in self.violations():
                if f'"{subject.lower()}"' in v.lower():
                    return v
            await asyncio.sleep(0.02)
        raise AssertionError(f"no permissions violation for {subject!r}; errors: {self.errors!r}")


USERS = {
    "watcher": "VMFENCE_NATS_WATCHER_PASSWORD",
    "reconciler": "VMFENCE_NATS_RECONCILER_PASSWORD",
    "agent-host-a": "VMFENCE_NATS_AGENT_HOST_A_PASSWORD",
    "agent-host-b": "VMFENCE_NATS_AGENT_HOST_B_PASSWORD",
    "audit": "VMFENCE_NATS_AUDIT_PASSWORD",
    "operator": "VMFENCE_NATS_OPERATOR_PASSWORD",
    "admin": "VMFENCE_NATS_ADMIN_PASSWORD",
}


async def connect(url: str, user: str) -> Client:
    client = Client(nc=None)  # type: ignore[arg-type]

    async def on_error(e: Exception) -> None:
        client.errors.append(e)

    client.nc = await nats.connect(
        url,
        user=user,
        password=NATS_PASSWORD_ENV[USERS[user]],
        error_cb=on_error,
        allow_reconnect=False,
    )
    return client


async def _pending(url: str, host: str) -> int:
    """Messages still waiting in VMFENCE_CMD for a host (read as admin)."""
    admin = await connect(url, "admin")
    try:
        info = await admin.nc.jetstream().stream_info("VMFENCE_CMD", subjects_filter=f"vmfence.cmd.{host}")
        return int((info.state.subjects or {}).get(f"vmfence.cmd.{host}", 0))
    finally:
        await admin.nc.close()


async def test_wrong_password_is_refused(nats_url: str) -> None:
    with pytest.raises(nats.errors.Error):
        await nats.connect(
            nats_url,
            user="agent-host-a",
            password="wrong",
            allow_reconnect=False,
            max_reconnect_attempts=0,
            connect_timeout=2,
        )


async def test_agent_consumes_only_its_own_commands(nats_url: str) -> None:
    agent = await connect(nats_url, "agent-host-a")
    try:
        js = agent.nc.jetstream(timeout=1.0)

        # A create request on its own (permitted) subject whose body filters another host's
        # commands: the server compares the body's filter with the subject's and refuses.
        raw = await agent.nc.request(
            "$JS.API.CONSUMER.CREATE.VMFENCE_CMD.agent-host-a.vmfence.cmd.host-a",
            (
                b'{"stream_name":"VMFENCE_CMD","config":{"name":"agent-host-a","durable_name":"agent-host-a",'
                b'"filter_subject":"vmfence.cmd.host-b","ack_policy":"explicit"}}'
            ),
            timeout=2,
        )
        assert b'"error"' in raw.data, raw.data
        assert not agent.violations()

        # its own durable, its own host: works, and acks are permitted
        sub = await js.pull_subscribe("vmfence.cmd.host-a", durable="agent-host-a", stream="VMFENCE_CMD")
        msgs = await sub.fetch(1, timeout=2)
        assert [m.data for m in msgs] == [b"start vm for host-a"]
        await msgs[0].ack_sync(timeout=2)
        assert not agent.violations(), agent.errors
        assert await _pending(nats_url, "host-a") == 0

        # another host's durable: neither inspecting, creating nor pulling from it is permitted
        with pytest.raises((nats.errors.TimeoutError, asyncio.TimeoutError)):
            await js.pull_subscribe("vmfence.cmd.host-b", durable="agent-host-b", stream="VMFENCE_CMD")
        await agent.wait_violation("$JS.API.CONSUMER.INFO.VMFENCE_CMD.agent-host-b")
        bound = await js.pull_subscribe_bind(durable="agent-host-b", stream="VMFENCE_CMD")
        with pytest.raises((nats.errors.TimeoutError, asyncio.TimeoutError)):
            await bound.fetch(1, timeout=1)
        await agent.wait_violation("$JS.API.CONSUMER.MSG.NEXT.VMFENCE_CMD.agent-host-b")
        # and the old-style durable create is not permitted either
        await agent.nc.publish("$JS.API.CONSUMER.DURABLE.CREATE.VMFENCE_CMD.agent-host-b", b"{}")
        await agent.wait_violation("$JS.API.CONSUMER.DURABLE.CREATE.VMFENCE_CMD.agent-host-b")
        assert await _pending(nats_url, "host-b") == 1, "host-b's command must still be waiting for host-b"
    finally:
        await agent.nc.close()


async def test_agent_cannot_publish_commands_or_log(nats_url: str) -> None:
    agent = await connect(nats_url, "agent-host-a")
    try:
        for subject in (
            "vmfence.cmd.host-b",
            "vmfence.cmd.host-a",
            "vmfence.log.3.default.web-0",
            "vmfence.in.3.pod.default.web-0",
            "$KV.vmfence_leases.3",
            "$KV.vmfence_hosts.host-b",
        ):
            await agent.nc.publish(subject, b"forged")
            await agent.nc.flush()
            await agent.wait_violation(subject)
        assert await _pending(nats_url, "host-b") == 1
    finally:
        await agent.nc.close()


async def test_agent_publishes_reports_and_its_heartbeat(nats_url: str) -> None:
    agent = await connect(nats_url, "agent-host-a")
    try:
        js = agent.nc.jetstream(timeout=2)
        ack = await js.publish("vmfence.in.3.agent.host-a.default.web-0", b"vm started")
        assert ack.stream == "VMFENCE_IN"
        ack = await js.publish("vmfence.dlq.agent", b"undecodable command")
        assert ack.stream == "VMFENCE_DLQ"
        kv = await js.key_value("vmfence_hosts")
        rev = await kv.put("host-a", b'{"cpus": 4}')
        assert rev > 0
        assert (await kv.get("host-a")).value == b'{"cpus": 4}'
        assert not agent.violations(), agent.errors
    finally:
        await agent.nc.close()


async def test_watcher_publishes_observations_but_not_the_log(nats_url: str) -> None:
    watcher = await connect(nats_url, "watcher")
    try:
        js = watcher.nc.jetstream(timeout=2)
        ack = await js.publish("vmfence.in.5.pod.default.web-0", b"pod", headers={"Nats-Msg-Id": "uid-1:42"})
        assert ack.stream == "VMFENCE_IN"
        ack = await js.publish("vmfence.in.5.vm.default.vm-0", b"vm")
        assert ack.stream == "VMFENCE_IN"
        assert not watcher.violations()
        for subject in (
            "vmfence.log.5.default.web-0",
            "vmfence.cmd.host-a",
            "vmfence.in.5.report.default.web-0",
        ):
            await watcher.nc.publish(subject, b"forged")
            await watcher.nc.flush()
            await watcher.wait_violation(subject)
        # and it cannot read the input stream it writes (no consumer creation on VMFENCE_IN)
        await watcher.nc.publish("$JS.API.CONSUMER.CREATE.VMFENCE_IN.reconciler-p5", b"{}")
        await watcher.wait_violation("$JS.API.CONSUMER.CREATE.VMFENCE_IN.reconciler-p5")
    finally:
        await watcher.nc.close()


async def test_reconciler_appends_commands_and_consumes_inputs(nats_url: str) -> None:
    rec = await connect(nats_url, "reconciler")
    try:
        js = rec.nc.jetstream(timeout=2)
        subject = "vmfence.log.7.default.web-0"
        first = await js.publish(subject, b"Admitted", headers={"Nats-Expected-Last-Subject-Sequence": "0"})
        assert first.stream == "VMFENCE_LOG"
        # a stale append is refused by the stream (the fence), not by permissions
        with pytest.raises(nats.js.errors.APIError) as err:
            await js.publish(subject, b"Placed", headers={"Nats-Expected-Last-Subject-Sequence": "0"})
        assert err.value.err_code == 10071
        last = await js.get_last_msg("VMFENCE_LOG", subject)
        assert last.data == b"Admitted"

        ack = await js.publish("vmfence.cmd.host-b", b"stop vm")
        assert ack.stream == "VMFENCE_CMD"
        ack = await js.publish("vmfence.in.7.report.default.web-0", b"k8s write done")
        assert ack.stream == "VMFENCE_IN"

        sub = await js.pull_subscribe("vmfence.in.5.>", durable="reconciler-p5", stream="VMFENCE_IN")
        msgs = await sub.fetch(1, timeout=2)
        await msgs[0].ack_sync(timeout=2)

        leases = await js.key_value("vmfence_leases")
        await leases.create("5", b"reconciler-0")
        hosts = await js.key_value("vmfence_hosts")
        with pytest.raises(nats.js.errors.KeyNotFoundError):
            await hosts.get("host-z")
        assert not rec.violations(), rec.errors

        # but it may not write host heartbeats (agents own them)
        await rec.nc.publish("$KV.vmfence_hosts.host-a", b"forged")
        await rec.nc.flush()
        await rec.wait_violation("$KV.vmfence_hosts.host-a")
        assert await _pending(nats_url, "host-b") == 2
        # consume the extra command again so test order does not matter for _pending() counts
        admin = await connect(nats_url, "admin")
        try:
            await admin.nc.jetstream().purge_stream("VMFENCE_CMD", subject="vmfence.cmd.host-b")
            await admin.nc.jetstream().publish("vmfence.cmd.host-b", b"start vm for host-b")
        finally:
            await admin.nc.close()
    finally:
        await rec.nc.close()


async def test_partition_images_are_the_reconcilers_alone(nats_url: str) -> None:
    """A reconciler puts and reads partition images (services/reconciler/images.py); no other user
    may write one (a forged image would be loaded as a partition's state) or read one."""
    from services.reconciler.images import ImageStore
    from shared.fence.state import KeyState, encode_state
    from shared.subjects import Subjects

    subjects = Subjects()
    key = "default/img-0"
    p = subjects.partition(key)
    rec = await connect(nats_url, "reconciler")
    try:
        store = ImageStore(rec.nc.jetstream(timeout=2), subjects, stream_identity="s", writer="r1")
        assert await store.put(p, [(key, 7, encode_state(KeyState(key=key)))], 9)
        got = await store.get(p)
        assert got is not None and got[0] == 9 and got[1][key][1] == 7
        assert not rec.violations(), rec.errors
    finally:
        await rec.nc.close()
    for user in ("agent-host-a", "watcher", "audit"):
        other = await connect(nats_url, user)
        try:
            for subject in (subjects.image(p), "$JS.API.STREAM.MSG.GET.VMFENCE_IMAGES"):
                await other.nc.publish(subject, b"forged")
                await other.nc.flush()
                await other.wait_violation(subject)
        finally:
            await other.nc.close()


async def test_audit_reads_the_log_but_writes_nothing(nats_url: str) -> None:
    audit = await connect(nats_url, "audit")
    try:
        js = audit.nc.jetstream(timeout=2)
        info = await js.stream_info("VMFENCE_LOG")
        assert info.config.name == "VMFENCE_LOG"
        sub = await js.subscribe("vmfence.log.>", ordered_consumer=True, deliver_policy=None)
        await sub.unsubscribe()
        for subject in ("vmfence.log.7.default.web-0", "vmfence.cmd.host-a", "$KV.vmfence_leases.5"):
            await audit.nc.publish(subject, b"forged")
            await audit.nc.flush()
            await audit.wait_violation(subject)
    finally:
        await audit.nc.close()


async def test_project_bus_helpers_work_under_each_users_permissions(nats_url: str) -> None:
    """The project's own bus code (shared.bus.*), run as the user of the service that uses it."""
    from shared.bus.append import fenced_append, publish_input
    from shared.bus.deadletter import dead_letter
    from shared.bus.leases import PartitionLease
    from shared.bus.read import last_on_subject, read_stream, read_subject
    from shared.fence.keys import Key
    from shared.subjects import Subjects

    subjects = Subjects()
    key = Key("pod", "default", "web.1")
    rec = await connect(nats_url, "reconciler")
    watcher = await connect(nats_url, "watcher")
    agent = await connect(nats_url, "agent-host-a")
    audit = await connect(nats_url, "audit")
    try:
        # watcher: observation and a dead letter
        wjs = watcher.nc.jetstream(timeout=2)
        await publish_input(wjs, subjects.observation(key), b"pod", msg_id="uid-9:1")
        await dead_letter(wjs, subjects, source="watcher", reason="undecodable", subject="x", data=b"?")
        # agent: a report
        ajs = agent.nc.jetstream(timeout=2)
        await publish_input(ajs, subjects.host_report(key, "host-a"), b"started", msg_id="cmd-1:result")
        # reconciler: fenced appends, reads, leases
        rjs = rec.nc.jetstream(timeout=2)
        log_subject = subjects.log(key)
        seq1 = await fenced_append(
            rjs,
            log_subject,
            b"Admitted",
            expected_last_subject_seq=0,
            msg_id="r1:1",
            stream=subjects.stream_log,
        )
        await fenced_append(
            rjs,
            log_subject,
            b"Placed",
            expected_last_subject_seq=seq1,
            msg_id="r1:2",
            stream=subjects.stream_log,
        )
        last = await last_on_subject(rjs, subjects.stream_log, log_subject)
        assert last is not None and last.data == b"Placed"
        assert [m.data async for m in read_subject(rjs, subjects.stream_log, log_subject)] == [
            b"Admitted",
            b"Placed",
        ]
        assert b"Placed" in [m.data async for m in read_stream(rjs, subjects.stream_log)]
        lease = PartitionLease(await rjs.key_value(subjects.kv_leases), 9, "reconciler-1")
        rev = await lease.acquire()
        assert rev is not None
        rev = await lease.renew(rev)
        assert await lease.release(rev)
        # audit: the whole log, read only
        xjs = audit.nc.jetstream(timeout=2)
        assert b"Placed" in [m.data async for m in read_stream(xjs, subjects.stream_log)]
        for c in (rec, watcher, agent, audit):
            assert not c.violations(), c.errors
    finally:
        for c in (rec, watcher, agent, audit):
            await c.nc.close()


# --------------------------------------------------------------------------------------------
# the three node configurations form a JetStream cluster (rewritten only to loopback addresses)


def cluster_node_config(n: int, workdir: Path, ports: dict[int, tuple[int, int, int]]) -> str:
    client, http, route = ports[n]
    text = NODE_CONFS[n - 1].read_text()
    text = re.sub(r"^listen:.*$", f"listen: 127.0.0.1:{client}", text, flags=re.M)
    text = re.sub(r"^http:.*$", f"http: 127.0.0.1:{http}", text, flags=re.M)
    text = re.sub(r"store_dir:.*$", f"store_dir: {workdir / 'js'}", text, flags=re.M)
    # max_file_store stays the deployment's: the streams reserve their byte bounds against it
    text, subs = re.subn(
        r"^(\s+)listen:\s*0\.0\.0\.0:6222", rf"\g<1>listen: 127.0.0.1:{route}", text, flags=re.M
    )
    assert subs == 1, "cluster listen"
    for m in (1, 2, 3):
        text = text.replace(f"nats-route://nats-{m}-route:6222", f"nats-route://127.0.0.1:{ports[m][2]}")
    text, subs = re.subn(r"^(\s+)advertise:.*$", rf"\g<1>advertise: 127.0.0.1:{route}", text, flags=re.M)
    assert subs == 1, "cluster advertise"
    rel = os.path.relpath(NATS_DIR / "accounts.conf", workdir)
    return text.replace("include ./accounts.conf", f"include {rel}")


@pytest.fixture
def cluster_urls(tmp_path: Path) -> Iterator[list[str]]:
    ports = {n: (_free_port(), _free_port(), _free_port()) for n in (1, 2, 3)}
    procs = []
    try:
        for n in (1, 2, 3):
            d = tmp_path / f"nats-{n}"
            d.mkdir()
            (d / "node.conf").write_text(cluster_node_config(n, d, ports))
            with (d / "server.log").open("w") as log:
                cmd = [NATS_SERVER, "-c", str(d / "node.conf")]
                procs.append(subprocess.Popen(cmd, env=_server_env(), stdout=log, stderr=log))
        yield [f"nats://127.0.0.1:{ports[n][0]}" for n in (1, 2, 3)]
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()


async def test_three_node_cluster_from_the_node_configs(cluster_urls: list[str]) -> None:
    async def quiet(_: Exception) -> None:
        return None

    password = NATS_PASSWORD_ENV["VMFENCE_NATS_RECONCILER_PASSWORD"]
    deadline = time.monotonic() + 30
    while True:
        try:
            nc = await nats.connect(
                cluster_urls,
                user="reconciler",
                password=password,
                error_cb=quiet,
                connect_timeout=1,
                max_reconnect_attempts=0,
            )
            break
        except (nats.errors.Error, OSError):
            assert time.monotonic() < deadline, "cluster did not accept connections"
            await asyncio.sleep(0.2)
    try:
        js = nc.jetstream(timeout=5)
        while True:  # until the JetStream meta leader is elected
            try:
                await js.add_stream(
                    StreamConfig(name="VMFENCE_LOG", subjects=["vmfence.log.>"], num_replicas=3)
                )
                break
            except (nats.errors.Error, nats.js.errors.Error):
                assert time.monotonic() < deadline, "no JetStream meta leader"
                await asyncio.sleep(0.3)
        info = await js.stream_info("VMFENCE_LOG")
        assert info.cluster is not None and info.cluster.name == "vmfence"
        peers = {info.cluster.leader, *(p.name for p in info.cluster.replicas or [])}
        assert peers == {"nats-1", "nats-2", "nats-3"}, "an R3 stream over the three nodes"
        ack = await js.publish(
            "vmfence.log.1.default.web-0", b"Admitted", headers={"Nats-Expected-Last-Subject-Sequence": "0"}
        )
        assert ack.seq == 1
    finally:
        await nc.close()


async def test_inventory_queries_only_audit_asks_and_only_that_hosts_agent_answers(nats_url: str) -> None:
    """`vmfence verify` asks each host's agent on core request/reply: audit may ask; an agent may
    answer its own host's question (on the asker's reply subject) and may neither listen to another
    host's questions nor ask one itself; the watcher may not ask."""
    agent_a = await connect(nats_url, "agent-host-a")
    agent_b = await connect(nats_url, "agent-host-b")
    audit = await connect(nats_url, "audit")
    watcher = await connect(nats_url, "watcher")
    try:
        async def answer(msg: nats.aio.msg.Msg) -> None:
            await msg.respond(b"host-a's VMs")

        await agent_a.nc.subscribe("vmfence.agent.host-a.inventory", cb=answer)
        await agent_a.nc.flush()
        for _ in range(50):  # the server may answer 503 "no responders" until the interest reaches it
            try:
                reply = await audit.nc.request("vmfence.agent.host-a.inventory", b"", timeout=2)
                break
            except nats.errors.NoRespondersError:
                await asyncio.sleep(0.02)
        assert reply.data == b"host-a's VMs"
        await agent_b.nc.subscribe("vmfence.agent.host-a.inventory")  # listening to another host
        await agent_b.nc.flush()
        await agent_b.wait_violation("vmfence.agent.host-a.inventory")
        for asker in (agent_b, watcher):
            await asker.nc.publish("vmfence.agent.host-a.inventory", b"", reply="_INBOX.x")
            await asker.nc.flush()
            await asker.wait_violation("vmfence.agent.host-a.inventory")
    finally:
        for c in (agent_a, agent_b, audit, watcher):
            await c.nc.close()


async def test_an_agent_reports_only_under_its_own_host(nats_url: str) -> None:
    """Finding 4 of issue 10: a report's host is bound to its sender. host-a's agent may publish a
    report under host-a only: not under host-b's subject, and not on the unbound report subject."""
    agent = await connect(nats_url, "agent-host-a")
    try:
        for subject in ("vmfence.in.3.agent.host-b.default.web-0", "vmfence.in.3.report.default.web-0"):
            await agent.nc.publish(subject, b"VM gone, says host-a about host-b")
            await agent.nc.flush()
            await agent.wait_violation(subject)
    finally:
        await agent.nc.close()



async def test_vnc_questions_only_operator_asks_and_only_it_reads_the_answer(nats_url: str) -> None:
    """`vmfence vnc` asks a host's agent for a VM's VNC password: operator may ask and read the
    answer on its private reply subjects (_VNC_INBOX.>); audit and the watcher may not ask, audit may
    not read those replies, and host-b's agent may not listen to host-a's question."""
    agent_a = await connect(nats_url, "agent-host-a")
    agent_b = await connect(nats_url, "agent-host-b")
    operator = await connect(nats_url, "operator")
    audit = await connect(nats_url, "audit")
    watcher = await connect(nats_url, "watcher")
    subject = "vmfence.agent.host-a.vnc"
    try:
        async def answer(msg: nats.aio.msg.Msg) -> None:
            await msg.respond(b"display and password")

        await agent_a.nc.subscribe(subject, cb=answer)
        await agent_a.nc.flush()
        got: asyncio.Queue[nats.aio.msg.Msg] = asyncio.Queue()
        await operator.nc.subscribe("_VNC_INBOX.t1", cb=got.put)
        for _ in range(50):  # the agent's interest can reach the asker's side a moment after its flush
            await operator.nc.publish(subject, b"{}", reply="_VNC_INBOX.t1")
            reply = await asyncio.wait_for(got.get(), 2)
            if (reply.headers or {}).get("Status") != "503":  # 503: no responders yet
                break
        assert reply.data == b"display and password"
        assert operator.violations() == []
        # audit may read every _INBOX.> reply, not the operator's private ones
        await audit.nc.subscribe("_VNC_INBOX.>")
        await audit.nc.flush()
        await audit.wait_violation("_VNC_INBOX.>")
        await agent_b.nc.subscribe(subject)  # listening to another host's questions
        await agent_b.nc.flush()
        await agent_b.wait_violation(subject)
        for asker in (audit, watcher, agent_b):
            await asker.nc.publish(subject, b"{}", reply="_INBOX.x")
            await asker.nc.flush()
            await asker.wait_violation(subject)
    finally:
        for c in (agent_a, agent_b, operator, audit, watcher):
            await c.nc.close()
