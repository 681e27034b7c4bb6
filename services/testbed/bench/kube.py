"""`vmfence bench all --control-plane kube --only pods,latency`: the pods and latency figures of
``bench/fleet.py`` against the real control plane (etcd, kube-apiserver, kube-scheduler,
kube-controller-manager from ``make kube``), with the watcher and the reconcilers under the Helm
chart's service accounts, pods bound by the real scheduler.

The same-run baseline is the same client creating and deleting the same pods on a *bare* real API
server (etcd and kube-apiserver only, no vmfence, no scheduler or controllers) started for it: its
create/delete rates and its CPU per create (kube-apiserver and etcd), the floor under the stack's
API-server share. CPU per pod is read per process as in fleet.py, the control plane's four
processes included.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from services.testbed.bench.fleet import HOSTS, FleetBench, cpu_seconds
from services.testbed.bench.suite import NS, SIZES, _bounded, _pod, machine
from services.testbed.kubecp import KubeControlPlane, ServiceCredentials, start_control_plane
from services.testbed.output import emit
from shared.tasks import run_main

FIGURES = ("pods", "latency")
NODES_READY_S = 60.0
CONTROL_PLANE = ("etcd", "kube-apiserver", "kube-scheduler", "kube-controller-manager")


class KubeFleetBench(FleetBench):
    """FleetBench on the real control plane: its processes are measured beside vmfence's."""

    kube: KubeControlPlane | None = None
    creds: ServiceCredentials | None = None

    async def __aenter__(self) -> KubeFleetBench:
        try:
            await super().__aenter__()
            await self._nodes_schedulable()
        except BaseException:
            await self.__aexit__(None, None, None)
            raise
        return self

    async def _nodes_schedulable(self) -> None:
        """Every host's Node Ready and without the node lifecycle controller's not-ready taint, so
        the first figure does not time the scheduler's back-off on a node still coming up."""
        from kubernetes_asyncio import client

        core = client.CoreV1Api(self.api)
        deadline = time.monotonic() + NODES_READY_S
        while True:
            nodes = {n.metadata.name: n for n in (await core.list_node()).items}
            ok = 0
            for host in HOSTS:
                node = nodes.get(f"vmfence-{host}")
                if node is None or node.status is None:
                    continue
                ready = {c.type: c.status for c in node.status.conditions or []}.get("Ready") == "True"
                tainted = any(t.key.startswith("node.kubernetes.io/") for t in node.spec.taints or [])
                ok += ready and not tainted
            if ok == len(HOSTS):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"vmfence nodes not schedulable within {NODES_READY_S:.0f}s")
            await asyncio.sleep(0.2)

    async def _start_api(self, logs: Path) -> None:
        self.kube, self.creds = await start_control_plane(self.dir / "kube")
        self.kubeconfig = str(self.kube.admin_kubeconfig)  # the harness's; never a service's

    def kubeconfig_of(self, component: str) -> str:
        assert self.creds is not None
        return str(self.creds.kubeconfigs[component])

    def pids(self) -> dict[str, int]:
        out = super().pids()
        if self.kube is not None:
            out.update(self.kube.pids())
        return out

    async def _stop_api(self) -> None:
        if self.kube is not None:
            await self.kube.stop()


async def bare_kube_baseline(n: int, concurrency: int, tmp: str) -> dict[str, Any]:
    """The same client creating then deleting (grace 0) n pods on a bare real API server (etcd and
    kube-apiserver only): rates and CPU per create of kube-apiserver and of etcd."""
    from kubernetes_asyncio import client

    async with KubeControlPlane(Path(tmp) / "bare-kube", controllers=False) as cp:
        api = await cp.admin_client()
        try:
            core = client.CoreV1Api(api)

            async def create(i: int) -> None:
                resp = await core.create_namespaced_pod(NS, _pod(f"base-{i}"), _preload_content=False)
                await resp.read()
                if resp.status >= 300:
                    raise RuntimeError(f"bare create base-{i}: HTTP {resp.status}")

            async def delete(i: int) -> None:
                resp = await core.delete_namespaced_pod(f"base-{i}", NS, grace_period_seconds=0,
                                                        _preload_content=False)
                await resp.read()

            pids = cp.pids()

            def cpu() -> dict[str, float]:
                return {k: cpu_seconds(pids[k]) for k in ("kube-apiserver", "etcd")}

            c0, t0 = cpu(), time.perf_counter()
            await _bounded(n, concurrency, create)
            create_s, c1 = time.perf_counter() - t0, cpu()
            t0 = time.perf_counter()
            await _bounded(n, concurrency, delete)
            delete_s, c2 = time.perf_counter() - t0, cpu()
        finally:
            await api.close()
    return {
        "pods": n,
        "creates_per_s": round(n / create_s, 1),
        "deletes_per_s": round(n / delete_s, 1),
        "apiserver_cpu_ms_per_create": round(1000 * (c1["kube-apiserver"] - c0["kube-apiserver"]) / n, 3),
        "apiserver_cpu_ms_per_delete": round(1000 * (c2["kube-apiserver"] - c1["kube-apiserver"]) / n, 3),
        "etcd_cpu_ms_per_create": round(1000 * (c1["etcd"] - c0["etcd"]) / n, 3),
        "etcd_cpu_ms_per_delete": round(1000 * (c2["etcd"] - c1["etcd"]) / n, 3),
    }


