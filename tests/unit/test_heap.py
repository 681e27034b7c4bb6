"""A service settles its heap once imported: the collector's thresholds, the frozen import-time
heap, and its pauses counted (in a child interpreter: settling the test process would change the
collector under every other test)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from shared import heap

PROBE = """
import gc, json
from prometheus_client import REGISTRY
from shared import heap

def main(argv):
    state = {"threshold": gc.get_threshold(), "frozen": gc.get_freeze_count(), "callbacks": len(gc.callbacks)}
    cycle = []
    cycle.append(cycle)
    del cycle
    gc.collect(0)
    state["paused"] = sum(REGISTRY.get_sample_value("vmfence_gc_pause_seconds_total", {"generation": str(g)}) or 0.0
                          for g in range(3))
    heap.settle()  # a second time changes nothing
    state["callbacks_after"] = len(gc.callbacks)
    print(json.dumps(state))
    return 0
"""


def test_a_service_entry_point_freezes_its_imports_collects_young_objects_less_often_and_counts_pauses(
    tmp_path: Path,
) -> None:
    (tmp_path / "probe_service.py").write_text(PROBE)
    child = (f"import sys; sys.path.insert(0, {str(tmp_path)!r}); import gc; assert gc.get_freeze_count() == 0; "
             "from services.cli import main as m; sys.exit(m._service_main('probe_service')([]))")
    out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, check=True, timeout=60)
    got = json.loads(out.stdout)
    assert got["threshold"] == [heap.YOUNG, heap.MIDDLE, heap.OLD]
    assert heap.YOUNG > 700  # CPython's default young threshold
    assert got["frozen"] > 10_000  # what the service imported: modules, classes, constants
    assert got["paused"] > 0  # the collection after settling was timed
    assert got["callbacks"] == 1 and got["callbacks_after"] == 1  # counted once, however often settled
