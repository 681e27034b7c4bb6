"""Smoke runs of `vmfence bench vm` and `vmfence bench all` as the user runs them (child processes):
the JSON contract other tools read, never the timings (a shared CI machine makes those noise)."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]

VM_FIELDS = (
    "create_p50_s", "create_p95_s", "raw_qemu_start_p50_s", "create_ratio_to_raw", "guest_boot_p50_s",
    "hibernate_p50_s", "wake_p50_s", "rss_per_vm_mib", "count",
)  # fmt: skip
FIGURE_FIELDS: dict[str, tuple[str, ...]] = {
    "decisions": ("decisions_per_s", "baseline_raw_async_publish_per_s", "ratio_to_raw_async_publish"),
    "pods": ("scale_ratio",),
    "replay": ("replay_file_entries_per_s", "replay_js_entries_per_s", "raw_typed_decode_entries_per_s",
               "file_ratio_to_raw_decode"),
    "memory": ("bytes_per_idle_key", "rss_empty_mib", "rss_loaded_mib", "python_deep_bytes_per_key"),
    "catchup": ("ready_with_snapshot_s", "ready_without_snapshot_s", "python_import_floor_s", "raw_log_read_s"),
}
LOAD_FIELDS = ("to_bound_p50_s", "to_bound_p99_s", "bound_to_status_p99_s", "to_running_p99_s")
SIZE_FIELDS = ("to_running_s", "pods_per_s", "delete_to_zero_s", "entries_per_pod", "decisions_per_pod")
COMPONENTS = ("apiserver", "watcher", "agent", "reconciler", "nats")


def vmfence_json(*args: str, timeout: float) -> dict[str, Any]:
    p = subprocess.run(
        [sys.executable, "-m", "services.cli", *args, "--json"],
        cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr[-2000:]
    lines = p.stdout.strip().splitlines()
    assert len(lines) == 1, p.stdout  # one JSON object, nothing else on stdout
    out: dict[str, Any] = json.loads(lines[0])
    return out


def is_number(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


DECISIONS_FIELDS = (
    "decisions_per_s", "raw_async_publish_per_s", "ratio_to_raw_async_publish", "cpu_us_per_decision",
    "raw_async_publish_cpu_us_per_msg", "cpu_ratio_to_raw_async_publish",
)  # fmt: skip


def test_bench_decisions() -> None:
    """The reconciler alone: its observations published by the fake agents' process on cue, every
    key decided to bound, both ratios to the raw publish numbers."""
    r = vmfence_json("bench", "decisions", "--keys", "300", "--partitions", "4", timeout=120)
    for f in DECISIONS_FIELDS:
        assert is_number(r[f]) and r[f] > 0, (f, r.get(f))
    assert r["keys"] == 300 and r["entries"] >= 300 and r["decisions"] >= 3 * 300


def test_bench_vm_sim() -> None:
    r = vmfence_json("bench", "vm", "--runtime", "sim", "--count", "3", timeout=30)
    for f in VM_FIELDS:
        assert f in r, f
    # the sim has no QEMU to compare with and boots no guest: those are null, the rest numbers
    nullable = {"raw_qemu_start_p50_s", "create_ratio_to_raw", "guest_boot_p50_s"}
    for f in VM_FIELDS:
        assert is_number(r[f]) or (f in nullable and r[f] is None), (f, r[f])
    assert r["accel"] == "sim" and r["count"] == 3


@pytest.mark.timeout(420)
def test_bench_all_smoke() -> None:
    r = vmfence_json("bench", "all", "--size", "smoke", timeout=400)
    figs = r["figures"]
    for name, fields in FIGURE_FIELDS.items():
        for f in fields:
            assert is_number(figs[name].get(f)), (name, f, figs[name].get(f))
        assert figs[name]["command"].startswith("vmfence bench all")
        assert "target" in figs[name] or "targets" in figs[name]
    loads = figs["latency"]["loads"]
    assert [x["offered_per_s"] for x in loads] == [50]
    for f in LOAD_FIELDS:
        assert is_number(loads[0][f]), (f, loads[0][f])
    # the throughput figures: one process per component, CPU per pod by component beside the
    # bare API server's CPU per create, at two sizes (their ratio is the growth with the fleet)
    sizes = figs["pods"]["sizes"]
    assert [x["pods"] for x in sizes] == [40, 120]
    for x in [*sizes, loads[0]]:
        cpu = x["cpu_ms_per_pod"]
        assert all(is_number(cpu[c]) and cpu[c] > 0 for c in COMPONENTS), cpu
        assert cpu["total"] == pytest.approx(sum(cpu[c] for c in COMPONENTS), abs=0.01)
    for x in sizes:
        assert all(is_number(x[f]) for f in SIZE_FIELDS), x
        # what the libraries alone charge for the pod's requests and messages, a lower bound of its CPU
        floor = x["library_floor_ms_per_pod"]
        assert floor["kube"] > 0 and floor["nats"] > 0 and x["nats_msgs_per_pod"] > 0, x
        assert floor["total"] == pytest.approx(floor["kube"] + floor["nats"], abs=0.02)
        assert x["over_floor"] == pytest.approx(x["cpu_ms_per_pod"]["total"] / floor["total"], rel=0.02)
    assert is_number(figs["pods"]["baseline_bare_api"][0]["apiserver_cpu_ms_per_create"])
    # a reconciler stopped in the middle of a burst: the other took every partition, every pod ran
    # (and each component's collector time is reported beside its CPU)
    handover = figs["pods"]["handover"]
    assert handover["pods"] == 40 and is_number(handover["steady_to_running_s"])
    [stop] = handover["runs"]
    assert stop["how"] == "stop" and is_number(stop["to_running_s"]), stop
    assert is_number(stop["partitions_taken_over_s"]) and is_number(stop["rebalanced_s"]), stop
    assert all(is_number(v) and v >= 0 for v in sizes[-1]["gc_ms_per_pod"].values()), sizes[-1]
    assert is_number(r["fleet"]["raw_publish_per_s"]["async"])
    per_msg = r["fleet"]["raw_publish_cpu_us_per_msg"]
    assert per_msg["client"] > 0 and per_msg["nats"] > 0
    # beside the latency: what one wake-up of another process costs here, with and without asyncio
    wake = r["fleet"]["wakeup_baseline"]
    assert all(is_number(wake[k]["cpu_us_per_round_trip"]) and wake[k]["cpu_us_per_round_trip"] > 0
               for k in ("blocking", "asyncio_uvloop")), wake
    assert figs["replay"]["audit_clean"] is True
    assert r["machine"]["cpus"] >= 1


def test_bench_replay_file_smoke() -> None:
    """`vmfence bench replay` at smoke size: one process against typed decoding (CPU), and the
    sharded default against one core's decoding (wall), each with its peak RSS."""
    r = vmfence_json("bench", "replay", "--entries", "20000", timeout=120)
    for f in ("raw_typed_decode_entries_per_cpu_s", "raw_typed_decode_entries_per_s", "replay_file_entries_per_cpu_s",
              "ratio_to_typed_decode", "replay_peak_rss_mib", "sharded_wall_ratio_to_typed_decode",
              "sharded_peak_rss_mib"):
        assert is_number(r[f]) and r[f] > 0, (f, r[f])
    assert r["entries"] == 20000 and r["clean"] is True and r["sharded_jobs"] >= 1


