"""`vmfence chaos --hostile` at smoke size, as a user runs it: two seeds of hostile messages from
every NATS identity and hostile pods against a real local stack (per-service NATS users), judged by
the command's own JSON — nothing wedged or crashed, no VM made or removed by a message, permissions
refused what identities may not send, the bad inputs were dead-lettered or skipped, no drift, a
clean audit."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_two_hostile_seeds_leave_every_other_key_live(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "services.cli", "chaos", "--hostile", "--seeds", "2", "--first", "100",
         "--dir", str(tmp_path / "run"), "--quiet"],
        capture_output=True, text=True, cwd=ROOT, timeout=300,
    )
    assert out.stdout, out.stderr[-3000:]
    result = json.loads(out.stdout)
    assert out.returncode == 0 and result["ok"], json.dumps(result, indent=1)[:4000]
    assert result["seeds"] == 2 and result["wedged_keys"] == 0 and result["crashes"] == 0
    assert result["vm_changes"] == [] and result["drift"] == [] and result["violations"] == []
    assert result["probes"] == 6 and result["hostile_pods"] > 0
    assert result["refused_by_permissions"] > 0  # forged commands and log entries never reached a stream
    assert result["dead_lettered"] > 0  # undecodable inputs were parked with a reason
    # valid-schema lies that agents sent with their own credentials on their own subjects reached the
    # fence and were logged as skips: about another host's VM, a fence far above the log's, and work
    # for a command never sent or an old uid
    assert {"wrong_host", "epoch_out_of_bounds", "stale_effect"} <= set(result["skipped"]), result["skipped"]
    kinds = set(result["messages"])
    assert {"garbage", "future_epoch", "wrong_host", "wrong_key", "unknown_version", "oversized"} <= kinds
    assert {i for by in result["messages"].values() for i in by} >= {"watcher", "agent-host-a", "agent-host-b",
                                                                      "audit"}
