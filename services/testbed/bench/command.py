"""`vmfence bench …`: benchmarks that print JSON and compare against a baseline measured in the same
run, on the same server, with the same client."""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import sys
import tempfile
import time
from typing import Any

from services.testbed.natsserver import start_nats
from services.testbed.output import emit
from shared.bus.connect import Bus
from shared.bus.provision import StreamsConfig, provision
from shared.fence.heartbeat import HostHeartbeat
from shared.fence.keys import Key
from shared.fence.schema import (
    H_KIND,
    VERIFY_KIND,
    CommandResult,
    Observed,
    PartitionVerified,
    Spec,
    decode_command,
    decode_verify,
    encode,
)
from shared.subjects import Subjects
from shared.tasks import run_main

BENCH_STREAM = "VMFENCE_BENCH_RAW"


def _idle_bound(slot: Any, verify: bool) -> bool:
    if slot.packed and not verify:
        return True
    st = slot.peek()
    return st.cur is not None and st.cur.bound and not st.outbox


def idle_bound_keys(rec: Any, *, verify: bool = False) -> int:
    """Keys of a running ``Reconciler`` that are bound with nothing in flight. A packed slot is idle
    by construction (see ``KeySlot``): it is decoded only with ``verify`` (then it must be bound)."""
    return sum(_idle_bound(slot, verify) for part in rec.partitions.values() for slot in part.keys.values())

async def until_hosts_live(rec: Any, n: int = 2) -> None:
    """Until a running ``Reconciler`` sees ``n`` live hosts (their heartbeats)."""
    while len(rec.hosts.live()) < n:
        rec.hosts.changed.clear()
        await asyncio.wait_for(rec.hosts.changed.wait(), 30)


async def publish_pod_observations(
    js: Any, subjects: Any, pods: list[Any], indices: range, timeout_s: float
) -> None:
    """First observations of ``pods[i]`` for ``i`` in ``indices`` (uid ``uid-<i>``, rv 1), published
    asynchronously with at most 1024 unacknowledged."""
    window: list[asyncio.Future[Any]] = []
    for i in indices:
        obs = Observed(str(pods[i]), f"uid-{i:08d}", 1)
        window.append(await js.publish_async(subjects.observation(pods[i]), encode(obs),
                                             headers={"Nats-Msg-Id": f"uid-{i:08d}:1"}))
        if len(window) >= 1024:
            await asyncio.wait_for(asyncio.gather(*window), timeout_s)
            window.clear()
    await asyncio.wait_for(asyncio.gather(*window), timeout_s)


async def until_keys_idle(rec: Any, n: int, deadline: float) -> None:
    """Until ``n`` keys of a running ``Reconciler`` are bound with nothing in flight (polled: the
    benchmark's own clock, not an event of the reconciler's); TimeoutError after ``deadline``. The
    poll runs in the process being measured: each looks only past the run of keys, in the order a
    partition first saw them, already found idle, up to the first that is not (keys settle about in
    that order), and one full count confirms the end. Re-reading every key every 50 ms took 3-4 %
    of the process."""
    idle_prefix: dict[int, int] = {}
    while True:
        for p, part in rec.partitions.items():
            start = idle_prefix.get(p, 0)
            ahead = 0
            for slot in itertools.islice(part.keys.values(), start, None):
                if not _idle_bound(slot, False):
                    break
                ahead += 1
            idle_prefix[p] = start + ahead
        if sum(idle_prefix.values()) >= n and idle_bound_keys(rec) >= n:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {idle_bound_keys(rec)}/{n} keys bound and idle before the deadline")
        await asyncio.sleep(0.05)


async def raw_publish_rates(bus: Bus, n: int) -> tuple[float, float]:
    """Sync (one request at a time) and pipelined async publish rates of this client."""
    js = bus.js
    await js.add_stream(name=BENCH_STREAM, subjects=["vmfence-bench.>"])
    payload = b"x" * 200
    try:
        start = time.perf_counter()
        for i in range(n):
            await js.publish(f"vmfence-bench.sync.{i % 64}", payload, timeout=5)
        sync_rate = n / (time.perf_counter() - start)
        wall, _ = await _pipelined(js, n)
        async_rate = n / wall
    finally:
        await js.delete_stream(BENCH_STREAM)
    return sync_rate, async_rate


async def _pipelined(js: Any, n: int) -> tuple[float, float]:
    """Wall and process CPU seconds of ``n`` pipelined publishes (at most 1024 unanswered) to the
    benchmark's stream."""
    payload = b"x" * 200
    start, cpu_start = time.perf_counter(), time.process_time()
    pending: list[asyncio.Future] = []  # type: ignore[type-arg]
    for i in range(n):
        pending.append(await js.publish_async(f"vmfence-bench.async.{i % 64}", payload))
        if len(pending) >= 1024:
            await asyncio.wait_for(asyncio.gather(*pending), 30)
            pending.clear()
    await asyncio.wait_for(asyncio.gather(*pending), 30)
    return time.perf_counter() - start, time.process_time() - cpu_start


