"""`vmfence export` and `vmfence replay` as a user runs them: clean log → exit 0; a log corrupted by
hand → exit 1 naming the key and the sequence."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import msgspec

from services.reconciler.config import ReconcilerConfig
from services.reconciler.kube import NullGateway
from services.reconciler.service import Reconciler
from services.testbed.natsserver import NatsServer
from shared.bus.connect import Bus
from shared.bus.logstream import EXPORT_MAGIC, Record, encode_record, iter_export
from shared.bus.provision import StreamsConfig, provision
from shared.fence.keys import Key
from shared.fence.schema import Bound, Fence, LogEntry, Spec
from shared.subjects import Subjects
from tests.reconciler.helpers import observe, sim_agent, wait_until

ROOT = Path(__file__).resolve().parents[2]


def vmfence(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "services.cli", *args], capture_output=True, text=True, cwd=ROOT, timeout=60
    )


async def _make_log(url: str, tmp: Path) -> None:
    subjects = Subjects()
    bus = await Bus.open(url, name="test", subjects=subjects)
    await provision(bus.js, subjects, StreamsConfig())
    gateway = NullGateway()
    keys = [Key("pod", "shop", f"cart.{i}") for i in range(8)]
    for i, k in enumerate(keys):
        gateway.objects[str(k)] = (f"uid-{i}", 1, Spec())
    rec = Reconciler(
        ReconcilerConfig(nats_url=[url], id="rec", data_dir=str(tmp / "rec"), kube="none", http_port=0),
        gateway=gateway, health=False,
    )
    async with sim_agent(url, "host-a", tmp, 16), asyncio.TaskGroup() as tg:
        run = tg.create_task(rec.run())
        await rec.ready.wait()
        await wait_until(lambda: len(rec.hosts.live()) == 1, "the agent's heartbeat")
        for i, k in enumerate(keys):
            await observe(bus, k, f"uid-{i}", 1)
        await wait_until(
            lambda: sum(1 for p in rec.partitions.values() for s in p.keys.values()
                        if s.state.cur is not None and s.state.cur.bound and not s.state.outbox) == len(keys),
            "all bound",
        )
        rec.stop()
        await run
    await bus.close()


async def test_export_then_replay_is_clean_and_a_hand_corrupted_log_fails(
    nats_server: NatsServer, tmp_path: Path
) -> None:
    await _make_log(nats_server.url, tmp_path)
    live = await asyncio.to_thread(vmfence, "replay", "--nats", nats_server.url)
    assert live.returncode == 0, live.stdout + live.stderr
    assert "clean" in live.stdout
    export = tmp_path / "log.vmf"
    out = await asyncio.to_thread(vmfence, "export", "--nats", nats_server.url, "-o", str(export))
    assert out.returncode == 0, out.stderr
    clean = await asyncio.to_thread(vmfence, "replay", "--file", str(export), "--json")
    assert clean.returncode == 0
    report = json.loads(clean.stdout)
    assert report["clean"] and report["keys"] == 8 and report["vms_bound_live"] == 8

    # corrupt one entry by hand: bind a VM under a fence that was never current
    records = list(iter_export(export.read_bytes()))
    victim = next(i for i, r in enumerate(records) if any(isinstance(d, Bound) for d in r.entry.decisions))
    rec = records[victim]
    decisions = [
        msgspec.structs.replace(d, fence=Fence(d.fence.key, "intruder", 99)) if isinstance(d, Bound) else d
        for d in rec.entry.decisions
    ]
    records[victim] = Record(rec.seq, LogEntry(rec.entry.key, rec.entry.n, decisions))
    bad = tmp_path / "bad.vmf"
    bad.write_bytes(EXPORT_MAGIC + b"".join(encode_record(r) for r in records))
    broken = await asyncio.to_thread(vmfence, "replay", "--file", str(bad))
    assert broken.returncode == 1
    assert rec.entry.key in broken.stdout and f"entry {rec.entry.n}" in broken.stdout
    assert f"stream seq {rec.seq}" in broken.stdout

    # and a dropped entry is a gap
    gapped = tmp_path / "gap.vmf"
    gapped.write_bytes(EXPORT_MAGIC + b"".join(encode_record(r) for i, r in enumerate(records) if i != victim))
    gap = await asyncio.to_thread(vmfence, "replay", "--file", str(gapped), "--json")
    assert gap.returncode == 1
    rules = {v["rule"] for v in json.loads(gap.stdout)["violations"]}
    assert "gap" in rules
