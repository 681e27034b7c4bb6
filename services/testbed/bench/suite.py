"""`vmfence bench all`: every headline figure beside a baseline measured in the same run.

Each figure is a dict with its value(s), the baseline it is judged against, the target from the
issue, and the command that reproduces it. Everything runs on this machine: an embedded nats-server,
the development API server, the watcher and two sim agents in this process, reconcilers as child
processes (``LocalStack``), pods created and watched with kubernetes-asyncio. Sizes: ``smoke``
(seconds, for CI) and ``full`` (the issue's sizes).

Figures:
  decisions   full-stack decisions/s (pod create -> Running) vs raw async JetStream publish
  latency     pod created -> Bound appended -> status Running, p50/p99 at fixed offered loads, and
              CPU per pod by component (one process per component: ``bench/fleet.py``)
  pods        N pods to Running, then deleted to zero VMs, at each size, CPU per pod by component
              and its growth with the fleet (``scale_ratio``), vs the same creates/deletes on a bare
              API server process and its CPU per create (one process per component)
  replay      `vmfence replay --file` and from JetStream vs raw msgspec decoding of the same file
  memory      reconciler RSS per idle key above an empty reconciler (keys filled in waves), and after a burst
  catchup     reconciler restart to ready with and without its snapshot vs a raw log read
"""

# The benchmark reads /proc and small files from the event loop; the figures it measures are
# seconds long, these reads microseconds.
# ruff: noqa: ASYNC240

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from services.testbed.output import emit
from shared.tasks import run_main

ROOT = Path(__file__).resolve().parents[3]  # the repository (this file is services/testbed/<pkg>/)
NS = "default"
VM_ANNOTATION = "vmfence.io/vm-id"
VMFENCE = [sys.executable, "-m", "services.cli"]

SIZES: dict[str, dict[str, Any]] = {
    "smoke": {
        "loads": [50], "load_seconds": 2.0, "pods": 60, "fleet_pods": [40, 120], "mem_keys": 2000,
        "wakeup_round_trips": 2000,
        "catchup_decisions": 5000, "raw_n": 5000, "create_concurrency": 32,
        "handover_pods": 40, "handovers": ("stop",),  # a kill waits out a lease TTL: full size only
    },
    "full": {
        "loads": [50, 100, 150, 200, 1000], "load_seconds": 5.0, "load_seconds_by_rate": {200: 60.0},
        "pods": 10000, "fleet_pods": [1000, 10000],
        "mem_keys": 100000, "handover_pods": 1000, "handovers": ("stop", "kill"),
        "catchup_decisions": 100000, "raw_n": 20000, "create_concurrency": 64,
    },
}
ALL_FIGURES = ("decisions", "latency", "pods", "replay", "memory", "catchup")
DECISIONS_PER_KEY = 10  # observed -> bound -> status written, with NullGateway and answering agents


def bench_all(args: argparse.Namespace) -> int:

    only = tuple(x.strip() for x in args.only.split(",") if x.strip())
    bad = [x for x in only if x not in ALL_FIGURES]
    if bad:
        print(f"vmfence bench all: unknown figure(s) {bad}; one of {ALL_FIGURES}", file=sys.stderr)
        return 2
    result = run_main(run_all(args.size, only, pods=args.pods, sim_persist=args.sim_persist))
    emit(result, args.json)
    return 0


# ------------------------------------------------------------------------------- helpers


