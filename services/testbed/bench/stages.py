"""Where a pod's time to Bound goes, stage by stage, at an offered load (issue 14's latency).

``python -m services.testbed.bench.stages RATE SECONDS [PODS_BEFORE]`` starts the fleet of
``bench/fleet.py`` (one process per component), optionally runs ``PODS_BEFORE`` pods through it
first, then creates RATE pods/s for SECONDS and prints JSON: the percentiles of each stage between
the pod's create and the log entry that binds its VM. The watcher's observations, the agents'
results and the reconcilers' commands are timed as the harness sees them on a NATS subscription
(which costs the harness a little CPU); log entries by the time the server stored them.
"""

from __future__ import annotations

import itertools
import json
import os
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from services.testbed.bench.fleet import FleetBench
from services.testbed.bench.suite import NS, SIZES, log_last_seq, pct, r4
from shared.bus.logstream import read_log
from shared.fence.schema import Admitted, Bound, Commanded, CommandResult, Observed, decode_command, decode_input

STAGES = (
    "created_to_observed",  # API server and watcher: the watch event, published
    "observed_to_admitted",  # reconciler: fetch, consistent read, append
    "admitted_to_commanded",  # reconciler: binding, its completion, append (the create commanded)
    "commanded_to_sent",  # reconciler: the command published after its entry
    "sent_to_result",  # agent: fetch, create, ledger, probe, result published
    "result_to_bound",  # reconciler: fetch, append of the binding entry
    "total",
)
SLOWEST = 30


def _first(seen: list[tuple[float, bytes]], decode: Callable[[bytes], Any],
           key_of: Callable[[Any], str | None]) -> dict[str, float]:
    """Key -> when its first message that ``key_of`` names a key for was seen."""
    out: dict[str, float] = {}
    for at, data in seen:
        try:
            key = key_of(decode(data))
        except Exception:  # any other message on the subject: not ours to time
            continue
        if key is not None:
            out.setdefault(key, at)
    return out


async def run_stages(rate: int, seconds: float, before: int, tmp: str) -> dict[str, Any]:
    size = SIZES["smoke"]
    async with FleetBench(size, tmp) as fleet:
        assert fleet.tracker is not None
        if before:
            await fleet.pods(before, tag="before")
        js, subjects = fleet.bus.js, fleet.subjects
        start_seq = await log_last_seq(js, subjects) + 1
        seen_in: list[tuple[float, bytes]] = []
        seen_cmd: list[tuple[float, bytes]] = []

        async def on_in(m: Any) -> None:
            seen_in.append((time.time(), m.data))

        async def on_cmd(m: Any) -> None:
            seen_cmd.append((time.time(), m.data))

        subs = [await fleet.bus.nc.subscribe(f"{subjects.prefix}.in.>", cb=on_in),
                await fleet.bus.nc.subscribe(f"{subjects.prefix}.cmd.>", cb=on_cmd)]
        n = max(1, int(rate * seconds))
        names = [f"stage{rate}-{i}" for i in range(n)]
        created, _ = await fleet.offer(names, rate)
        for sub in subs:
            await sub.unsubscribe()
        observed = _first(seen_in, decode_input, lambda i: i.key if isinstance(i, Observed) else None)
        results = _first(seen_in, decode_input,
                         lambda i: i.fence.key if isinstance(i, CommandResult) and i.op == "create" else None)
        sent = _first(seen_cmd, decode_command, lambda c: c.fence.key if c.op == "create" else None)
        entries: dict[str, dict[str, float]] = defaultdict(dict)
        async for rec in read_log(js, subjects, start_seq=start_seq):
            marks = entries[rec.entry.key]
            for d in rec.entry.decisions:
                if isinstance(d, Admitted):
                    marks.setdefault("admitted", rec.ts)
                elif isinstance(d, Commanded) and d.command.op == "create":
                    marks.setdefault("commanded", rec.ts)
                elif isinstance(d, Bound):
                    marks.setdefault("bound", rec.ts)
        stages: dict[str, list[float]] = {s: [] for s in STAGES}
        slow: list[dict[str, Any]] = []
        first = min(created.values())
        for name in names:
            key = f"{NS}/{name}"
            m = entries.get(key, {})
            times = (created[name], observed.get(key), m.get("admitted"), m.get("commanded"), sent.get(key),
                     results.get(key), m.get("bound"))
            if any(t is None for t in times):
                continue
            ts: list[float] = [t for t in times if t is not None]
            took = {stage: b - a for stage, (a, b) in zip(STAGES, itertools.pairwise(ts), strict=False)}
            took["total"] = ts[-1] - ts[0]
            for stage, seconds in took.items():
                stages[stage].append(seconds)
            slow.append({"created_at_s": r4(ts[0] - first), **{stage: r4(v) for stage, v in took.items()}})
    slow.sort(key=lambda row: -row["total"])
    return {
        "offered_per_s": rate, "offered_for_s": seconds, "pods": n, "pods_before": before,
        "timed": len(stages["total"]),
        "stages_s": {s: {"p50": r4(pct(v, 50)), "p90": r4(pct(v, 90)), "p99": r4(pct(v, 99))}
                     for s, v in stages.items()},
        # when in the run the slowest pods were created, and their stages: a tail that comes in
        # bursts at a period is periodic work (snapshots, images, sweeps), not the load
        "slowest": slow[:SLOWEST],
    }  # fmt: skip


def main() -> None:  # pragma: no cover - manual: python -m services.testbed.bench.stages 200 5 [pods before]
    from shared.tasks import interruptible, run_main

    rate = int(sys.argv[1]) if len(sys.argv) > 1 else 200
    seconds = float(sys.argv[2]) if len(sys.argv) > 2 else 5.0
    before = int(sys.argv[3]) if len(sys.argv) > 3 else 0
    tmp = os.environ.get("TMPDIR", "/tmp") + f"/vmfence-stages-{os.getpid()}"
    print(json.dumps(run_main(interruptible(run_stages(rate, seconds, before, tmp))), indent=2))


if __name__ == "__main__":
    main()