async def raw_async_publish_cpu_us(bus: Bus, n: int) -> float:
    """This process's CPU (every thread) per pipelined publish of this client, in µs: the unit
    beside which ``bench decisions`` puts the reconciler's CPU per decision. CPU per unit, not a
    rate, is what stays put on a shared machine (the rates here moved by ±20 % from run to run)."""
    js = bus.js
    await js.add_stream(name=BENCH_STREAM, subjects=["vmfence-bench.>"])
    try:
        _, cpu = await _pipelined(js, n)
        return 1e6 * cpu / n
    finally:
        await js.delete_stream(BENCH_STREAM)


async def answer_commands(bus: Bus, host: str, stop: asyncio.Event) -> int:
    """Answers every command at once (`ok`), as an agent with an infinitely fast runtime would."""
    subjects = bus.subjects
    psub = await bus.js.pull_subscribe(
        subjects.command(host), durable=f"bench-{host}", stream=subjects.stream_cmd
    )
    answered = 0
    while not stop.is_set():
        try:
            msgs = await psub.fetch(256, timeout=0.5)
        except TimeoutError:
            continue
        except Exception:  # a leader election or reconnect: try again shortly
            await asyncio.sleep(0.2)
            continue
        acks = []
        for m in msgs:
            if (m.headers or {}).get(H_KIND) == VERIFY_KIND:  # a partition's writer verifies this host
                ask = decode_verify(m.data)
                verified = PartitionVerified(ask.partition, ask.gen, ask.gen, host)
                acks.append(await bus.js.publish_async(
                    subjects.host_partition_report(ask.partition, host), encode(verified),
                    headers={"Nats-Msg-Id": f"verified:{host}:{ask.partition}:{ask.gen}"},
                ))
                continue
            cmd = decode_command(m.data)
            res = CommandResult(cmd.fence, cmd.id, cmd.op, host, cmd.vm_id, "ok", ip="10.0.0.2")
            acks.append(
                await bus.js.publish_async(
                    subjects.report(Key.parse(cmd.fence.key)), encode(res), headers={"Nats-Msg-Id": cmd.id}
                )
            )
            answered += 1
        try:
            await asyncio.wait_for(asyncio.gather(*acks), 30)
        except Exception:  # unanswered: not acked, so the commands come again
            continue
        for m in msgs:
            await m.ack()
    return answered


def bench_pods(keys: int) -> list[Key]:
    """The pods ``bench decisions`` decides, in the order their observations are published."""
    return [Key("pod", "bench", f"pod-{i}") for i in range(keys)]


async def _publish_on_go(bus: Bus, keys: int) -> None:
    """Say ``ready`` on stdout, wait for ``go`` on stdin, then publish the first observation of each
    of ``bench_pods(keys)``: the measured process then runs the reconciler alone."""
    loop = asyncio.get_running_loop()
    print("ready", flush=True)
    line = await loop.run_in_executor(None, sys.stdin.readline)
    if line.strip() != "go":
        return
    await publish_pod_observations(bus.js, bus.subjects, bench_pods(keys), range(keys), 60)
    print("published", flush=True)


FAKE_HOSTS = ("host-a", "host-b")
HEARTBEAT_EVERY_S = 3.0  # well inside the reconciler's HostsView.stale_after_s (15 s)


def fake_heartbeat(host: str) -> HostHeartbeat:
    """A fake host's heartbeat: room for far more VMs than any benchmark places."""
    return HostHeartbeat(host, "sim", 10**7, 10**7, 10**10, 10**10, 0, time.time())


async def beat_hosts(bus: Bus) -> None:
    """Heartbeat the fake hosts until cancelled, as live agents do: a run longer than the reconciler's
    stale_after_s would otherwise see them die, and its pods left unplaced (a 30 000-key
    ``bench decisions`` never ended)."""
    hosts = await bus.js.key_value(bus.subjects.kv_hosts)
    while True:
        for host in FAKE_HOSTS:
            await hosts.put(host, encode(fake_heartbeat(host)))
        await asyncio.sleep(HEARTBEAT_EVERY_S)  # a period, not a synchronisation


def fake_agents_main(url: str, partitions: int, publish_keys: int = 0) -> None:
    """Entry point of the fake agents' process (host-a and host-b): heartbeats and answers their
    commands until terminated. With ``publish_keys``, it also publishes that many pods' observations
    when told (``_publish_on_go``)."""

    async def run() -> None:
        bus = await Bus.open(url, name="bench-agents", subjects=Subjects(partitions=partitions))
        stop = asyncio.Event()
        async with asyncio.TaskGroup() as tg:
            tg.create_task(beat_hosts(bus))
            for host in FAKE_HOSTS:
                tg.create_task(answer_commands(bus, host, stop))
            if publish_keys:
                tg.create_task(_publish_on_go(bus, publish_keys))

    try:
        asyncio.run(run())
    except KeyboardInterrupt:
        pass


