"""The reconciler-state figures of `vmfence bench all`: memory per idle key (a reconciler child
process taking waves of keys to bound) and catch-up after a restart (time to ready over a log of N
decisions), each beside its same-run baseline."""

# a benchmark driver: blocking process starts and file opens are part of what it times
# ruff: noqa: ASYNC220, ASYNC230
from __future__ import annotations

import asyncio
import gc
import json
import os
import signal
import subprocess
import sys
import time
from typing import Any

import msgspec

from services.testbed.bench.suite import DECISIONS_PER_KEY, ROOT, VMFENCE, rss_bytes


def _deep_size(roots: list[Any]) -> tuple[int, dict[str, int]]:
    """Bytes reachable from roots through containers, msgspec structs, dataclasses and locks,
    each object counted once (shared objects are counted for the first root that reaches them)."""
    import dataclasses

    seen: set[int] = set()
    by_type: dict[str, int] = {}
    total = 0
    stack = list(roots)
    leaf = (str, bytes, int, float, bool, type(None))
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        size = sys.getsizeof(obj)
        total += size
        name = type(obj).__name__
        by_type[name] = by_type.get(name, 0) + size
        if isinstance(obj, leaf):
            continue
        if isinstance(obj, dict):
            stack.extend(obj.keys())
            stack.extend(obj.values())
        elif isinstance(obj, list | tuple | set | frozenset):
            stack.extend(obj)
        elif isinstance(obj, msgspec.Struct):
            stack.extend(getattr(obj, f) for f in obj.__struct_fields__)
        elif dataclasses.is_dataclass(obj) or isinstance(obj, asyncio.Lock):
            d = getattr(obj, "__dict__", None)
            if d is not None:
                stack.append(d)
            for name in getattr(type(obj), "__slots__", ()):
                if hasattr(obj, name):
                    stack.append(getattr(obj, name))
        elif hasattr(obj, "__dict__") and type(obj).__module__.startswith("collections"):
            stack.append(obj.__dict__)
    return total, by_type


def state_child_main(url: str, keys: int, data_dir: str, rec_id: str, partitions: int, wave: int = 0) -> None:
    """A reconciler in this (child) process with NullGateway objects for `keys` pods. Prints one
    JSON line per phase on stdout: `empty` (ready, no keys), then `loaded` (every key bound and idle),
    then stops (its snapshot is flushed on release) and exits."""
    import uvloop

    uvloop.run(_state_child(url, keys, data_dir, rec_id, partitions, wave))


async def _state_child(url: str, keys: int, data_dir: str, rec_id: str, partitions: int, wave: int = 0) -> None:
    from services.reconciler.config import ReconcilerConfig
    from services.reconciler.kube import NullGateway
    from services.reconciler.service import Reconciler
    from services.testbed.bench.command import (
        FAKE_HOSTS,
        HEARTBEAT_EVERY_S,
        fake_heartbeat,
        idle_bound_keys,
        publish_pod_observations,
        until_hosts_live,
        until_keys_idle,
    )
    from shared.bus.connect import Bus
    from shared.fence.keys import Key
    from shared.fence.schema import Spec, encode
    from shared.subjects import Subjects

    def say(**kw: Any) -> None:
        if os.environ.get("VMFENCE_BENCH_MEM_DIAG"):  # where the bytes are: objects by type, heap blocks
            counts: dict[str, int] = {}
            for obj in gc.get_objects():
                counts[type(obj).__name__] = counts.get(type(obj).__name__, 0) + 1
            kw["gc_objects"] = dict(sorted(counts.items(), key=lambda kv: -kv[1])[:25])
            kw["allocated_blocks"] = sys.getallocatedblocks()
            with open("/proc/self/status") as f:
                kw["proc"] = {ln.split(":")[0]: ln.split()[1] for ln in f if ln.startswith(("VmHWM", "VmRSS"))}
        sys.stdout.write(json.dumps(kw) + "\n")
        sys.stdout.flush()

    subjects = Subjects(partitions=partitions)
    bus = await Bus.open(url, name="bench-state", subjects=subjects)
    hosts_kv = await bus.js.key_value(subjects.kv_hosts)

    async def beat() -> None:
        while True:
            for host in FAKE_HOSTS:
                await hosts_kv.put(host, encode(fake_heartbeat(host)))
            await asyncio.sleep(HEARTBEAT_EVERY_S)

    pods = [Key("pod", "bench", f"pod-{i}") for i in range(keys)]
    gateway = NullGateway(keep_last=0)
    spec = Spec()
    for i, key in enumerate(pods):
        gateway.objects[str(key)] = (f"uid-{i:08d}", 1, spec)
    cfg = ReconcilerConfig(nats_url=[url], partitions=partitions, id=rec_id, data_dir=data_dir, kube="none",
                           http_port=0, snapshot_interval_s=2.0)
    rec = Reconciler(cfg, gateway=gateway, health=False)
    async with asyncio.TaskGroup() as tg:
        beat_task = tg.create_task(beat())
        rec_task = tg.create_task(rec.run())
        await asyncio.wait_for(rec.ready.wait(), 60)
        await until_hosts_live(rec)
        await asyncio.sleep(0.5)
        gc.collect()
        say(phase="empty", rss=rss_bytes(os.getpid()))
        t0 = time.perf_counter()
        step = wave or keys
        deadline = time.monotonic() + max(300.0, keys / 50)
        for lo in range(0, keys, step):
            hi = min(keys, lo + step)
            await publish_pod_observations(bus.js, subjects, pods, range(lo, hi), 60)
            await until_keys_idle(rec, hi, deadline)
        seconds = time.perf_counter() - t0
        await asyncio.sleep(1.0)
        if (bound := idle_bound_keys(rec, verify=True)) < keys:
            raise RuntimeError(f"only {bound}/{keys} idle keys are bound")
        gc.collect()
        slots = [slot for part in rec.partitions.values() for slot in part.keys.values()]
        sample = slots[: min(2000, len(slots))]
        deep, by_type = _deep_size(sample)
        unpacked, _ = _deep_size([slot.peek() for slot in sample])  # the same keys as live objects
        decisions = sum(p.stats["decisions"] for p in rec.partitions.values())
        say(phase="loaded", rss=rss_bytes(os.getpid()), keys=len(slots), seconds=seconds, decisions=decisions,
            deep_bytes_per_key=deep / max(1, len(sample)),
            deep_unpacked_bytes_per_key=unpacked / max(1, len(sample)),
            deep_by_type={k: round(v / max(1, len(sample)), 1) for k, v in
                          sorted(by_type.items(), key=lambda kv: -kv[1])[:12]})
        rec.stop()
        await rec_task
        beat_task.cancel()
    await bus.close()


