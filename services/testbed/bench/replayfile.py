"""`vmfence bench replay`: replaying an export file of N entries beside decoding the same file.

The log is the real policy's: the model world (``decide`` and ``fold``) takes a few keys through
create and delete rounds, and that log is repeated under other pod names until it holds N entries
(each copy is a clean log of its own keys, so the whole stays clean). The figure is the CLI's own
``vmfence replay --file`` run in a child process — its reported seconds and its peak RSS — beside
the same-run baseline of decoding the same file with msgspec, typed (what replay needs) and untyped,
both as entries per CPU second of their own process (wall time on a shared 2-core machine is noise).
The sharded replay (the CLI's default on a machine with several CPUs) is measured in wall time
against one core's decoding, since its point is the wait, not the CPU.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import msgspec

from shared.bus.logstream import EXPORT_MAGIC, Record, encode_record
from shared.fence.schema import LogEntry

TILE_KEYS = 20
TILE_ROUNDS = 5
ROOT = Path(__file__).resolve().parents[3]


def _tile() -> list[bytes]:
    from services.testbed.world import World

    world = World(keys=TILE_KEYS)
    world.churn(TILE_ROUNDS)
    return [msgspec.json.encode(e) for e in world.log]


def make_export(path: str, entries: int) -> int:
    """Write an export file of ``entries`` entries (stamped one millisecond apart); its size."""
    tile = _tile()
    decode = msgspec.json.Decoder(LogEntry).decode
    t0 = time.time() - entries / 1000
    seq = 0
    with open(path, "wb") as f:
        f.write(EXPORT_MAGIC)
        copy = 0
        while seq < entries:
            for raw in tile:
                seq += 1
                entry = msgspec.structs.replace(decode(raw.replace(b"pod-", b"p%d-" % copy)), at=t0 + seq / 1000)
                f.write(encode_record(Record(seq, entry, t0 + seq / 1000)))
                if seq >= entries:
                    break
            copy += 1
        return f.tell()


def _cpu_rate(n: int, fn: Any, repeat: int = 3) -> float:
    """Entries per CPU second of this process (the median of ``repeat`` runs of ``fn``)."""
    times = []
    for _ in range(repeat):
        t0 = time.process_time()
        fn()
        times.append(time.process_time() - t0)
    return n / statistics.median(times)


def _decode_rates(path: str, entries: int) -> tuple[float, float, float]:
    """Typed decoding per CPU second and per wall second (one process, one core), untyped per CPU s:
    each a plain loop over the file's records, no library iterator in between."""
    data = Path(path).read_bytes()
    typed_decoder = msgspec.msgpack.Decoder(Record)
    typed = _cpu_rate(entries, lambda: _decode_all(data, typed_decoder))
    walls = []
    for _ in range(3):
        t0 = time.perf_counter()
        _decode_all(data, typed_decoder)
        walls.append(time.perf_counter() - t0)
    untyped = _cpu_rate(entries, lambda: _decode_all(data, msgspec.msgpack.Decoder()))
    return typed, entries / statistics.median(walls), untyped


def _decode_all(data: bytes, decoder: msgspec.msgpack.Decoder[Any]) -> int:
    """Decode every record of an export with ``decoder`` (typed or not), each from a view; the count."""
    decode = decoder.decode
    view = memoryview(data)
    pos, m = len(EXPORT_MAGIC), 0
    while pos < len(data):
        k = int.from_bytes(data[pos : pos + 4], "big")
        decode(view[pos + 4 : pos + 4 + k])
        pos += 4 + k
        m += 1
    return m


def _replay_child(path: str, *flags: str) -> tuple[dict[str, Any], float]:
    """The CLI's replay of the file: its JSON (with its own peak RSS) and the CPU seconds of it and
    its shard processes."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run([sys.executable, "-m", "services.cli", "replay", "--file", path, "--json", *flags],
                          capture_output=True, cwd=ROOT, timeout=1800)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode not in (0, 1):
        raise RuntimeError(f"vmfence replay exited {proc.returncode}: {proc.stderr.decode()[-500:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return json.loads(proc.stdout), cpu


def replay_bench(entries: int) -> dict[str, Any]:
    """One process (``--jobs 1``: entries per CPU second against typed decoding per CPU second) and
    the default, sharded over this machine's CPUs (its wall time against one core's decoding)."""
    with tempfile.TemporaryDirectory(prefix="vmfence-bench-replay-") as tmp:
        path = os.path.join(tmp, "log.export")
        t0 = time.perf_counter()
        size = make_export(path, entries)
        made_s = time.perf_counter() - t0
        typed, typed_wall, untyped = _decode_rates(path, entries)
        one, one_cpu = _replay_child(path, "--jobs", "1")
        many, many_cpu = _replay_child(path)
    for report in (one, many):
        if report["entries"] != entries or not report["clean"]:
            raise RuntimeError(f"replay saw {report['entries']} entries, clean={report['clean']}")
    rate = entries / one["cpu_seconds"]  # CPU, as the baseline: steady on a shared machine
    wall_rate = entries / many["seconds"]
    return {
        "entries": entries,
        "keys": one["keys"],
        "decisions": one["decisions"],
        "file_bytes": size,
        "make_file_s": round(made_s, 2),
        "raw_typed_decode_entries_per_cpu_s": round(typed),
        "raw_typed_decode_entries_per_s": round(typed_wall),
        "raw_untyped_decode_entries_per_cpu_s": round(untyped),
        "replay_file_wall_s": one["seconds"],
        "replay_file_cpu_s": one["cpu_seconds"],
        "replay_file_entries_per_cpu_s": round(rate),
        "replay_process_cpu_s": round(one_cpu, 3),
        "replay_peak_rss_mib": one["peak_rss_mib"],
        "ratio_to_typed_decode": round(rate / typed, 3),
        "ratio_to_untyped_decode": round(rate / untyped, 3),
        "sharded_jobs": many["jobs"],
        "sharded_wall_s": many["seconds"],
        "sharded_cpu_s": many["cpu_seconds"],
        "sharded_process_cpu_s": round(many_cpu, 3),
        "sharded_entries_per_s": round(wall_rate),
        "sharded_peak_rss_mib": many["peak_rss_mib"],
        "sharded_wall_ratio_to_typed_decode": round(wall_rate / typed_wall, 3),
        "clean": bool(one["clean"] and many["clean"]),
    }
