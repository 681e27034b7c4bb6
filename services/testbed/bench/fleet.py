"""The stack as compose runs it, one OS process per component, for the throughput figures.

nats-server, the development API server, the watcher, each sim agent and each reconciler are
separate processes; the benchmark's own process only creates pods, watches them and reads the
log. CPU is read from ``/proc/<pid>/stat`` (utime + stime) of every component before and after a
phase, so each figure says what each component spent per pod — and what the harness spent, apart.

The same-run baselines: the same client creating and deleting the same pods on a bare development
API server process (its CPU per create is the floor under the API server's share), and the raw
JetStream publish rate of the benchmark's own connection.
"""

# /proc reads are microseconds; the figures are seconds long.

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.testbed.bench.suite import (
    NS,
    PodTracker,
    _bounded,
    _pod,
    bound_times,
    count_decisions,
    log_last_seq,
    pct,
    r4,
)
from services.testbed.chaos.proc import Proc, cli

HOSTS = ("host-a", "host-b")
PARTITIONS = 8
CLK_TCK = os.sysconf("SC_CLK_TCK")
READY_S = 60.0


def cpu_seconds(pid: int) -> float:
    """utime + stime of one process (all its threads), in seconds; 0 once it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return 0.0
    fields = raw[raw.rindex(b")") + 2 :].split()  # after "pid (comm) "
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def write_calls(pid: int) -> int:
    """Write system calls one process has made (``syscw`` of /proc/<pid>/io: write and writev, which
    is how libuv and asyncio send on a socket); 0 once it is gone. Each one on a loopback socket is
    a send the peer must also read: the figure that coalescing messages lowers."""
    try:
        with open(f"/proc/{pid}/io", "rb") as f:
            for line in f:
                if line.startswith(b"syscw:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


@dataclass
class CpuMeter:
    """CPU seconds (and write system calls) per component between ``start()`` and ``stop()``."""

    pids: Callable[[], dict[str, int]]
    _t0: dict[str, float] = field(default_factory=dict)
    _w0: dict[str, int] = field(default_factory=dict)
    spent: dict[str, float] = field(default_factory=dict)
    writes: dict[str, int] = field(default_factory=dict)

    def start(self) -> None:
        pids = self.pids()
        self._t0 = {name: cpu_seconds(pid) for name, pid in pids.items()}
        self._w0 = {name: write_calls(pid) for name, pid in pids.items()}

    def stop(self) -> dict[str, float]:
        pids = self.pids()
        self.spent = {name: cpu_seconds(pid) - self._t0.get(name, 0.0) for name, pid in pids.items()}
        self.writes = {name: write_calls(pid) - self._w0.get(name, 0) for name, pid in pids.items()}
        return self.spent

    @staticmethod
    def per_unit_ms(spent: dict[str, float], units: int) -> dict[str, float]:
        """Milliseconds of CPU per unit, by component (components of one kind summed) and total."""
        return {k: round(1000 * v, 3) for k, v in CpuMeter.per_unit(spent, units).items()}

    @staticmethod
    def per_unit(spent: Mapping[str, float], units: int) -> dict[str, float]:
        """A per-process tally per unit, by component (components of one kind summed) and total;
        the harness's share beside the total, not in it."""
        by_kind: dict[str, float] = {}
        for name, s in spent.items():
            kind = "agent" if name.startswith("agent-") else "reconciler" if name.startswith("reconciler-") else name
            if kind == "harness":
                continue
            by_kind[kind] = by_kind.get(kind, 0.0) + s
        out = {k: round(v / max(1, units), 6) for k, v in sorted(by_kind.items())}
        out["total"] = round(sum(by_kind.values()) / max(1, units), 6)
        if "harness" in spent:
            out["harness_not_in_total"] = round(spent["harness"] / max(1, units), 6)
        return out


