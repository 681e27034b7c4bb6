"""`vmfence replay --file F --jobs N`: the keys shared out over N processes give the report one
process gives — every count, every invariant's positions, and every violation with its position and
time, including the one check that spans keys (a VM bound to two keys that fall in different
shards), violations found only at the end, a gap and an undecodable record."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from services.cli.replayjobs import shard_of
from services.testbed.bench.replayfile import make_export
from shared.bus.logstream import Record, encode_record
from shared.fence.schema import Admitted, Bound, Command, Commanded, Done, Fence, LogEntry, Placed, Spec

ROOT = Path(__file__).resolve().parents[2]
JOBS = 3


def _replay(path: Path, *extra: str) -> tuple[int, dict[str, Any]]:
    proc = subprocess.run([sys.executable, "-m", "services.cli", "replay", "--file", str(path), "--json", *extra],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode in (0, 1), proc.stderr[-2000:]
    return proc.returncode, json.loads(proc.stdout)


def _two_keys_in_different_shards() -> tuple[str, str]:
    keys = [f"shop/cart-{i}" for i in range(50)]
    a = keys[0]
    b = next(k for k in keys if shard_of(k, JOBS) != shard_of(a, JOBS))
    return a, b


def _bring_up(key: str, uid: str, vm: str) -> list[list[Any]]:
    f = Fence(key, uid, 1)
    cid = f"{vm}-{uid}-create"
    return [[Admitted(f, Spec(), resource_version=1)],
            [Placed(f, vm, "host-a"), Commanded(Command(cid, "create", f, "host-a", vm))],
            [Done(cid, "ok"), Bound(f, vm, "host-a", cid)]]


def _planted(path: Path, first_seq: int) -> None:
    """Append records that break invariants, across shards and at the end."""
    a, b = _two_keys_in_different_shards()
    seq = first_seq
    t = 1_800_000_000.0
    recs: list[Record] = []

    def add(entry: LogEntry, error: str = "") -> None:
        nonlocal seq
        recs.append(Record(seq, entry, t + seq, error))
        seq += 1

    for i, ds in enumerate(_bring_up(a, "ua", "shared-vm")):
        add(LogEntry(a, i + 1, ds, at=t + seq))
    for i, ds in enumerate(_bring_up(b, "ub", "shared-vm")):  # the same VM, live for a: vm_bound_twice
        add(LogEntry(b, i + 1, ds, at=t + seq))
    g = "shop/gappy"
    add(LogEntry(g, 1, [Admitted(Fence(g, "ug", 1), Spec())]))
    add(LogEntry(g, 3, [Admitted(Fence(g, "ug2", 2), Spec())]))  # a gap
    add(LogEntry("shop/broken", 0, []), error="undecodable entry: planted")
    left = Fence("shop/left", "ul", 1)
    add(LogEntry(left.key, 1, [Admitted(left, Spec()), Placed(left, "left-vm", "host-b")]))  # never settled
    with path.open("ab") as f:
        for r in recs:
            f.write(encode_record(r))


def _comparable(report: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in report.items() if k not in ("seconds", "cpu_seconds", "created", "jobs", "peak_rss_mib")}
    out["violations"] = sorted(json.dumps(v, sort_keys=True) for v in report["violations"])
    return out


@pytest.mark.parametrize("planted", [False, True])
def test_a_sharded_replay_reports_what_one_process_reports(tmp_path: Path, planted: bool) -> None:
    path = tmp_path / "log.export"
    entries = 6_000
    make_export(str(path), entries)
    if planted:
        _planted(path, entries + 1)
    rc1, one = _replay(path, "--jobs", "1")
    rcn, many = _replay(path, "--jobs", str(JOBS))
    assert (one["jobs"], many["jobs"]) == (1, JOBS)
    assert rc1 == rcn == (1 if planted else 0)
    assert _comparable(many) == _comparable(one)
    if planted:
        rules = {v["rule"] for v in many["violations"]}
        assert {"vm_bound_twice", "gap", "undecodable_entry", "unsettled_vm"} <= rules, rules
        cross = next(v for v in many["violations"] if v["rule"] == "vm_bound_twice")
        assert cross["time"] != "-" and "shared-vm already live for shop/cart-0" in cross["message"]


def test_jobs_out_of_range_is_one_line(tmp_path: Path) -> None:
    for bad in ("0", "65", "many"):
        proc = subprocess.run([sys.executable, "-m", "services.cli", "replay", "--file", str(tmp_path / "x"),
                               "--jobs", bad], capture_output=True, text=True, cwd=ROOT, timeout=60)
        assert proc.returncode == 2 and "--jobs" in proc.stderr and "Traceback" not in proc.stderr


def test_a_corrupt_or_truncated_file_is_one_line_under_jobs(tmp_path: Path) -> None:
    path = tmp_path / "log.export"
    make_export(str(path), 2_000)
    data = path.read_bytes()
    for name, broken in (("truncated", data[:-5]),
                         ("garbled", data[:-200] + b"\xc1" * 200)):  # 0xc1: never valid msgpack
        bad = tmp_path / f"{name}.export"
        bad.write_bytes(broken)
        proc = subprocess.run([sys.executable, "-m", "services.cli", "replay", "--file", str(bad), "--jobs", "2"],
                              capture_output=True, text=True, cwd=ROOT, timeout=120)
        assert proc.returncode == 2, (name, proc.returncode, proc.stderr[-1000:])
        assert "cannot read" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-1000:]