@pytest.mark.qemu
@pytest.mark.skipif(shutil.which("qemu-system-x86_64") is None or shutil.which("qemu-img") is None,
                    reason="qemu-system-x86_64 / qemu-img not installed")
def test_bench_vm_qemu() -> None:
    r = vmfence_json("bench", "vm", "--runtime", "qemu", "--count", "2", "--guest-boots", "0", timeout=60)
    for f in VM_FIELDS:
        assert f in r, f
        assert is_number(r[f]) or (f == "guest_boot_p50_s" and r[f] is None), (f, r[f])
    assert r["accel"] in ("kvm", "tcg")
    assert r["rss_per_vm_mib"] > 0


def test_bench_append_batch_semantics_and_figures() -> None:
    """The atomic-batch facts docs/benchmarks.md rests its choice on (one request per append), read
    off the real nats-server: per-message expectations hold in a batch, but one stale expectation or
    one stored Msg-Id refuses the whole batch, and one subject cannot take two appends of a batch."""
    r = vmfence_json("bench", "append", "--keys", "40", "--batch", "10", "--rounds", "3", timeout=60)
    sem = r["semantics"]
    assert sem["per_message_expectations_land"] is True
    assert sem["one_stale_rejects_batch_err"] == 10071 and sem["one_stale_stored_nothing"] is True
    assert sem["stored_msg_id_rejects_batch_err"] == 10201
    assert sem["two_on_one_subject_err"] == 10164
    for storage in ("file", "memory"):
        for way in ("single", "single_nats_py_publish", "batched"):
            fig = r[storage][way]
            for f in ("wall_us_per_append", "client_cpu_us_per_append", "server_cpu_us_per_append",
                      "total_cpu_us_per_append"):
                assert is_number(fig[f]) and fig[f] >= 0, (storage, way, f, fig[f])
        assert is_number(r[storage]["batched_over_single_total_cpu"])
        assert is_number(r[storage]["single_over_nats_py_client_cpu"])


async def test_stages_of_a_pods_time_to_bound(tmp_path: Path) -> None:
    """`python -m services.testbed.bench.stages`: every pod of a small load timed through each stage
    between its create and its binding entry."""
    from services.testbed.bench.stages import STAGES, run_stages

    r = await run_stages(20, 1.0, 0, str(tmp_path))
    assert r["pods"] == 20 and r["timed"] == 20, r
    for stage in STAGES:  # (a stage timed by the harness's subscription may come out a hair below 0)
        got = r["stages_s"][stage]
        assert all(is_number(got[p]) for p in ("p50", "p90", "p99")), (stage, got)
    assert 0 < r["stages_s"]["total"]["p50"] <= r["stages_s"]["total"]["p99"]


async def test_pods_waiting_for_a_host_back_off(tmp_path: Path) -> None:
    """`python -m services.testbed.bench.waiting`: pods whose node never comes are checked at 2 s and
    6 s after admission within 10 s (the backoff doubles), not every 2 s (five checks)."""
    from services.testbed.bench.waiting import run_waiting

    r = await run_waiting(20, 10.0, str(tmp_path))
    (mark,) = r["entries_every_10s"]  # type: ignore[misc]
    checks = (mark - r["entries_when_admitted"]) / 20  # type: ignore[operator]
    assert 1 <= checks <= 3, r
    assert r["reconciler_cpu_s"] > 0


async def test_writes_that_waited_for_the_api_server_go_when_it_answers(tmp_path: Path) -> None:
    """`python -m services.testbed.bench.waiting PODS SECONDS recovers`: the API server does not
    answer for 10 s, then does; the pods' status writes that waited for it are fired at once
    (counted), not left to their backoff, and every pod's status is written."""
    from services.testbed.bench.waiting import run_waiting

    r = await run_waiting(20, 10.0, str(tmp_path), writes_fail=True, recovers=True)
    assert r["recovered_s"] is not None, r
    # (most: a pod whose rewrite is being written at that instant, unanswered, arms its next after)
    assert r["rewrites_early"] >= 10, r  # type: ignore[operator]
    assert r["kubernetes_writes"]["status"] > 20, r  # type: ignore[index]
