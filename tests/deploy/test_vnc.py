"""Issue 10, finding 9: the VNC range compose and Helm pass is what the agent expects.

The agent's setting is ``VMFENCE_VNC_PORTS`` — TCP ports, as a port mapping or a firewall names them
(display = port - 5900). The deployments once passed ``VMFENCE_VNC_RANGE=5900-5919``, read as
display numbers: the VMs' displays landed on ports 11800-11819 while compose published 5900-5919.
These tests read the values each deployment really passes through the agent's own configuration
parser and check the ports it will listen on are the ports the deployment publishes.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from services.agent.config import AgentConfig, ConfigError
from shared.config import load

from .conftest import CHART, REPO, find_tool

BASE_PORT = 5900
HELM = find_tool("helm")


def agent_ports(env: dict[str, str], tmp_path: Path) -> tuple[set[int], str]:
    """The TCP ports and the address the agent's VNC displays take with ``env``, as it parses it."""
    cfg = load(AgentConfig, [], {**env, "VMFENCE_DATA_DIR": str(tmp_path / "agent")})
    assert cfg.vnc_range is not None
    return {BASE_PORT + d for d in cfg.vnc_range}, cfg.vnc_listen


def _span(text: str) -> set[int]:
    m = re.fullmatch(r"(\d+)-(\d+)", text)
    assert m, text
    return set(range(int(m.group(1)), int(m.group(2)) + 1))


def test_compose_publishes_the_ports_the_qemu_agent_listens_on(tmp_path: Path) -> None:
    compose: dict[str, Any] = yaml.safe_load((REPO / "compose.yaml").read_text())
    svc = compose["services"]["agent-host-c"]
    env = {k: str(v) for k, v in svc["environment"].items() if k.startswith("VMFENCE_VNC")}
    assert "VMFENCE_VNC_RANGE" not in env
    ports, listen = agent_ports(env, tmp_path)
    published: set[int] = set()
    for mapping in svc["ports"]:
        host_ip, host_ports, container_ports = str(mapping).split(":")
        assert host_ip == "127.0.0.1", "VNC is published on the host's loopback only"
        assert host_ports == container_ports
        published |= _span(container_ports)
    assert ports == published, f"agent listens on {min(ports)}-{max(ports)}, compose publishes {sorted(published)}"
    # a published container port reaches the container's address, not its loopback: the agent listens
    # there, and every display has its own password
    assert listen == "0.0.0.0"


@pytest.mark.skipif(HELM is None, reason="helm binary not installed (scripts/bootstrap.sh fetches it)")
@pytest.mark.parametrize(
    ("sets", "want_ports", "want_listen"),
    [
        ([], set(range(5910, 6010)), "127.0.0.1"),
        (["--set", "agent.vncPorts=5900-5903", "--set", "agent.vncListen=0.0.0.0"], set(range(5900, 5904)), "0.0.0.0"),
    ],
)
def test_helm_passes_ports_the_agent_reads_as_ports(
    tmp_path: Path, sets: list[str], want_ports: set[int], want_listen: str
) -> None:
    assert HELM is not None
    res = subprocess.run([HELM, "template", "vmf", str(CHART), *sets], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    (ds,) = [d for d in yaml.safe_load_all(res.stdout) if d and d["kind"] == "DaemonSet"
             and d["metadata"]["name"].endswith("agent")]
    (c,) = ds["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e["value"] for e in c["env"] if e["name"].startswith("VMFENCE_VNC")}
    assert set(env) == {"VMFENCE_VNC_PORTS", "VMFENCE_VNC_LISTEN"}
    assert agent_ports(env, tmp_path) == (want_ports, want_listen)


@pytest.mark.parametrize("displays", ["10-109", "0-19"])
def test_display_numbers_where_ports_are_asked_are_refused(tmp_path: Path, displays: str) -> None:
    with pytest.raises(ConfigError, match="VNC ports"):
        agent_ports({"VMFENCE_VNC_PORTS": displays}, tmp_path)


def test_the_old_variable_is_refused_not_ignored(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VMFENCE_VNC_RANGE", "5900-5919")
    with pytest.raises(ConfigError, match="VMFENCE_VNC_RANGE is not read any more"):
        agent_ports({"VMFENCE_VNC_PORTS": "5900-5919"}, tmp_path)


def test_no_deploy_file_passes_the_old_variable() -> None:
    files = [REPO / "compose.yaml", *(p for p in (REPO / "deploy").rglob("*") if p.is_file())]
    offenders = [str(p.relative_to(REPO)) for p in files if p.suffix in (".yaml", ".yml", ".tpl", ".env", "")
                 and "VMFENCE_VNC_RANGE" in p.read_text(errors="replace")]
    assert offenders == []
    assert len(files) > 5  # the scan ran over real files (a path typo would pass it)
