"""compose.yaml run for real: `make images`, the stack up in podman containers, one agent cut off
from NATS and one NATS node killed while pods churn, quiescence, the audit, down.

This is the smoke size of `vmfence chaos --compose` (services/testbed/chaos/compose.py); the
10-minute run is in docs/chaos-compose-10min.json. It needs root, podman and runc (scripts/bootstrap.sh
installs them from apt): on this machine kind a missing piece is a failure, not a skip. About four
minutes: `make images` when warm ~15 s, the stack healthy ~1.5 min, 45 s of churn and faults, down.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from typing import Any

import pytest

from .conftest import DOCS, REPO

PROJECT = "vmfence-chaos"
TEN_MINUTES = DOCS / "chaos-compose-10min.json"  # the full run; the faults the smoke run does not make ran there
PODMAN_ENV = dict(os.environ, CONTAINERS_CONF=str(REPO / ".venv" / "podman" / "containers.conf"))
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def _images() -> dict[str, str]:
    """`make images` prints the image names as `export NAME=value` lines."""
    res = subprocess.run(["make", "-s", "images"], cwd=REPO, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, f"make images failed:\n{res.stderr[-3000:]}"
    names = dict(line.removeprefix("export ").split("=", 1) for line in res.stdout.splitlines()
                 if line.startswith("export VMFENCE_"))
    assert {"VMFENCE_IMAGE", "VMFENCE_NATS_IMAGE", "VMFENCE_BASE_IMAGE"} <= set(names), res.stdout
    return names


def _image_id(name: str) -> str:
    res = subprocess.run(["podman", "image", "inspect", "--format", "{{.Id}}", name], env=PODMAN_ENV,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    return res.stdout.strip()


def _project_objects() -> dict[str, list[str]]:
    """The project's containers, volumes and networks that podman still has."""
    out: dict[str, list[str]] = {}
    for what, argv in (("containers", ["ps", "-a", "--format", "{{.Names}}"]),
                       ("volumes", ["volume", "ls", "--format", "{{.Name}}"]),
                       ("networks", ["network", "ls", "--format", "{{.Name}}"])):
        res = subprocess.run(["podman", *argv], env=PODMAN_ENV, capture_output=True, text=True, timeout=60)
        assert res.returncode == 0, res.stderr
        out[what] = [n for n in res.stdout.split() if n.startswith(PROJECT + "_")]
    return out


def documented_commands() -> list[str]:
    """The command lines of docs/operations.md's "Three hosts with compose" (fenced sh blocks)."""
    text = (DOCS / "operations.md").read_text()
    section = text[text.index("### Three hosts with compose"):]
    section = section[: re.search(r"^##", section[4:], re.M).start() + 4]  # type: ignore[union-attr]
    lines = [ln.strip() for block in re.findall(r"```sh\n(.*?)```", section, re.S) for ln in block.splitlines()]
    return [ln for ln in lines if ln and not ln.startswith("#")]


def matches(documented: str, ran: str) -> bool:
    """``<...>`` in a documented command stands for one word (or the part of one) of the run's."""
    pattern = "".join(r"\S+?" if part.startswith("<") else re.escape(part)
                      for part in re.split(r"(<[^>]+>)", documented))
    return re.fullmatch(pattern, ran) is not None


@pytest.fixture(scope="module")
def images() -> dict[str, str]:
    assert os.geteuid() == 0, "the compose stack runs rootful podman (network namespaces, the /proc oracle)"
    assert shutil.which("make"), "make"
    return _images()


def test_make_images_is_idempotent(images: dict[str, str]) -> None:
    """A second `make images` reuses the base and the layer cache: seconds, the same base and NATS image."""
    before = {k: _image_id(v) for k, v in images.items() if k != "VMFENCE_IMAGE"}
    t0 = time.monotonic()
    again = _images()
    took = time.monotonic() - t0
    assert again == images
    assert {k: _image_id(v) for k, v in again.items() if k != "VMFENCE_IMAGE"} == before
    # ~11 s on an idle 2-core machine; the bound leaves room for a loaded one (the base and NATS
    # image ids above are what proves nothing was rebuilt from scratch)
    assert took < 240, f"a warm make images took {took:.0f}s"
    # the vmfence image runs: its console script answers, as the non-root user the Dockerfile names
    res = subprocess.run(["podman", "run", "--rm", images["VMFENCE_IMAGE"], "--help"], env=PODMAN_ENV,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and "agent" in res.stdout, res.stdout + res.stderr
    res = subprocess.run(["podman", "run", "--rm", "--entrypoint", "id", images["VMFENCE_IMAGE"], "-u"],
                         env=PODMAN_ENV, capture_output=True, text=True, timeout=120)
    assert res.stdout.strip() == "10001", res.stdout + res.stderr


def test_compose_stack_survives_a_partition_and_a_nats_kill(images: dict[str, str]) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VMFENCE_")} | {
        "VMFENCE_IMAGE": images["VMFENCE_IMAGE"], "VMFENCE_NATS_IMAGE": images["VMFENCE_NATS_IMAGE"]}
    res = subprocess.run(
        [sys.executable, "-m", "services.cli", "chaos", "--compose", "--minutes", "0.5", "--rng-seed", "7",
         "--plan", "partition:agent,kill:nats", "--churn-every", "1", "--settle-timeout", "150", "--quiet",
         "--json"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=840,
    )
    assert res.stdout.strip(), f"no verdict (exit {res.returncode}):\n{res.stderr[-3000:]}"
    result: dict[str, Any] = json.loads(res.stdout.strip().splitlines()[-1])
    summary = json.dumps({k: v for k, v in result.items() if k not in ("events", "ops")}, indent=1)[:6000]
    # the faults the plan names happened, to real containers
    assert result["containers"] == 10, summary
    assert result["partitions"] == {"agent-from-nats": 1}, summary
    assert result["kills"] == {"nats": 1}, summary
    assert result["restart_timeouts"] == [] and result["notes"] == [], summary
    # the workload ran and VMs really existed (the oracle saw QEMU processes in the agents' containers)
    assert result["pods_churned"] >= 10 and result["vms_created"] >= 3, summary
    assert result["oracle_samples"] > 50, summary
    # the verdict
    assert result["quiesced"], summary
    # never two VMs for one incarnation; never two for one key but where all but one belong to
    # incarnations the churn force-deleted (grace 0: the successor may start while the old host is
    # not live, issue 11) — those are counted apart, in overlaps_after_force_delete
    assert result["max_vms_per_incarnation"] == 1 and result["max_vms_per_key"] <= 1, summary
    assert result["leaked_vms"] == 0 and result["pods_without_vm"] == [], summary
    assert result["lost_inputs"] == 0, summary
    assert result["violations"] == [], summary
    assert result["audit_cli"]["replay"]["exit"] == 0 and result["audit_cli"]["replay"]["clean"], summary
    assert result["audit_cli"]["verify"]["exit"] == 0, summary
    assert result["ok"] and res.returncode == 0, summary
    # the operator's section shows what ran: each of its commands is one of the run's
    ran = [*result["commands"], "make images", *json.loads(TEN_MINUTES.read_text())["commands"]]
    unmatched = [c for c in documented_commands() if not any(matches(c, r) for r in ran)]
    assert len(documented_commands()) >= 10 and unmatched == [], (unmatched, ran)
    # down took everything with it
    assert result["compose_down_rc"] == 0 and result["containers_left"] == 0, summary
    assert _project_objects() == {"containers": [], "volumes": [], "networks": []}
