"""`vmfence bench all --control-plane kube`'s figures, at a tiny size: the pods and latency figures on
the real control plane beside the bare real API server, with CPU per pod for every process of the
stack and of the control plane (about 30 s: two control planes and the process layout start)."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.testbed.bench.kube import CONTROL_PLANE, run_kube_fleet
from services.testbed.kubecp import KubeControlPlane, ServiceCredentials

TINY = {"create_concurrency": 8, "raw_n": 200}
VMFENCE = ("nats", "watcher", "agent", "reconciler")


@pytest.mark.timeout(240)
async def test_pods_and_latency_figures_beside_a_bare_real_api_server(
        tmp_path: Path, control_plane: tuple[KubeControlPlane, ServiceCredentials]) -> None:
    out = await run_kube_fleet(TINY, [12], [10], 1.0, str(tmp_path))
    (pods,), (lat,), (bare,) = out["pods"], out["latency"], out["bare_api"]
    assert pods["pods"] == 12 and pods["to_running_s"] > 0 and pods["delete_to_zero_s"] > 0
    assert lat["offered_per_s"] == 10 and lat["bound_seen"] == lat["pods"] == 10
    assert 0 < lat["to_bound_p50_s"] <= lat["to_running_p99_s"]
    for cpu in (pods["cpu_ms_per_pod"], lat["cpu_ms_per_pod"]):
        assert all(cpu[c] > 0 for c in (*VMFENCE, "kube-apiserver", "etcd")), cpu
        assert set(CONTROL_PLANE) <= set(cpu), cpu
    assert bare["pods"] == 12 and bare["creates_per_s"] > 0 and bare["apiserver_cpu_ms_per_create"] > 0
    assert "kube-apiserver" in out["layout"] and out["control_plane_start_s"] > 0