class FleetBench:
    """Processes: nats-server (one node), apiserver, watcher, two sim agents, two reconcilers."""

    def __init__(self, size: dict[str, Any], tmp: str, profile_dir: str | None = None) -> None:
        self.size = size
        self.profile_dir = profile_dir  # py-spy (collapsed stacks) of every Python component per pods run
        self.dir = Path(tmp) / "fleet"
        self.procs: dict[str, Proc] = {}
        self.nats: Any = None
        self.bus: Any = None
        self.api: Any = None
        self.core: Any = None
        self.tracker: PodTracker | None = None
        self._tracker_task: asyncio.Task[None] | None = None
        self.kubeconfig = ""
        self.balanced_s: float | None = None

    def pids(self) -> dict[str, int]:
        out = {name: p.popen.pid for name, p in self.procs.items() if p.popen is not None}
        if self.nats is not None and self.nats.pid is not None:
            out["nats"] = self.nats.pid
        out["harness"] = os.getpid()
        return out

    async def __aenter__(self) -> FleetBench:
        try:
            return await self._start()
        except BaseException:
            await self.__aexit__()  # a half-started fleet stops what it started
            raise

    async def _start(self) -> FleetBench:
        from kubernetes_asyncio import client, config

        from services.testbed.natsserver import agent_user, free_port, local_accounts, start_nats
        from services.testbed.stack import HARNESS_USER, private_dir
        from shared.bus.connect import Bus
        from shared.bus.provision import StreamsConfig, provision
        from shared.kubeclient import api_client
        from shared.subjects import Subjects

        private_dir(self.dir)
        logs = private_dir(self.dir / "logs")
        accounts, users = local_accounts(HOSTS)
        self.nats = await start_nats(store_dir=str(private_dir(self.dir / "nats")), config_text=accounts)
        url = self.nats.url
        self.subjects = Subjects(partitions=PARTITIONS)
        self.bus = await Bus.open([url], name="vmfence-bench", subjects=self.subjects, auth=users.auth(HARNESS_USER))
        prov = await Bus.open([url], name="vmfence-bench-provision", subjects=self.subjects,
                              auth=users.auth("reconciler"))
        try:
            await provision(prov.js, self.subjects, StreamsConfig(partitions=PARTITIONS))
        finally:
            await prov.close()
        await self._start_api(logs)
        for host in HOSTS:
            port = free_port()
            self.procs[f"agent-{host}"] = Proc(
                f"agent-{host}", "agent",
                cli("agent", "--nats-url", url, "--host", host, "--runtime", "sim",
                     "--data-dir", str(self.dir / "agents" / host), "--http-host", "127.0.0.1",
                     "--http-port", str(port), "--partitions", str(PARTITIONS), "--cpus", "100000",
                     "--memory-mib", str(10**8), "--vnc-range", "none", "--network", "user"),
                port, logs / f"agent-{host}.log", env=users.env(agent_user(host)),
            )  # fmt: skip
        port = free_port()
        self.procs["watcher"] = Proc(
            "watcher", "watcher",
            cli("watcher", "--nats-url", url, "--kubeconfig", self.kubeconfig_of("watcher"),
                 "--partitions", str(PARTITIONS),
                 "--namespace", NS, "--http-host", "127.0.0.1", "--http-port", str(port)),
            port, logs / "watcher.log", env=users.env("watcher"),
        )  # fmt: skip
        for i in (1, 2):
            port = free_port()
            name = f"reconciler-{i}"
            self.procs[name] = Proc(
                name, "reconciler",
                cli("reconciler", "--nats-url", url, "--kubeconfig", self.kubeconfig_of("reconciler"), "--id", name,
                     "--partitions", str(PARTITIONS), "--data-dir", str(self.dir / "reconcilers"),
                     "--http-host", "127.0.0.1", "--http-port", str(port)),
                port, logs / f"{name}.log", env=users.env("reconciler"),
            )  # fmt: skip
        for p in self.procs.values():
            if not p.running:
                p.start()
        for p in self.procs.values():
            if not await p.start_ready(READY_S):
                raise RuntimeError(f"{p.name} not ready within {READY_S:.0f}s:\n{p.tail()}")
        cfg = client.Configuration()
        await config.load_kube_config(config_file=self.kubeconfig, client_configuration=cfg)
        self.api = api_client(cfg)
        self.core = client.CoreV1Api(self.api)
        self.tracker = PodTracker(self.core)
        self._tracker_task = asyncio.create_task(self.tracker.run(), name="pod-tracker")
        await asyncio.wait_for(self.tracker.synced.wait(), 30)
        self.balanced_s = await self.until_balanced(READY_S)
        return self

    async def partitions_owned(self) -> dict[str, int]:
        """Partitions each reconciler says it holds (its ``vmfence_partitions_owned``)."""
        out = {}
        for name, proc in self.procs.items():
            if not name.startswith("reconciler-"):
                continue
            with contextlib.suppress(OSError, TimeoutError):
                out[name] = int(await _gauge(proc.port, "vmfence_partitions_owned"))
        return out

    async def until_balanced(self, timeout: float) -> float | None:  # noqa: ASYNC109 - bounded poll
        """Seconds until every reconciler holds its fair share of the partitions (None: not within
        ``timeout``). Both start together, and whether the second took its half before or during
        the first burst decided whether 1 000 pods took 5 s or 13 s (before a joining reconciler
        ran short lease rounds): the figures measure the steady state, and a hand-over in a burst
        is a cost of its own."""
        t0 = time.monotonic()
        share = PARTITIONS // 2
        while time.monotonic() - t0 < timeout:
            owned = await self.partitions_owned()
            if len(owned) == 2 and all(n == share for n in owned.values()):
                return round(time.monotonic() - t0, 2)
            await asyncio.sleep(0.2)  # the leases' own rounds are seconds apart: a bounded poll
        return None

    async def _start_api(self, logs: Path) -> None:
        """The API server the stack runs against: the development server as a process of its own
        (bench/kube.py's subclass starts the real control plane instead)."""
        from services.testbed.natsserver import free_port

        self.kubeconfig = str(self.dir / "kubeconfig")
        port = free_port()
        self.procs["apiserver"] = Proc(
            "apiserver", "apiserver",
            cli("apiserver", "--port", str(port), "--kubeconfig-out", self.kubeconfig), port, logs / "apiserver.log",
        )  # fmt: skip
        self.procs["apiserver"].start()
        if not await self.procs["apiserver"].wait_ready(READY_S):
            raise RuntimeError(f"apiserver not ready:\n{self.procs['apiserver'].tail()}")

    def kubeconfig_of(self, component: str) -> str:
        """The kubeconfig a service runs with (the harness's own on the development server)."""
        return self.kubeconfig

    async def _stop_api(self) -> None:
        """Nothing beyond the processes: the development server is one of them."""

    async def __aexit__(self, *exc: object) -> None:
        from shared.tasks import finish_shielded

        # to its end even when interrupted again meanwhile (SIGTERM twice, or the re-cancels of
        # shared.tasks.interruptible): half a stop leaves nats-server or the API server behind
        await finish_shielded(self._stop_all())

    async def _stop_all(self) -> None:
        if self._tracker_task is not None:
            self._tracker_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._tracker_task
        for obj in (self.api, self.bus):
            if obj is not None:
                with contextlib.suppress(Exception):
                    await obj.close()
        order = ["reconciler-1", "reconciler-2", "watcher", *(f"agent-{h}" for h in HOSTS), "apiserver"]
        for group in (order[:3], order[3:5], order[5:]):
            await asyncio.gather(*(self.procs[n].stop() for n in group if n in self.procs))
        await self._stop_api()
        if self.nats is not None:
            await self.nats.stop()

    # ------------------------------------------------------------------------------ actions
    async def create(self, name: str) -> float:
        resp = await self.core.create_namespaced_pod(NS, _pod(name), _preload_content=False)
        await resp.read()
        if resp.status >= 300:
            raise RuntimeError(f"create {name}: HTTP {resp.status}")
        return time.time()

    async def _create_only(self, name: str) -> None:
        await self.create(name)

    async def delete(self, name: str) -> None:
        resp = await self.core.delete_namespaced_pod(name, NS, _preload_content=False)
        await resp.read()

    async def vms(self) -> int:
        """VMs the agents' ledgers hold (their /metrics ``vmfence_vms`` gauges, summed)."""
        return int(sum([await _gauge(self.procs[f"agent-{h}"].port, "vmfence_vms") for h in HOSTS]))

    async def delete_all_and_wait(self, names: list[str], timeout: float) -> tuple[float, float]:  # noqa: ASYNC109
        """Graceful deletes (the reconciler removes the VM, then the pod); (issue s, to zero pods and VMs s)."""
        assert self.tracker is not None
        t0 = time.time()
        await _bounded(len(names), self.size["create_concurrency"], lambda i: self.delete(names[i]))
        issued = time.time() - t0
        wanted = set(names)
        await self.tracker.wait(lambda: not (self.tracker.present & wanted), timeout,  # type: ignore[union-attr]
                                f"{len(names)} pods deleted")
        deadline = time.monotonic() + timeout
        while await self.vms() > 0:  # the agents' gauges follow their heartbeat: bounded polling
            if time.monotonic() > deadline:
                raise TimeoutError(f"{await self.vms()} VMs left after delete")
            await asyncio.sleep(0.1)
        return issued, time.time() - t0

    def _profile(self, tag: str) -> list[Any]:
        import subprocess

        if not self.profile_dir:
            return []
        os.makedirs(self.profile_dir, exist_ok=True)
        spies = []
        py_spy = os.path.join(os.path.dirname(sys.executable), "py-spy")  # installed beside the interpreter
        for name, pid in self.pids().items():
            if name in ("nats", "harness"):
                continue
            out = os.path.join(self.profile_dir, f"{tag}-{name}.txt")
            spies.append(subprocess.Popen(
                [py_spy, "record", "--pid", str(pid), "--format", "raw", "--rate", "200", "--nonblocking", "--gil",
                 "--output", out], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            ))  # fmt: skip
        return spies

    @staticmethod
    async def _stop_profile(spies: list[Any]) -> None:
        import signal

        for spy in spies:
            spy.send_signal(signal.SIGINT)
        for spy in spies:
            await asyncio.to_thread(spy.wait, 30)

    async def api_requests(self) -> dict[str, int] | None:
        """Requests the development API server has handled, by "<verb> <resource>" (its
        ``/_dev/faults`` tally); None on the real control plane."""
        proc = self.procs.get("apiserver")
        if proc is None:
            return None
        try:
            body = json.loads(await _http_get(proc.port, "/_dev/faults"))
        except (OSError, TimeoutError, ValueError):
            return None
        got = body.get("requests") if isinstance(body, dict) else None
        return {str(k): int(v) for k, v in got.items()} if isinstance(got, dict) else None

    async def gc_seconds(self) -> dict[str, float]:
        """Seconds each Python component has spent in its garbage collector so far (its
        ``vmfence_gc_pause_seconds_total``; a component that serves no such metric is left out)."""
        out = {}
        for name, proc in self.procs.items():
            with contextlib.suppress(OSError, TimeoutError, ValueError, IndexError):
                if got := _samples(await _http_get(proc.port, "/metrics"), "vmfence_gc_pause_seconds_total"):
                    out[name] = sum(got)
        return out

    async def nats_msgs(self) -> int:
        """Messages nats-server has received plus sent (``/varz`` in_msgs + out_msgs), every client's."""
        assert self.nats is not None
        v = await self.nats.varz()
        return int(v.get("in_msgs", 0)) + int(v.get("out_msgs", 0))

    async def nats_msgs_by_client(self) -> dict[str, int]:
        """Messages each named client has sent plus received (``/connz`` in_msgs + out_msgs, summed
        over connections of one name; the server's own JetStream traffic is not a connection)."""
        assert self.nats is not None
        c = await self.nats.varz("/connz?limit=1024")
        out: dict[str, int] = {}
        for conn in c.get("connections") or []:
            name = str(conn.get("name") or "?")
            out[name] = out.get(name, 0) + int(conn.get("in_msgs", 0)) + int(conn.get("out_msgs", 0))
        return out

    # ------------------------------------------------------------------------------ figures
    async def pods(self, n: int, tag: str = "pod") -> dict[str, Any]:
        """n pods created as fast as the client can, to all Running, then deleted to zero VMs;
        CPU per pod by component over the whole create+delete cycle. ``tag`` names them: the
        tracker remembers names, so a second run of the same size needs another."""
        assert self.tracker is not None
        js, subjects = self.bus.js, self.subjects
        names = [f"{tag}{n}-{i}" for i in range(n)]
        start_seq = await log_last_seq(js, subjects) + 1
        spies = self._profile(f"pods{n}")
        req0 = await self.api_requests()
        meter = CpuMeter(self.pids)
        gc0 = await self.gc_seconds()
        msgs0, by0 = await self.nats_msgs(), await self.nats_msgs_by_client()
        meter.start()
        t0 = time.time()
        await _bounded(n, self.size["create_concurrency"], lambda i: self._create_only(names[i]))
        created_s = time.time() - t0
        t_run = await self.tracker.wait(lambda: all(nm in self.tracker.running_at for nm in names),  # type: ignore[union-attr]
                                        120 + n / 10, f"{n} pods Running")
        up = meter.stop()
        up_writes = meter.writes
        msgs1, by1 = await self.nats_msgs(), await self.nats_msgs_by_client()
        entries, decisions = await count_decisions(js, subjects, start_seq)
        msgs2, by2 = await self.nats_msgs(), await self.nats_msgs_by_client()
        meter.start()
        issued, to_zero = await self.delete_all_and_wait(names, 120 + n / 10)
        down = meter.stop()
        writes = {k: up_writes.get(k, 0) + meter.writes.get(k, 0) for k in up_writes.keys() | meter.writes.keys()}
        msgs3, by3 = await self.nats_msgs(), await self.nats_msgs_by_client()
        req1 = await self.api_requests()
        gc1 = await self.gc_seconds()
        await self._stop_profile(spies)
        both = {k: up.get(k, 0.0) + down.get(k, 0.0) for k in up.keys() | down.keys()}
        extra: dict[str, Any] = {}
        if req0 is not None and req1 is not None:  # the development server's tally, harness included
            extra["api_requests_per_pod"] = {
                k: round((v - req0.get(k, 0)) / n, 2) for k, v in sorted(req1.items()) if v != req0.get(k, 0)
            }
        return {
            "pods": n,
            "create_issue_s": round(created_s, 3),
            "to_running_s": round(t_run - t0, 3),
            "pods_per_s": round(n / (t_run - t0), 1),
            "delete_issue_s": round(issued, 3),
            "delete_to_zero_s": round(to_zero, 3),
            "entries_per_pod": round(entries / n, 2),
            "decisions_per_pod": round(decisions / n, 2),
            "cpu_ms_per_pod": CpuMeter.per_unit_ms(both, n),
            "cpu_ms_per_pod_up": CpuMeter.per_unit_ms(up, n),
            "nats_msgs_per_pod": round((msgs1 - msgs0 + msgs3 - msgs2) / n, 2),
            # the same by client name (as each one counts them: a message it sent or was sent)
            "nats_msgs_per_pod_by_client": {
                k: round((by1.get(k, 0) - by0.get(k, 0) + by3.get(k, 0) - by2.get(k, 0)) / n, 2)
                for k in sorted(by1.keys() | by3.keys())
                if by1.get(k, 0) - by0.get(k, 0) + by3.get(k, 0) - by2.get(k, 0) > 0
            },
            "write_syscalls_per_pod": {k: round(v, 2) for k, v in CpuMeter.per_unit(writes, n).items()},
            # the part of cpu_ms_per_pod spent in each component's cyclic garbage collector
            "gc_ms_per_pod": CpuMeter.per_unit_ms({k: v - gc0.get(k, 0.0) for k, v in gc1.items()}, n),
            **extra,
        }

    async def handover(self, n: int, how: str) -> dict[str, Any]:
        """n pods created as fast as the client can, and once half of them are, ``reconciler-2``
        goes: ``stop`` (SIGTERM: it hands its partitions back) or ``kill`` (SIGKILL: they wait out
        their leases). Seconds to all Running, and until ``reconciler-1`` held every partition; then
        the pods are deleted, and ``reconciler-2`` is started again and given its share back."""
        assert self.tracker is not None and how in ("stop", "kill")
        victim, survivor = self.procs["reconciler-2"], self.procs["reconciler-1"]
        names = [f"ho-{how}{n}-{i}" for i in range(n)]
        half, made = asyncio.Event(), [0]

        async def create(i: int) -> None:
            await self._create_only(names[i])
            made[0] += 1
            if made[0] >= n // 2:
                half.set()

        t0 = time.time()
        read_before = await _gauge(survivor.port, "vmfence_partition_load_entries_total")
        async with asyncio.TaskGroup() as tg:
            tg.create_task(_bounded(n, self.size["create_concurrency"], create))
            await half.wait()
            t_gone = time.time()
            if how == "kill":
                victim.kill()
            else:
                await victim.stop()
            gone_s = time.time() - t_gone
            taken_s, read = None, None
            while taken_s is None and time.time() - t_gone < READY_S:
                owned = await self.partitions_owned()
                if owned.get(survivor.name) == PARTITIONS:
                    taken_s = round(time.time() - t_gone, 2)
                    read = await _gauge(survivor.port, "vmfence_partition_load_entries_total") - read_before
                else:
                    await asyncio.sleep(0.1)  # the leases' own rounds: a bounded poll
        t_run = await self.tracker.wait(lambda: all(nm in self.tracker.running_at for nm in names),  # type: ignore[union-attr]
                                        120 + n / 10, f"{n} pods Running across a hand-over ({how})")
        await self.delete_all_and_wait(names, 120 + n / 10)
        if not await victim.start_ready(READY_S):
            raise RuntimeError(f"{victim.name} did not come back:\n{victim.tail()}")
        balanced = await self.until_balanced(READY_S)
        return {
            "how": how,
            "pods": n,
            "to_running_s": round(t_run - t0, 3),
            "reconciler_gone_after_s": round(gone_s, 2),  # SIGTERM: its own shutdown, hand-back included
            "partitions_taken_over_s": taken_s,  # from the signal until the survivor held all of them
            "log_entries_read_taking_over": read,  # folded at those loads: past the image or snapshot
            "rebalanced_s": balanced,
        }

    async def offer(self, names: list[str], rate: int) -> tuple[dict[str, float], float]:
        """Create ``names`` at ``rate`` per second on a fixed schedule (a slow system shows as
        latency, not as fewer pods), then wait until every one runs. Returns when each create was
        answered (wall clock, as the log's stored times) and how long the creating took."""
        assert self.tracker is not None
        created: dict[str, float] = {}

        async def one(name: str) -> None:
            created[name] = await self.create(name)

        t_start = time.monotonic()
        async with asyncio.TaskGroup() as tg:
            for i, name in enumerate(names):
                delay = t_start + i / rate - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                tg.create_task(one(name))
            offered_s = time.monotonic() - t_start
        n = len(names)
        await self.tracker.wait(lambda: all(nm in self.tracker.running_at for nm in names),  # type: ignore[union-attr]
                                120 + n / 20, f"{n} pods Running at {rate}/s")
        return created, offered_s

    async def latency(self, rate: int, seconds: float) -> dict[str, Any]:
        """Offered load ``rate`` pods/s for ``seconds``, creates on a fixed schedule: a slow system
        shows as latency, not as fewer pods."""
        assert self.tracker is not None
        js, subjects = self.bus.js, self.subjects
        n = max(1, int(rate * seconds))
        names = [f"lat{rate}-{i}" for i in range(n)]
        start_seq = await log_last_seq(js, subjects) + 1
        meter = CpuMeter(self.pids)
        meter.start()
        created, offered_s = await self.offer(names, rate)
        spent = meter.stop()
        end_seq = await log_last_seq(js, subjects)
        bound = await bound_times(js, subjects, start_seq, end_seq)
        to_bound, bound_to_status, total = [], [], []
        for name in names:
            t1, t2 = bound.get(f"{NS}/{name}"), self.tracker.running_at[name]
            total.append(t2 - created[name])
            if t1 is not None:
                to_bound.append(t1 - created[name])
                bound_to_status.append(t2 - t1)
        await self.delete_all_and_wait(names, 120 + n / 20)
        return {
            "offered_per_s": rate,
            "offered_for_s": seconds,
            "pods": n,
            "achieved_create_per_s": round(n / offered_s, 1) if offered_s > 0 else None,
            "to_bound_p50_s": r4(pct(to_bound, 50)),
            "to_bound_p99_s": r4(pct(to_bound, 99)),
            "bound_to_status_p50_s": r4(pct(bound_to_status, 50)),
            "bound_to_status_p99_s": r4(pct(bound_to_status, 99)),
            "to_running_p50_s": r4(pct(total, 50)),
            "to_running_p99_s": r4(pct(total, 99)),
            "bound_seen": len(to_bound),
            "cpu_ms_per_pod": CpuMeter.per_unit_ms(spent, n),
        }