async def run_kube_fleet(size: dict[str, Any], sizes: list[int], loads: list[int], seconds: float,
                         tmp: str) -> dict[str, Any]:
    """fleet.run_fleet's figures on the real control plane, the bare real API server as baseline."""
    from services.testbed.bench.command import raw_publish_rates

    out: dict[str, Any] = {"layout": "one process per component: " + ", ".join(
        ["nats-server", *CONTROL_PLANE, "watcher", *(f"agent-{h} (sim)" for h in HOSTS),
         "reconciler-1", "reconciler-2"])}
    out["bare_api"] = [await bare_kube_baseline(n, size["create_concurrency"], tmp)
                       for n in sorted(set(sizes or [100]))]
    async with KubeFleetBench(size, tmp) as fleet:
        assert fleet.kube is not None
        out["control_plane_start_s"] = round(fleet.kube.timings.get("total_s", 0.0), 2)
        sync_rate, async_rate = await raw_publish_rates(fleet.bus, size["raw_n"])
        out["raw_publish_per_s"] = {"sync": round(sync_rate, 1), "async": round(async_rate, 1)}
        out["pods"] = [await fleet.pods(n) for n in sizes]
        out["latency"] = [await fleet.latency(rate, seconds) for rate in loads]
    if len(out["pods"]) >= 2:
        small, large = out["pods"][0], out["pods"][-1]
        out["scale_ratio"] = round(large["cpu_ms_per_pod"]["total"] / max(1e-9, small["cpu_ms_per_pod"]["total"]), 3)
    return out


async def run_kube(size: str, only: tuple[str, ...], pods: int | None = None) -> dict[str, Any]:
    sz = SIZES[size]
    cmd = f"vmfence bench all --control-plane kube --size {size} --json"
    out: dict[str, Any] = {"bench": "all", "control_plane": "kube", "size": size, "machine": machine(),
                           "figures": {}}
    figs: dict[str, Any] = out["figures"]
    tmp = tempfile.mkdtemp(prefix="vmfence-benchkube-")
    try:
        t0 = time.perf_counter()
        sizes = [pods] if pods else list(sz["fleet_pods"])
        fleet = await run_kube_fleet(sz, sizes if "pods" in only else [],
                                     list(sz["loads"]) if "latency" in only else [], sz["load_seconds"],
                                     os.path.join(tmp, "fleet"))
        out["fleet"] = {"layout": fleet["layout"], "raw_publish_per_s": fleet["raw_publish_per_s"],
                        "control_plane_start_s": fleet["control_plane_start_s"],
                        "seconds": round(time.perf_counter() - t0, 1)}
        if "latency" in only:
            figs["latency"] = {"loads": fleet["latency"], "baseline_bare_api": fleet["bare_api"],
                               "command": f"{cmd} --only latency"}
        if "pods" in only:
            figs["pods"] = {"sizes": fleet["pods"], "baseline_bare_api": fleet["bare_api"],
                            "scale_ratio": fleet.get("scale_ratio"), "command": f"{cmd} --only pods"}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def bench_all_kube(args: argparse.Namespace) -> int:
    only = tuple(x.strip() for x in args.only.split(",") if x.strip())
    bad = [x for x in only if x not in FIGURES]
    if bad:
        print(f"vmfence bench all --control-plane kube: only {','.join(FIGURES)} are measured on the real "
              f"control plane (not {','.join(bad)})", file=sys.stderr)
        return 2
    from services.testbed.kubecp import KubeUnavailable, binaries

    try:
        binaries()
    except KubeUnavailable as exc:
        print(f"vmfence bench all: {exc}", file=sys.stderr)
        return 1
    emit(run_main(run_kube(args.size, only, args.pods)), args.json)
    return 0