def pct(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100), None for no samples."""
    if not values:
        return None
    s = sorted(values)
    k = max(0, min(len(s) - 1, int(-(-q * len(s) // 100)) - 1))
    return s[k]


def r4(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def machine() -> dict[str, Any]:
    """What the numbers depend on: cores, load when the run started, versions."""
    try:
        with open("/proc/cpuinfo") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "?")
    except OSError:
        model = "?"
    import nats

    return {
        "cpus": os.cpu_count(),
        "cpu_model": model,
        "loadavg_start": [round(x, 2) for x in os.getloadavg()],
        "python": sys.version.split()[0],
        "nats_py": getattr(nats, "__version__", "?"),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
    }


def _pod(name: str) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "labels": {"vmfence.io/managed": "true"}},
        "spec": {
            "containers": [{"name": "main", "image": "vmfence/firmware"}],
            "tolerations": [{"key": "vmfence.io/vm", "operator": "Exists", "effect": "NoSchedule"}],
        },
    }


async def _bounded(n: int, concurrency: int, fn: Callable[[int], Awaitable[None]]) -> None:
    """fn(0..n-1) with at most `concurrency` in flight (a client's connection pool)."""
    it = iter(range(n))

    async def worker() -> None:
        for i in it:
            await fn(i)

    async with asyncio.TaskGroup() as tg:
        for _ in range(min(concurrency, n)):
            tg.create_task(worker())


# ------------------------------------------------------------------------------- pod tracking


@dataclass
class PodTracker:
    """Watches the pods of one namespace (kubernetes-asyncio, raw dicts: no model deserialisation
    on the benchmark's shared event loop) and records, per pod name, when it was first seen Running
    with a VM annotation and when it was deleted. Relists on a lost or expired watch."""

    core: Any
    ns: str = NS
    running_at: dict[str, float] = field(default_factory=dict)
    present: set[str] = field(default_factory=set)
    deleted_at: dict[str, float] = field(default_factory=dict)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    relists: int = 0
    synced: asyncio.Event = field(default_factory=asyncio.Event)

    def _see(self, kind: str, obj: dict[str, Any], now: float) -> None:
        meta = obj.get("metadata") or {}
        name = meta.get("name")
        if not name:
            return
        if kind == "DELETED":
            self.present.discard(name)
            self.deleted_at.setdefault(name, now)
        else:
            self.present.add(name)
            status = obj.get("status") or {}
            if status.get("phase") == "Running" and VM_ANNOTATION in (meta.get("annotations") or {}):
                self.running_at.setdefault(name, now)
        self.changed.set()

    async def run(self) -> None:
        from kubernetes_asyncio import watch

        class RawWatch(watch.Watch):  # type: ignore[misc]
            def get_return_type(self, func: object) -> None:  # raw dicts, no models
                return None

        while True:
            try:
                resp = await self.core.list_namespaced_pod(self.ns, _preload_content=False)
                data = json.loads(await resp.read())
                now = time.time()
                names = set()
                for obj in data.get("items", []):
                    names.add(obj["metadata"]["name"])
                    self._see("ADDED", obj, now)
                for gone in self.present - names:
                    self._see("DELETED", {"metadata": {"name": gone}}, now)
                self.synced.set()
                rv = data["metadata"]["resourceVersion"]
                w = RawWatch()
                async for ev in w.stream(
                    self.core.list_namespaced_pod, self.ns, resource_version=rv,
                    allow_watch_bookmarks=True, timeout_seconds=3600,
                ):  # fmt: skip
                    if ev["type"] in ("ADDED", "MODIFIED", "DELETED"):
                        self._see(ev["type"], ev["object"], time.time())
            except asyncio.CancelledError:
                raise
            except Exception:  # 410 Gone, a dropped stream: list again
                self.relists += 1
                await asyncio.sleep(0.05)

    async def wait(self, pred: Callable[[], bool], timeout: float, what: str) -> float:  # noqa: ASYNC109
        """time.time() when pred() first held (checked on every pod event)."""
        deadline = time.monotonic() + timeout
        while not pred():
            self.changed.clear()
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.changed.wait(), min(left, 1.0))
        return time.time()


# ------------------------------------------------------------------------------- log reading


async def log_last_seq(js: Any, subjects: Any) -> int:
    info = await js.stream_info(subjects.stream_log)
    return int(info.state.last_seq)


