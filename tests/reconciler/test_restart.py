"""A reconciler process killed with SIGKILL mid-stream and restarted: no decision lost, none
duplicated, and the restart catches up from its snapshot instead of replaying everything."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from kubernetes_asyncio import client, config

from services.apiserver.server import ApiServer, start_apiserver, write_kubeconfig
from services.testbed.natsserver import NatsServer
from shared.bus.connect import Bus
from shared.bus.provision import StreamsConfig, provision
from shared.fence.audit import audit
from shared.fence.keys import Key
from shared.fence.schema import Admitted, Commanded
from shared.subjects import Subjects
from tests.reconciler.helpers import log_entries, observe, per_key, sim_agent

PODS = 60
PARTITIONS = 4


@pytest.fixture
async def apiserver() -> AsyncIterator[ApiServer]:
    server = await start_apiserver()
    yield server
    await server.stop()


@pytest.fixture
async def core(apiserver: ApiServer, tmp_path: Path) -> AsyncIterator[client.CoreV1Api]:
    path = write_kubeconfig(apiserver.url, str(tmp_path / "kubeconfig"))
    cfg = client.Configuration()
    await config.load_kube_config(config_file=path, client_configuration=cfg)
    async with client.ApiClient(cfg) as api:
        yield client.CoreV1Api(api)


def _start(nats_url: str, kubeconfig: str, data_dir: Path, log: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [
            sys.executable, "-m", "services.cli", "reconciler", "--nats", nats_url, "--kubeconfig", kubeconfig,
            "--data-dir", str(data_dir), "--id", "rec-1", "--partitions", str(PARTITIONS),
            "--http-port", "0", "--snapshot-interval", "0.2", "--lease-ttl", "3",
        ],
        stderr=log.open("ab"),
        cwd=Path(__file__).resolve().parents[2],
    )


async def test_sigkill_mid_stream_then_restart_loses_and_duplicates_nothing(
    nats_server: NatsServer, apiserver: ApiServer, core: client.CoreV1Api, tmp_path: Path
) -> None:
    subjects = Subjects(partitions=PARTITIONS)
    bus = await Bus.open(nats_server.url, name="test", subjects=subjects)
    await provision(bus.js, subjects, StreamsConfig(partitions=PARTITIONS))
    kubeconfig = write_kubeconfig(apiserver.url, str(tmp_path / "kc"))
    agents = [sim_agent(nats_server.url, h, tmp_path / "agents", PARTITIONS) for h in ("host-a", "host-b")]
    for agent in agents:
        await agent.__aenter__()
    log1, log2 = tmp_path / "rec1.log", tmp_path / "rec2.log"
    proc = _start(nats_server.url, kubeconfig, tmp_path / "data", log1)
    try:
        keys = []
        for i in range(PODS):
            pod = await core.create_namespaced_pod(
                "default",
                {"metadata": {"name": f"web.{i}", "labels": {"vmfence.io/managed": "true"}},
                 "spec": {"nodeName": "vmfence-host-a", "containers": [{"name": "c", "image": "x"}]}},
            )
            key = Key("pod", "default", f"web.{i}")
            keys.append(key)
            await observe(bus, key, pod.metadata.uid, int(pod.metadata.resource_version))
            if i == PODS // 2:
                # let some work land and at least one snapshot be taken, then kill mid-stream
                for _ in range(300):
                    if len(await log_entries(bus)) >= PODS:
                        break
                    await asyncio.sleep(0.05)
                await asyncio.sleep(0.5)  # two snapshot intervals
                proc.send_signal(signal.SIGKILL)
                proc.wait(10)
                killed_at = len(await log_entries(bus))
                proc = _start(nats_server.url, kubeconfig, tmp_path / "data", log2)

        async def all_bound() -> bool:
            entries = await log_entries(bus)
            bound = {e.key for _, e in entries for d in e.decisions if type(d).__name__ == "Bound"}
            return len(bound) == PODS

        for _ in range(600):
            if await all_bound():
                break
            await asyncio.sleep(0.05)
        assert await all_bound(), "not every pod got its VM after the restart"
        entries = await log_entries(bus)
        logs = per_key(entries)
        for key in keys:
            log = logs[str(key)]
            assert [e.n for e in log] == list(range(1, len(log) + 1))
            admitted = [d for e in log for d in e.decisions if isinstance(d, Admitted)]
            creates = [d for e in log for d in e.decisions if isinstance(d, Commanded) and d.command.op == "create"]
            assert len(admitted) == 1 and len(creates) == 1, f"duplicated decision for {key}"
        assert audit(entries, final=False).clean
        caught = [
            json.loads(line) for line in log2.read_text().splitlines()
            if line.startswith("{") and "partition taken" in line
        ]
        assert caught, "restarted reconciler took no partition"
        replayed = sum(int(c["msg"].split("caught up ")[1].split()[0]) for c in caught)
        assert replayed < killed_at, f"restart replayed {replayed} of {killed_at} entries: snapshot unused"
        print(f"killed at {killed_at} entries; restart replayed {replayed}; total {len(entries)}")
    finally:
        for agent in agents:
            await agent.__aexit__(None, None, None)
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
        await bus.close()