async def _gauge(port: int, name: str) -> float:
    """A labelled gauge on a service's /metrics, its samples summed."""
    return sum(_samples(await _http_get(port, "/metrics"), name))


def _samples(metrics: str, name: str) -> list[float]:
    """The values of a labelled metric's samples in a /metrics text (none: not served)."""
    return [float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines() if line.startswith(name + "{")]


async def _http_get(port: int, path: str) -> str:
    reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 5)
    try:
        writer.write(f"GET {path} HTTP/1.0\r\nHost: localhost\r\n\r\n".encode())
        await writer.drain()
        raw = await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()
    return raw.partition(b"\r\n\r\n")[2].decode(errors="replace")


async def bare_api_baseline(n: int, concurrency: int, tmp: str) -> dict[str, Any]:
    """The same client creating then deleting (grace 0) n pods on a bare development API server
    process: its create rate and its CPU per create, the floor under the stack's API-server share."""
    from kubernetes_asyncio import client, config

    from services.testbed.natsserver import free_port
    from shared.kubeclient import api_client

    d = Path(tmp) / "bare-api"
    d.mkdir(parents=True, exist_ok=True)
    kubeconfig = str(d / "kubeconfig")
    port = free_port()
    proc = Proc("apiserver", "apiserver", cli("apiserver", "--port", str(port), "--kubeconfig-out", kubeconfig),
                port, d / "apiserver.log")
    proc.start()
    try:
        if not await proc.wait_ready(READY_S):
            raise RuntimeError(f"bare apiserver not ready:\n{proc.tail()}")
        cfg = client.Configuration()
        await config.load_kube_config(config_file=kubeconfig, client_configuration=cfg)
        async with api_client(cfg) as api:
            core = client.CoreV1Api(api)

            async def create(i: int) -> None:
                resp = await core.create_namespaced_pod(NS, _pod(f"base-{i}"), _preload_content=False)
                await resp.read()

            async def delete(i: int) -> None:
                resp = await core.delete_namespaced_pod(f"base-{i}", NS, grace_period_seconds=0,
                                                        _preload_content=False)
                await resp.read()

            assert proc.popen is not None
            pid = proc.popen.pid
            c0, t0, own0 = cpu_seconds(pid), time.perf_counter(), time.process_time()
            await _bounded(n, concurrency, create)
            create_s, c1 = time.perf_counter() - t0, cpu_seconds(pid)
            t0 = time.perf_counter()
            await _bounded(n, concurrency, delete)
            delete_s, c2, own2 = time.perf_counter() - t0, cpu_seconds(pid), time.process_time()
    finally:
        await proc.stop()
    return {
        "pods": n,
        "creates_per_s": round(n / create_s, 1),
        "deletes_per_s": round(n / delete_s, 1),
        "apiserver_cpu_ms_per_create": round(1000 * (c1 - c0) / n, 3),
        "apiserver_cpu_ms_per_delete": round(1000 * (c2 - c1) / n, 3),
        # the same two requests' cost to the client (kubernetes-asyncio + aiohttp): the floor under
        # each request a vmfence service makes
        "client_cpu_ms_per_request": round(1000 * (own2 - own0) / (2 * n), 3),
        "apiserver_cpu_ms_per_request": round(1000 * (c2 - c0) / (2 * n), 3),
    }