async def _fill_log(
    keys: int, tmp: str, partitions: int, rec_id: str, wave: int = 0
) -> tuple[Any, list[dict[str, Any]]]:
    """A nats-server, fake agents and a state child that takes `keys` pods to bound; returns the
    running server and the child's phase lines. The caller stops the server."""
    from services.testbed.natsserver import start_nats
    from shared.bus.connect import Bus
    from shared.bus.provision import StreamsConfig, provision
    from shared.subjects import Subjects

    server = await start_nats(store_dir=os.path.join(tmp, "nats"))
    subjects = Subjects(partitions=partitions)
    bus = await Bus.open(server.url, name="bench-fill", subjects=subjects)
    await provision(bus.js, subjects, StreamsConfig(partitions=partitions))
    await bus.close()
    agents = await asyncio.create_subprocess_exec(
        sys.executable, "-c",
        f"from services.testbed.bench.command import fake_agents_main; fake_agents_main({server.url!r}, {partitions})",
        cwd=ROOT,
    )  # fmt: skip
    try:
        child = await asyncio.create_subprocess_exec(
            sys.executable, "-c",
            f"from services.testbed.bench.state import state_child_main; "
            f"state_child_main({server.url!r}, {keys}, {os.path.join(tmp, 'rec')!r}, {rec_id!r}, {partitions}, {wave})",
            stdout=subprocess.PIPE, cwd=ROOT,
        )  # fmt: skip
        assert child.stdout is not None
        raw = await asyncio.wait_for(child.stdout.read(), max(600, keys / 20))
        lines = [json.loads(ln) for ln in raw.splitlines()]
        rc = await child.wait()
        if rc != 0 or len(lines) < 2:
            raise RuntimeError(f"state child exited {rc} after {lines}")
    finally:
        agents.terminate()
        await agents.wait()
    return server, lines


MEM_WAVE = 5000  # keys brought to idle at a time for the per-idle-key figure


