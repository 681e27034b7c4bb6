"""`vmfence watcher` as a process: config validation (exit 2), /readyz, /metrics, SIGTERM."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import aiohttp
import pytest
from kubernetes_asyncio import client
from nats.js import JetStreamContext

from services.testbed.natsserver import free_port
from services.watcher.service import ConfigError, main, parse
from shared.subjects import Subjects

from .conftest import Tap, pod_body

ROOT = Path(__file__).resolve().parents[2]
READY_DEADLINE_S = 15.0
POLL_S = 0.05  # another process's readiness has no event to wait on: poll /readyz


@pytest.mark.parametrize(
    ("args", "env", "words"),
    [
        (["--partitions", "zero"], {}, "VMFENCE_PARTITIONS='zero' is not an integer"),
        (["--partitions", "0"], {}, "VMFENCE_PARTITIONS=0 is out of range"),
        ([], {"VMFENCE_HTTP_PORT": "70000"}, "VMFENCE_HTTP_PORT=70000 is out of range"),
        (["--kubeconfig", "/nonexistent/kc"], {}, "VMFENCE_KUBECONFIG='/nonexistent/kc' is not a readable file"),
        (["--prefix", "a.b"], {}, "VMFENCE_PREFIX='a.b'"),
        ([], {"VMFENCE_NATS_URL": "localhost"}, "VMFENCE_NATS_URL='localhost'"),
        (["--namespace", "Bad_NS"], {}, "VMFENCE_NAMESPACE='Bad_NS'"),
        (["--bogus"], {}, "unrecognized arguments"),
    ],
)
def test_bad_config_exits_2_with_one_line(
    args: list[str],
    env: dict[str, str],
    words: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and words in err and err.startswith("vmfence watcher: ")


def test_env_config(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    kc = tmp_path / "kc"
    kc.write_text("{}")
    monkeypatch.setenv("VMFENCE_NATS_URL", "nats://a:4222, nats://b:4222")
    monkeypatch.setenv("VMFENCE_KUBECONFIG", str(kc))
    monkeypatch.setenv("VMFENCE_PREFIX", "vmf")
    monkeypatch.setenv("VMFENCE_PARTITIONS", "8")
    monkeypatch.setenv("VMFENCE_HTTP_PORT", "0")
    monkeypatch.setenv("VMFENCE_NAMESPACE", "team-a")
    cfg = parse([])
    assert cfg.nats_url == ["nats://a:4222", "nats://b:4222"] and cfg.kubeconfig == str(kc)
    assert cfg.subjects == Subjects("vmf", 8) and cfg.http_port == 0 and cfg.namespace == "team-a"
    with pytest.raises(ConfigError):
        parse(["--log-format", "xml"])


async def _spawn(*args: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "services.watcher",
        *args,
        cwd=ROOT,
        env={**os.environ, "VMFENCE_LOG_FORMAT": "text"},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )


async def test_process_ready_metrics_and_sigterm(
    kubeconfig: str, nats_url: str, provisioned: JetStreamContext, subjects: Subjects, tap: Tap, core: client.CoreV1Api
) -> None:
    port = free_port()
    proc = await _spawn(
        "--nats",
        nats_url,
        "--kubeconfig",
        kubeconfig,
        "--partitions",
        str(subjects.partitions),
        "--http-port",
        str(port),
    )
    try:
        url = f"http://127.0.0.1:{port}"
        async with aiohttp.ClientSession() as http:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + READY_DEADLINE_S
            while True:
                assert proc.returncode is None, await proc.stderr.read() if proc.stderr else b""
                try:
                    async with http.get(f"{url}/readyz") as r:
                        if r.status == 200:
                            break
                except aiohttp.ClientError:
                    pass
                assert loop.time() < deadline, "watcher never became ready"
                await asyncio.sleep(POLL_S)
            async with http.get(f"{url}/livez") as r:
                assert r.status == 200
            resp = await core.create_namespaced_pod("default", pod_body("proc-pod"), _preload_content=False)
            uid = (await resp.json())["metadata"]["uid"]
            await tap.wait(lambda s: s.obs.uid == uid)
            want = 'vmfence_watch_events_total{kind="pod",type="ADDED"} 1.0'
            deadline = loop.time() + READY_DEADLINE_S
            while True:  # counted right after the publish is acknowledged: poll the other process
                async with http.get(f"{url}/metrics") as r:
                    text = await r.text()
                if want in text or loop.time() > deadline:
                    break
                await asyncio.sleep(POLL_S)
            assert want in text
            assert "vmfence_watch_restarts_total" in text
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 10.0) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_partition_mismatch_exits_2(
    kubeconfig: str, nats_url: str, provisioned: JetStreamContext, subjects: Subjects
) -> None:
    proc = await _spawn(
        "--nats", nats_url, "--kubeconfig", kubeconfig, "--partitions", str(subjects.partitions * 2), "--http-port", "0"
    )
    _out, err = await asyncio.wait_for(proc.communicate(), 20.0)
    assert proc.returncode == 2
    assert b"provisioned with 4 partitions" in err