def library_floor(pods: dict[str, Any], bare: dict[str, Any], per_msg_us: dict[str, float]) -> dict[str, float]:
    """What the libraries alone charge for the requests and messages one pod took, in ms: every
    Kubernetes request at the bare server's and client's cost per request (the harness's own create
    and delete at the server's only: its CPU is not in the stack's total), every nats message at the
    raw publish's cost per message (client and server). A lower bound: watch streams, decoding and
    vmfence's own work are not in it."""
    requests = sum((pods.get("api_requests_per_pod") or {}).values())
    harness = 2.0  # the bench's create and delete of each pod
    kube = requests * bare["apiserver_cpu_ms_per_request"] + max(0.0, requests - harness) * bare[
        "client_cpu_ms_per_request"]
    nats = pods["nats_msgs_per_pod"] * (per_msg_us["client"] + per_msg_us["nats"]) / 1000
    return {"kube": round(kube, 2), "nats": round(nats, 2), "total": round(kube + nats, 2)}


async def run_fleet(size: dict[str, Any], sizes: list[int], loads: list[int], seconds: float, tmp: str,
                    say: Callable[[str], None] = lambda s: None, profile_dir: str | None = None,
                    handover_pods: int = 0, handovers: tuple[str, ...] = ("stop", "kill")) -> dict[str, Any]:
    """The throughput figures (issue 14): pods at each size, latency at each load, baselines; with
    ``handover_pods``, that many pods across a reconciler's stop and/or kill (``handovers``), beside
    the same burst with both reconcilers up."""
    from services.testbed.bench.command import raw_publish_rates

    out: dict[str, Any] = {"layout": "one process per component: " + ", ".join(
        ["nats-server", "apiserver", "watcher", *(f"agent-{h} (sim)" for h in HOSTS), "reconciler-1", "reconciler-2"]
    )}
    from services.testbed.bench import wakeup

    say("baseline: bare API server")
    out["bare_api"] = [await bare_api_baseline(n, size["create_concurrency"], tmp) for n in sorted(set(sizes))]
    if loads:
        # the floor under a message when nothing batches, which is what a low latency asks for
        say("baseline: a wake-up of another process")
        out["wakeup_baseline"] = await wakeup.measure(size.get("wakeup_round_trips", wakeup.ROUND_TRIPS))
    async with FleetBench(size, tmp, profile_dir) as fleet:
        out["partitions_balanced_s"] = fleet.balanced_s
        say("baseline: raw publish")
        meter = CpuMeter(lambda: {k: v for k, v in fleet.pids().items() if k in ("harness", "nats")})
        msgs0 = await fleet.nats_msgs()
        meter.start()
        sync_rate, async_rate = await raw_publish_rates(fleet.bus, size["raw_n"])
        spent = meter.stop()
        msgs = max(1, await fleet.nats_msgs() - msgs0)
        out["raw_publish_per_s"] = {"sync": round(sync_rate, 1), "async": round(async_rate, 1)}
        per_msg = {"client": round(1e6 * spent["harness"] / msgs, 2), "nats": round(1e6 * spent["nats"] / msgs, 2)}
        out["raw_publish_cpu_us_per_msg"] = per_msg
        out["pods"] = []
        for n in sizes:
            say(f"pods: {n}")
            got = await fleet.pods(n)
            bare = next(b for b in out["bare_api"] if b["pods"] == n)
            got["library_floor_ms_per_pod"] = library_floor(got, bare, per_msg)
            floor = got["library_floor_ms_per_pod"]["total"]
            got["over_floor"] = round(got["cpu_ms_per_pod"]["total"] / max(1e-9, floor), 2)
            out["pods"].append(got)
        if handover_pods:
            say(f"hand-overs: {handover_pods} pods")
            steady = await fleet.pods(handover_pods, tag="steady")
            out["handover"] = {"pods": handover_pods, "steady_to_running_s": steady["to_running_s"],
                               "runs": [await fleet.handover(handover_pods, how) for how in handovers]}
        out["latency"] = []
        for rate in loads:
            # the figure is 200 pods/s held for 60 s: a load can run longer than the rest
            held = float(size.get("load_seconds_by_rate", {}).get(rate, seconds))
            say(f"latency at {rate}/s for {held:.0f} s")
            out["latency"].append(await fleet.latency(rate, held))
    if len(out["pods"]) >= 2:
        small, large = out["pods"][0], out["pods"][-1]
        out["scale_ratio"] = round(large["cpu_ms_per_pod"]["total"] / max(1e-9, small["cpu_ms_per_pod"]["total"]), 3)
    return out