async def memory_figure(keys: int, tmp: str) -> dict[str, Any]:
    """RSS of a reconciler process holding `keys` idle keys above the same process empty, twice:
    keys filled in waves of MEM_WAVE (each wave idle before the next: what the keys cost), and all
    published at once (the burst's in-flight working set stays in the process's heap)."""
    server, lines = await _fill_log(keys, os.path.join(tmp, "waves"), 16, "bench-mem", wave=min(MEM_WAVE, keys))
    await server.stop()
    server, burst_lines = await _fill_log(keys, os.path.join(tmp, "burst"), 16, "bench-mem")
    await server.stop()
    empty, loaded = lines[0], lines[1]
    b_empty, b_loaded = burst_lines[0], burst_lines[1]
    per_key = (loaded["rss"] - empty["rss"]) / keys
    return {
        "keys": keys,
        "fill_wave_keys": min(MEM_WAVE, keys),
        "rss_empty_mib": round(empty["rss"] / 2**20, 1),
        "rss_loaded_mib": round(loaded["rss"] / 2**20, 1),
        "bytes_per_idle_key": round(per_key),
        "python_deep_bytes_per_key": round(loaded["deep_bytes_per_key"]),
        "python_deep_bytes_per_key_unpacked": round(loaded["deep_unpacked_bytes_per_key"]),
        "python_bytes_per_key_by_type": loaded["deep_by_type"],
        "fill_seconds": round(loaded["seconds"], 2),
        "fill_decisions_per_s": round(loaded["decisions"] / loaded["seconds"], 1),
        "burst_rss_empty_mib": round(b_empty["rss"] / 2**20, 1),
        "burst_rss_loaded_mib": round(b_loaded["rss"] / 2**20, 1),
        "burst_bytes_per_key": round((b_loaded["rss"] - b_empty["rss"]) / keys),
        "burst_fill_seconds": round(b_loaded["seconds"], 2),
    }


async def _time_to_ready(url: str, data_dir: str, rec_id: str, partitions: int, log: str) -> float:
    """Seconds from fork of `vmfence reconciler` to /readyz 200; the process is then stopped."""
    from services.testbed.natsserver import free_port
    from services.testbed.stack import http_ok

    port = free_port()
    t0 = time.perf_counter()
    with open(log, "ab") as err:
        proc = subprocess.Popen(
            [*VMFENCE, "reconciler", "--nats", url, "--kube", "none", "--id", rec_id,
             "--partitions", str(partitions), "--data-dir", data_dir, "--http-host", "127.0.0.1",
             "--http-port", str(port), "--log-format", "text"],
            stdout=subprocess.DEVNULL, stderr=err, cwd=ROOT, start_new_session=True,
        )  # fmt: skip
    try:
        while not await http_ok(port, "/readyz"):
            if proc.poll() is not None:
                raise RuntimeError(f"reconciler exited {proc.returncode}; see {log}")
            if time.perf_counter() - t0 > 300:
                raise TimeoutError("reconciler not ready after 300 s")
            await asyncio.sleep(0.01)
        return time.perf_counter() - t0
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.to_thread(proc.wait, 30)
        except subprocess.TimeoutExpired:
            proc.kill()
            await asyncio.to_thread(proc.wait)


async def catchup_figure(decisions: int, tmp: str) -> dict[str, Any]:
    """Restart to ready with the snapshot present vs deleted, on a log of about `decisions`
    decisions; baselines: the interpreter importing the reconciler, and a raw read of the log."""
    from shared.bus.connect import Bus
    from shared.bus.read import read_stream
    from shared.subjects import Subjects

    partitions = 16
    keys = max(1, decisions // DECISIONS_PER_KEY)
    rec_id = "bench-catchup"
    server, lines = await _fill_log(keys, tmp, partitions, rec_id)
    try:
        data_dir = os.path.join(tmp, "rec")
        log = os.path.join(tmp, "catchup.log")
        snap = [p for p in os.listdir(data_dir) if p.startswith("snapshot-") and p.endswith(".sqlite")]
        with_snap = await _time_to_ready(server.url, data_dir, rec_id, partitions, log)
        for p in os.listdir(data_dir):
            if p.startswith("snapshot-"):
                os.unlink(os.path.join(data_dir, p))
        without_snap = await _time_to_ready(server.url, data_dir, rec_id, partitions, log)
        # the second start wrote a fresh snapshot on its stop: a third start is "with" again
        with_snap2 = await _time_to_ready(server.url, data_dir, rec_id, partitions, log)
        t0 = time.perf_counter()
        p = await asyncio.create_subprocess_exec(sys.executable, "-c", "import services.reconciler.service",
                                                 cwd=ROOT)
        await p.wait()
        import_s = time.perf_counter() - t0
        bus = await Bus.open(server.url, name="bench-catchup", subjects=Subjects(partitions=partitions))
        try:
            t0 = time.perf_counter()
            n = 0
            async for _ in read_stream(bus.js, bus.subjects.stream_log, bus.subjects.log_all):
                n += 1
            raw_read_s = time.perf_counter() - t0
        finally:
            await bus.close()
    finally:
        await server.stop()
    return {
        "decisions": lines[1]["decisions"],
        "keys": keys,
        "entries": n,
        "snapshot_files": snap,
        "ready_with_snapshot_s": round(min(with_snap, with_snap2), 3),
        "ready_with_snapshot_runs_s": [round(with_snap, 3), round(with_snap2, 3)],
        "ready_without_snapshot_s": round(without_snap, 3),
        "python_import_floor_s": round(import_s, 3),
        "raw_log_read_s": round(raw_read_s, 3),
    }