async def bound_times(js: Any, subjects: Any, start_seq: int, end_seq: int) -> dict[str, float]:
    """Key -> JetStream timestamp of the entry holding its first Bound, from an ordered consumer."""
    from shared.bus.logstream import follow_log
    from shared.fence.schema import Bound

    out: dict[str, float] = {}
    if end_seq < start_seq:
        return out
    async with contextlib.aclosing(follow_log(js, subjects, start_seq=start_seq)) as records:
        async for rec in records:
            if any(isinstance(d, Bound) for d in rec.entry.decisions):
                out.setdefault(rec.entry.key, rec.ts)
            if rec.seq >= end_seq:
                break
    return out


async def count_decisions(js: Any, subjects: Any, start_seq: int) -> tuple[int, int]:
    """(entries, decisions) in the log from start_seq to its end now."""
    from shared.bus.logstream import read_log

    entries = decisions = 0
    async for rec in read_log(js, subjects, start_seq=start_seq):
        entries += 1
        decisions += len(rec.entry.decisions)
    return entries, decisions


# ------------------------------------------------------------------------------- the stack figures


class StackBench:
    """One LocalStack (sim runtime) for the decisions, latency, pods and replay figures."""

    def __init__(self, size: dict[str, Any], pods: int, tmp: str, *, sim_persist: bool = False) -> None:
        self.size = size
        self.sim_persist = sim_persist
        self._trim_task: asyncio.Task[None] | None = None
        self.n = pods
        self.tmp = tmp
        self.stack: Any = None
        self.core: Any = None
        self.tracker: PodTracker | None = None
        self._tracker_task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> StackBench:
        from kubernetes_asyncio import client

        from services.testbed.stack import LocalStack

        self.stack = LocalStack(root=Path(self.tmp) / "stack", runtime="sim", partitions=8, reconcilers=2,
                                host_cpus=100000, host_memory_mib=10**8)
        await self.stack.start()
        if not self.sim_persist:
            # The sim driver appends every op (a probe per VM per second included) to a history
            # list and rewrites all of it to sim-host.json after each op: O(ops so far) per op,
            # which dominates the whole stack past a few thousand VMs (see docs/benchmarks.md).
            # Measure vmfence, not that bookkeeping: no file, and the in-memory history bounded.
            for agent in self.stack.agents.values():
                agent.driver.state_dir = None
            self._trim_task = asyncio.create_task(self._trim_history(), name="sim-history-trim")
        self.core = client.CoreV1Api(self.stack.api)
        self.tracker = PodTracker(self.core)
        self._tracker_task = asyncio.create_task(self.tracker.run(), name="pod-tracker")
        await asyncio.wait_for(self.tracker.synced.wait(), 30)
        return self

    async def _trim_history(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            for agent in self.stack.agents.values():
                history = agent.driver.history
                if len(history) > 20000:
                    del history[:-1000]

    async def __aexit__(self, *exc: object) -> None:
        if self._trim_task is not None:
            self._trim_task.cancel()
        if self._tracker_task is not None:
            self._tracker_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._tracker_task
        if self.stack is not None:
            await self.stack.stop()

    def vms(self) -> int:
        return sum(len(a.driver.all_vms()) for a in self.stack.agents.values())

    async def create(self, name: str) -> float:
        resp = await self.core.create_namespaced_pod(NS, _pod(name), _preload_content=False)
        await resp.read()
        if resp.status >= 300:
            raise RuntimeError(f"create {name}: HTTP {resp.status}")
        return time.time()

    async def delete(self, name: str) -> None:
        resp = await self.core.delete_namespaced_pod(name, NS, _preload_content=False)
        await resp.read()

    async def delete_all_and_wait(self, names: list[str], timeout: float) -> tuple[float, float, float]:  # noqa: ASYNC109
        """Graceful deletes (the reconciler removes the VM, then deletes with grace 0); returns
        (seconds issuing deletes, seconds to zero VMs, seconds to zero pods) from the first delete."""
        assert self.tracker is not None
        t0 = time.time()
        await _bounded(len(names), self.size["create_concurrency"], lambda i: self.delete(names[i]))
        issued = time.time() - t0
        deadline = time.monotonic() + timeout
        vms_zero = None
        while True:
            if vms_zero is None and self.vms() == 0:
                vms_zero = time.time() - t0
            if vms_zero is not None and not (self.tracker.present & set(names)):
                return issued, vms_zero, time.time() - t0
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.vms()} VMs / {len(self.tracker.present)} pods left after delete")
            await asyncio.sleep(0.02)

    # -------------------------------------------------------------------- raw publish
    async def raw_publish(self) -> tuple[float, float]:
        from services.testbed.bench.command import raw_publish_rates

        return await raw_publish_rates(self.stack.bus, self.size["raw_n"])

    # -------------------------------------------------------------------- N pods
    async def pods_run(self) -> dict[str, Any]:
        """N pods created as fast as the client can, to all Running (also the decisions/s run)."""
        assert self.tracker is not None
        js, subjects = self.stack.bus.js, self.stack.subjects
        names = [f"pod-{i}" for i in range(self.n)]
        start_seq = await log_last_seq(js, subjects) + 1
        t0 = time.time()
        await _bounded(self.n, self.size["create_concurrency"], lambda i: self._create_only(names[i]))
        created_s = time.time() - t0
        t_run = await self.tracker.wait(lambda: all(nm in self.tracker.running_at for nm in names),  # type: ignore[union-attr]
                                        120 + self.n / 10, f"{self.n} pods Running")
        running_s = t_run - t0
        entries, decisions = await count_decisions(js, subjects, start_seq)
        issued, vms_zero, pods_zero = await self.delete_all_and_wait(names, 120 + self.n / 10)
        return {
            "pods": self.n,
            "create_issue_s": round(created_s, 3),
            "to_running_s": round(running_s, 3),
            "entries": entries,
            "decisions": decisions,
            "decisions_per_s": round(decisions / running_s, 1),
            "delete_issue_s": round(issued, 3),
            "delete_to_zero_vms_s": round(vms_zero, 3),
            "delete_to_zero_pods_s": round(pods_zero, 3),
        }

    async def _create_only(self, name: str) -> None:
        await self.create(name)