async def _run_decisions(keys: int, partitions: int) -> dict[str, object]:
    from services.reconciler.config import ReconcilerConfig
    from services.reconciler.kube import NullGateway
    from services.reconciler.service import Reconciler
    from shared import heap

    heap.settle()  # as `vmfence reconciler` runs: its raw-publish baseline runs settled too
    tmp = tempfile.mkdtemp(prefix="vmfence-bench-")
    server = await start_nats(store_dir=os.path.join(tmp, "nats"))
    try:
        subjects = Subjects(partitions=partitions)
        bus = await Bus.open(server.url, name="bench", subjects=subjects)
        await provision(bus.js, subjects, StreamsConfig(partitions=partitions))
        raw_n = max(2000, min(keys, 20000))
        sync_rate, async_rate = await raw_publish_rates(bus, raw_n)
        raw_cpu_before = await raw_async_publish_cpu_us(bus, raw_n)
        hosts = await bus.js.key_value(subjects.kv_hosts)
        for host in FAKE_HOSTS:  # live from the start; the fake agents' process keeps them so
            await hosts.put(host, encode(fake_heartbeat(host)))
        gateway = NullGateway()
        pods = bench_pods(keys)
        for i, key in enumerate(pods):
            gateway.objects[str(key)] = (f"uid-{i:08d}", 1, Spec())
        cfg = ReconcilerConfig(
            nats_url=[server.url], partitions=partitions, id="bench", data_dir=os.path.join(tmp, "rec"),
            kube="none", http_port=0,
        )
        rec = Reconciler(cfg, gateway=gateway, health=False)
        # the fake agents run in their own process, as real agents do, and so does the publishing
        # of the pods' observations, as a watcher's: this process runs the reconciler alone (and
        # the benchmark's poll for the end)
        agents = await asyncio.create_subprocess_exec(
            sys.executable, "-c",
            f"from services.testbed.bench.command import fake_agents_main; "
            f"fake_agents_main({server.url!r}, {partitions}, {keys})",
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        )
        assert agents.stdin is not None and agents.stdout is not None
        try:
            async with asyncio.TaskGroup() as tg:
                rec_task = tg.create_task(rec.run())
                await asyncio.wait_for(rec.ready.wait(), 30)
                await until_hosts_live(rec)
                if (await asyncio.wait_for(agents.stdout.readline(), 60)).strip() != b"ready":
                    raise RuntimeError("the fake agents' process did not start")
                start, cpu_start = time.perf_counter(), time.process_time()
                agents.stdin.write(b"go\n")
                await agents.stdin.drain()
                await until_keys_idle(rec, keys, time.monotonic() + max(120.0, keys / 50))
                seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
                decisions = sum(p.stats["decisions"] for p in rec.partitions.values())
                entries = sum(p.stats["entries"] for p in rec.partitions.values())
                rec.stop()
                await rec_task
        finally:  # a run that failed (a timeout on a busy machine) leaves no agents process behind
            agents.terminate()
            await agents.wait()
        # the baseline again, after: this machine's speed drifts within a run, and the mean of the
        # two brackets the decisions in time
        _, async_after = await raw_publish_rates(bus, raw_n)
        raw_cpu = (raw_cpu_before + await raw_async_publish_cpu_us(bus, raw_n)) / 2
        await bus.close()
    finally:
        await server.stop()
    rate = decisions / seconds
    async_rate_mean = (async_rate + async_after) / 2
    return {
        "bench": "decisions",
        "keys": keys,
        "partitions": partitions,
        "decisions": decisions,
        "entries": entries,
        "seconds": round(seconds, 3),
        "decisions_per_s": round(rate, 1),
        "entries_per_s": round(entries / seconds, 1),
        "raw_sync_publish_per_s": round(sync_rate, 1),
        "raw_async_publish_per_s": round(async_rate_mean, 1),
        "raw_async_publish_per_s_before_after": [round(async_rate, 1), round(async_after, 1)],
        "ratio_to_raw_async_publish": round(rate / async_rate_mean, 3),
        # the same comparison in CPU: µs of this process per decision against µs of it per raw
        # pipelined publish (the mean of before and after); steadier than the rates on a shared machine
        "cpu_us_per_decision": round(1e6 * cpu_seconds / max(1, decisions), 2),
        "raw_async_publish_cpu_us_per_msg": round(raw_cpu, 2),
        "cpu_ratio_to_raw_async_publish": round(raw_cpu / max(1e-9, 1e6 * cpu_seconds / max(1, decisions)), 3),
        "raw_messages": raw_n,
    }


def bench_decisions(args: argparse.Namespace) -> int:

    result = run_main(_run_decisions(args.keys, args.partitions))
    emit(result, args.json)
    return 0


def bench_vm(args: argparse.Namespace) -> int:
    from services.testbed.bench.vm import run_vm_bench

    result = run_main(run_vm_bench(args.runtime, args.count, guest_boots=getattr(args, "guest_boots", 3),
                                   network=getattr(args, "network", "user")))
    emit(result, args.json)
    return 0


