"""SQLite persistence across restarts, and the ``vmfence apiserver`` entry point."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import aiohttp
import pytest

from services.apiserver.server import ApiServerConfig, main, start_apiserver

from .conftest import pod_body

REPO = Path(__file__).resolve().parents[2]


async def test_sqlite_survives_restart(tmp_path: Path) -> None:
    db = str(tmp_path / "api.db")
    first = await start_apiserver(ApiServerConfig(db_path=db))
    try:
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{first.url}/api/v1/namespaces/default/pods", json=pod_body("keep")) as r:
                pod = await r.json()
            async with http.post(
                f"{first.url}/apis/vmfence.io/v1alpha1/namespaces/default/virtualmachines",
                json={"metadata": {"name": "vm1"}, "spec": {"image": "d"}},
            ) as r:
                assert r.status == 201
            async with http.delete(f"{first.url}/api/v1/namespaces/default/pods/keep") as r:
                terminating = await r.json()  # graceful: still there, with deletionTimestamp
    finally:
        await first.stop()

    second = await start_apiserver(ApiServerConfig(db_path=db))
    try:
        async with aiohttp.ClientSession() as http:
            async with http.get(f"{second.url}/api/v1/namespaces/default/pods/keep") as r:
                again = await r.json()
            assert again["metadata"]["uid"] == pod["metadata"]["uid"]
            assert again["metadata"]["resourceVersion"] == terminating["metadata"]["resourceVersion"]
            assert again["metadata"]["deletionTimestamp"]
            async with http.get(
                f"{second.url}/apis/vmfence.io/v1alpha1/namespaces/default/virtualmachines"
            ) as r:
                assert [i["metadata"]["name"] for i in (await r.json())["items"]] == ["vm1"]
            async with http.patch(
                f"{second.url}/api/v1/namespaces/default/pods/keep",
                json={"metadata": {"labels": {"after": "restart"}}},
                headers={"Content-Type": "application/merge-patch+json"},
            ) as r:
                patched = await r.json()
            assert int(patched["metadata"]["resourceVersion"]) > int(
                terminating["metadata"]["resourceVersion"]
            )
            # the event history does not survive: an old watch position is expired
            url = f"{second.url}/api/v1/pods?watch=1&resourceVersion={pod['metadata']['resourceVersion']}"
            async with http.get(url) as r:
                event = json.loads(await r.content.readline())
            assert event["type"] == "ERROR" and event["object"]["code"] == 410
    finally:
        await second.stop()


def test_config_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--port", "http"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "port" in err
    assert main(["--no-such-flag"]) == 2
    assert main(["--db", "/nonexistent-dir/x.db"]) == 2


def test_cli_serves_and_stops_on_sigterm(tmp_path: Path) -> None:
    kubeconfig = tmp_path / "kc"
    env = {**os.environ, "VMFENCE_APISERVER_PORT": "0"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.apiserver", "--kubeconfig-out", str(kubeconfig)],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # printed once listening
        url = line.strip().rsplit(" ", 1)[-1]
        assert url.startswith("http://127.0.0.1:") and url in kubeconfig.read_text()
        with urllib.request.urlopen(f"{url}/readyz", timeout=5) as resp:
            assert resp.read() == b"ok"
        with urllib.request.urlopen(f"{url}/version", timeout=5) as resp:
            assert json.loads(resp.read())["minor"] == "35"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