# ------------------------------------------------------------------------------- replay


def _run_cli(args: list[str], env: dict[str, str] | None = None, timeout: float = 900) -> tuple[float, str]:
    """Run `vmfence ...` as a child; (wall seconds, stdout). Raises on a non-zero exit."""
    t0 = time.perf_counter()
    p = subprocess.run([*VMFENCE, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                       env={**os.environ, **(env or {})}, check=False)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise RuntimeError(f"vmfence {' '.join(args)} exited {p.returncode}: {p.stderr.strip()[-500:]}")
    return wall, p.stdout


async def replay_figure(stack: Any, tmp: str) -> dict[str, Any]:
    """Export then replay (file and JetStream) as the CLI does — as the read-only audit user —
    beside decoding the same file."""
    from shared.bus.logstream import iter_export
    from shared.bus.read import read_stream

    url, password = stack.identity("audit")
    env = {"VMFENCE_PARTITIONS": str(stack.partitions), "VMFENCE_NATS_USER": "audit",
           "VMFENCE_NATS_PASSWORD": password}
    path = os.path.join(tmp, "log.export")
    export_wall, _ = await asyncio.to_thread(_run_cli, ["export", "--nats", url, "-o", path], env)
    file_wall, out = await asyncio.to_thread(_run_cli, ["replay", "--nats", url, "--file", path, "--json"], env)
    from_file = json.loads(out)
    js_wall, out = await asyncio.to_thread(_run_cli, ["replay", "--nats", url, "--json"], env)
    from_js = json.loads(out)
    data = Path(path).read_bytes()
    entries = from_file["entries"]
    if not entries:
        raise RuntimeError("replay: the log is empty (run it with the pods or latency figures)")
    # raw decoding of the same file: typed (the records replay needs) and untyped msgpack
    typed = []
    for _ in range(3):
        t0 = time.perf_counter()
        n = sum(1 for _ in iter_export(data))
        typed.append(time.perf_counter() - t0)
    dec = msgspec.msgpack.Decoder()
    untyped = []
    for _ in range(3):
        t0 = time.perf_counter()
        pos, m = 14, 0
        while pos < len(data):
            k = int.from_bytes(data[pos : pos + 4], "big")
            dec.decode(data[pos + 4 : pos + 4 + k])
            pos += 4 + k
            m += 1
        untyped.append(time.perf_counter() - t0)
    assert n == entries == m, (n, entries, m)
    # raw JetStream read of the same log (no decoding)
    bus = await stack.open_bus("audit", "bench-replay")
    try:
        t0 = time.perf_counter()
        k = 0
        async for _ in read_stream(bus.js, bus.subjects.stream_log, bus.subjects.log_all):
            k += 1
        raw_read_s = time.perf_counter() - t0
    finally:
        await bus.close()
    typed_rate = entries / statistics.median(typed)
    file_rate = entries / from_file["seconds"]
    js_rate = entries / from_js["seconds"]
    return {
        "entries": entries,
        "decisions": from_file["decisions"],
        "file_bytes": len(data),
        "export_wall_s": round(export_wall, 3),
        "replay_file_s": from_file["seconds"],
        "replay_file_wall_s": round(file_wall, 3),
        "replay_file_entries_per_s": round(file_rate, 1),
        "replay_js_s": from_js["seconds"],
        "replay_js_wall_s": round(js_wall, 3),
        "replay_js_entries_per_s": round(js_rate, 1),
        "raw_typed_decode_entries_per_s": round(typed_rate, 1),
        "raw_untyped_decode_entries_per_s": round(entries / statistics.median(untyped), 1),
        "raw_js_read_entries_per_s": round(k / raw_read_s, 1),
        "file_ratio_to_raw_decode": round(file_rate / typed_rate, 3),
        "js_ratio_to_raw_decode": round(js_rate / typed_rate, 3),
        "audit_clean": bool(from_file["clean"] and from_js["clean"]),
    }


# ------------------------------------------------------------------------------- all


async def run_all(
    size: str, only: tuple[str, ...] = ALL_FIGURES, *, pods: int | None = None, sim_persist: bool = False
) -> dict[str, Any]:
    """Run the chosen figures; each carries its baseline, target, verdict and command."""
    sz = SIZES[size]
    n = pods or sz["pods"]
    cmd = f"vmfence bench all --size {size} --json"
    out: dict[str, Any] = {"bench": "all", "size": size, "machine": machine(), "figures": {}}
    figs: dict[str, Any] = out["figures"]
    tmp = tempfile.mkdtemp(prefix="vmfence-benchall-")
    try:
        if {"latency", "pods"} & set(only):
            from services.testbed.bench.fleet import run_fleet

            t_fig = time.perf_counter()
            sizes = [pods] if pods else sz["fleet_pods"]
            fleet = await run_fleet(sz, sizes if "pods" in only else [], sz["loads"] if "latency" in only else [],
                                    sz["load_seconds"], os.path.join(tmp, "fleet"),
                                    handover_pods=sz["handover_pods"] if "pods" in only else 0,
                                    handovers=sz["handovers"])
            out["fleet"] = {"layout": fleet["layout"], "raw_publish_per_s": fleet["raw_publish_per_s"],
                            "raw_publish_cpu_us_per_msg": fleet["raw_publish_cpu_us_per_msg"],
                            "wakeup_baseline": fleet.get("wakeup_baseline"),
                            "seconds": round(time.perf_counter() - t_fig, 1)}
            if "latency" in only:
                at200 = next((x for x in fleet["latency"] if x["offered_per_s"] == 200), None)
                figs["latency"] = {
                    "loads": fleet["latency"],
                    "target": "pod-to-bound p99 < 0.1 s at 200 pods/s",
                    "met": None if at200 is None else (at200["to_bound_p99_s"] or 1e9) < 0.1,
                    "command": f"{cmd} --only latency",
                }
            if "pods" in only:
                runs = fleet["pods"]
                largest = runs[-1]
                figs["pods"] = {
                    "sizes": runs,
                    "baseline_bare_api": fleet["bare_api"],
                    "handover": fleet.get("handover"),
                    "scale_ratio": fleet.get("scale_ratio"),
                    "targets": {
                        "to_running_s": "10 000 pods Running in < 60 s, deleted to zero in < 60 s",
                        "cpu_ms_per_pod": "<= 10 ms summed over every process of the stack",
                        "scale_ratio": "CPU per pod at the largest size <= 1.2 x at the smallest",
                    },
                    "met": {
                        "to_running_s": (largest["to_running_s"] < 60 and largest["delete_to_zero_s"] < 60)
                        if largest["pods"] >= 10000 else None,
                        "cpu_ms_per_pod": largest["cpu_ms_per_pod"]["total"] <= 10,
                        "scale_ratio": None if fleet.get("scale_ratio") is None else fleet["scale_ratio"] <= 1.2,
                    },
                    "command": f"{cmd} --only pods",
                }
        if {"decisions", "replay"} & set(only):
            t_fig = time.perf_counter()
            out["sim_persist"] = sim_persist
            async with StackBench(sz, n, tmp, sim_persist=sim_persist) as sb:
                sync_rate, async_rate = await sb.raw_publish()
                wants_run = True
                run = await sb.pods_run() if wants_run else None
                if run is not None and "decisions" in only:
                    figs["decisions"] = {
                        "decisions_per_s": run["decisions_per_s"],
                        "decisions": run["decisions"],
                        "pods": run["pods"],
                        "seconds": run["to_running_s"],
                        "baseline_raw_async_publish_per_s": round(async_rate, 1),
                        "baseline_raw_sync_publish_per_s": round(sync_rate, 1),
                        "ratio_to_raw_async_publish": round(run["decisions_per_s"] / async_rate, 3),
                        "target": ">= 0.5 x raw async publish",
                        "met": run["decisions_per_s"] / async_rate >= 0.5,
                        "command": f"{cmd} --only decisions",
                    }
                if "replay" in only:
                    rep = await replay_figure(sb.stack, tmp)
                    figs["replay"] = {
                        **rep,
                        "target": "replay >= 0.5 x raw decode",
                        "met": rep["file_ratio_to_raw_decode"] >= 0.5,
                        "command": f"{cmd} --only replay  (or: vmfence export -o F && vmfence replay --file F --json)",
                    }
                out["tracker_relists"] = sb.tracker.relists if sb.tracker else 0
            out["stack_seconds"] = round(time.perf_counter() - t_fig, 1)
        if "memory" in only:
            from services.testbed.bench.state import catchup_figure, memory_figure

            mem = await memory_figure(sz["mem_keys"], os.path.join(tmp, "mem"))
            figs["memory"] = {
                **mem,
                "target": "<= 1024 bytes per idle key",
                "met": mem["bytes_per_idle_key"] <= 1024,
                "command": f"{cmd} --only memory",
            }
        if "catchup" in only:
            cu = await catchup_figure(sz["catchup_decisions"], os.path.join(tmp, "catchup"))
            figs["catchup"] = {
                **cu,
                "target": "< 5 s to ready",
                "met": cu["ready_without_snapshot_s"] < 5 and cu["ready_with_snapshot_s"] < 5,
                "command": f"{cmd} --only catchup",
            }
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    out["machine"]["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    return out