def main() -> None:  # pragma: no cover - manual: python -m services.testbed.bench.fleet 1000 [rate] [hand-overs] [s]
    import sys

    from services.testbed.bench.suite import SIZES
    from shared.tasks import interruptible, run_main

    sizes = [int(x) for x in (sys.argv[1] if len(sys.argv) > 1 else "200").split(",")]
    loads = [int(x) for x in (sys.argv[2] if len(sys.argv) > 2 else "50").split(",")]
    tmp = os.environ.get("TMPDIR", "/tmp") + f"/vmfence-fleet-{os.getpid()}"
    handover = int(sys.argv[3]) if len(sys.argv) > 3 else 0
    held_s = float(sys.argv[4]) if len(sys.argv) > 4 else 5.0  # how long each load is offered (the issue: 60)
    # SIGTERM too ends the run through its cleanup: the fleet's processes start in sessions of their
    # own and would outlive a harness that just died (and weigh on the next run's figures)
    from services.testbed.bench.wakeup import ROUND_TRIPS

    size = {**SIZES["smoke"], "wakeup_round_trips": ROUND_TRIPS}
    fleet = run_fleet(size, sizes, loads, held_s, tmp, say=lambda s: print(s, file=sys.stderr),
                      profile_dir=os.environ.get("VMFENCE_BENCH_PROFILE"), handover_pods=handover)
    res = run_main(interruptible(fleet))
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
