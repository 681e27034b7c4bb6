"""compose.yaml is a valid Compose file and wires the stack the way docs/operations.md says."""

from __future__ import annotations

import ipaddress
import json
import os
import re
import subprocess
from typing import Any

import jsonschema
import pytest
import yaml

from .conftest import NATS_DIR, REPO, find_tool

SCHEMA = json.loads((REPO / "tests" / "deploy" / "compose-spec.json").read_text())
_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}")


def interpolate(node: Any, env: dict[str, str]) -> Any:
    """Compose-style ${VAR}, ${VAR:-default}, ${VAR-default} interpolation (enough for our file)."""
    if isinstance(node, dict):
        return {k: interpolate(v, env) for k, v in node.items()}
    if isinstance(node, list):
        return [interpolate(v, env) for v in node]
    if isinstance(node, str):

        def sub(m: re.Match[str]) -> str:
            name, op, arg = m.group(1), m.group(2), m.group(3)
            val = env.get(name)
            if (op == ":-" and not val) or (op == "-" and val is None):
                return arg
            if op in (":?", "?") and not val:
                raise KeyError(f"{name}: {arg}")
            return val or ""

        return _VAR.sub(sub, node)
    return node


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    raw = yaml.safe_load((REPO / "compose.yaml").read_text())
    assert isinstance(raw, dict)
    return raw


def _env(svc: dict[str, Any]) -> dict[str, str]:
    env = svc.get("environment", {})
    if isinstance(env, list):
        env = dict(e.split("=", 1) for e in env)
    return {k: str(v) for k, v in env.items()}


def test_validates_against_compose_spec(compose: dict[str, Any]) -> None:
    validator = jsonschema.Draft7Validator(SCHEMA)
    errors = sorted(validator.iter_errors(compose), key=lambda e: list(e.absolute_path))
    assert not errors, "\n".join(f"{list(e.absolute_path)}: {e.message}" for e in errors)
    # and after interpolation with the defaults, as docker compose validates it
    resolved = interpolate(compose, {})
    errors = sorted(validator.iter_errors(resolved), key=lambda e: list(e.absolute_path))
    assert not errors, "\n".join(f"{list(e.absolute_path)}: {e.message}" for e in errors)


def test_schema_rejects_a_broken_file(compose: dict[str, Any]) -> None:
    """The vendored schema is real: a misspelt key fails."""
    broken = json.loads(json.dumps(compose))
    broken["services"]["watcher"]["enviroment"] = {"X": "1"}
    assert list(jsonschema.Draft7Validator(SCHEMA).iter_errors(broken))


def _compose_cli() -> list[str] | None:
    pc = find_tool("podman-compose")  # the pinned one of the dev extras: what `make images` users run
    if pc:
        return [pc]
    dc = find_tool("docker-compose")
    if dc:
        return [dc]
    docker = find_tool("docker")
    if docker:
        probe = subprocess.run([docker, "compose", "version"], capture_output=True, timeout=30)
        if probe.returncode == 0:
            return [docker, "compose"]
    return None


def test_compose_cli_accepts_it() -> None:
    """A second opinion from a real Compose implementation (`config` starts nothing)."""
    cmd = _compose_cli()
    if cmd is None:
        pytest.skip("no compose CLI installed (podman-compose is in the dev extras)")
    quiet = [] if "podman-compose" in cmd[0] else ["-q"]
    res = subprocess.run(
        [*cmd, "-f", str(REPO / "compose.yaml"), "-f", str(REPO / "deploy" / "compose" / "kvm.yaml"),
         "--profile", "dev", "config", *quiet],
        capture_output=True,
        text=True,
        timeout=60,
        env={k: v for k, v in os.environ.items() if not k.startswith("VMFENCE_")},
    )
    assert res.returncode == 0, res.stderr
    if not quiet:
        resolved = yaml.safe_load(res.stdout)
        assert {f"agent-host-{h}" for h in "abc"} <= set(resolved["services"])
        assert resolved["services"]["agent-host-b"]["environment"]["VMFENCE_ACCEL"] == "kvm", "kvm.yaml merges"


def test_three_node_jetstream_cluster(compose: dict[str, Any]) -> None:
    services = compose["services"]
    for n in (1, 2, 3):
        svc = services[f"nats-{n}"]
        stores = [v for v in svc["volumes"] if str(v).endswith(":/data/jetstream")]
        assert stores, "a JetStream store volume each"
        assert f"nats-{n}-data" in compose["volumes"]
        assert "healthcheck" in svc
        assert (NATS_DIR / f"nats-{n}.conf").is_file()


def test_services_and_profiles(compose: dict[str, Any]) -> None:
    services = interpolate(compose["services"], {})
    vmfence = {n: s for n, s in services.items() if not n.startswith("nats-")}
    assert set(vmfence) == {
        "apiserver",
        "watcher",
        "reconciler-1",
        "reconciler-2",
        "agent-host-a",
        "agent-host-b",
        "agent-host-c",
    }
    assert vmfence["apiserver"]["profiles"] == ["dev"]
    for name in ("watcher", "reconciler-1", "reconciler-2", "agent-host-a", "agent-host-b", "agent-host-c"):
        assert "profiles" not in vmfence[name], f"{name} runs by default"

    for name, svc in vmfence.items():
        assert svc["command"][0] in {"watcher", "reconciler", "agent", "apiserver"}, name
        hc = " ".join(svc["healthcheck"]["test"])
        assert "/readyz" in hc, f"{name}: healthcheck on /readyz"
        if name != "apiserver":
            env = _env(svc)
            assert env["VMFENCE_NATS_URL"].count("nats://") == 3, "all three NATS nodes"
            assert env["VMFENCE_HTTP_PORT"] == "9180" and ":9180/readyz" in hc
            for n in (1, 2, 3):
                assert svc["depends_on"][f"nats-{n}"]["condition"] == "service_healthy"

    ids = {_env(vmfence[r])["VMFENCE_ID"] for r in ("reconciler-1", "reconciler-2")}
    assert len(ids) == 2, "two reconcilers with distinct ids"
    for r in ("reconciler-1", "reconciler-2"):
        assert _env(vmfence[r])["VMFENCE_DATA_DIR"]


def test_three_qemu_hosts(compose: dict[str, Any]) -> None:
    """Three agents, each a QEMU host of its own: distinct host names, volumes and VNC ports, TCG
    unless told otherwise, the guest images mounted read-only."""
    services = interpolate(compose["services"], {})
    agents = {n: s for n, s in services.items() if s.get("command", [None])[0] == "agent"}
    assert sorted(agents) == ["agent-host-a", "agent-host-b", "agent-host-c"]
    vnc: list[set[int]] = []
    for name, svc in agents.items():
        env = _env(svc)
        assert env["VMFENCE_RUNTIME"] == "qemu", name
        assert env["VMFENCE_ACCEL"] == "tcg", f"{name}: KVM only through deploy/compose/kvm.yaml"
        assert env["VMFENCE_HOST"] == name.removeprefix("agent-") == svc["hostname"]
        assert any(str(v).endswith(":/var/lib/vmfence/images/guest:ro") for v in svc["volumes"]), name
        first, last = map(int, env["VMFENCE_VNC_PORTS"].split("-"))
        vnc.append(set(range(first, last + 1)))
        assert "devices" not in svc, f"{name}: no /dev/kvm in the shipped file"
    assert not (vnc[0] & vnc[1]) and not (vnc[0] & vnc[2]) and not (vnc[1] & vnc[2]), "VNC ranges overlap"
    cidrs = [ipaddress.ip_network(_env(s)["VMFENCE_POD_CIDR"]) for s in agents.values()]
    assert not any(a.overlaps(b) for i, a in enumerate(cidrs) for b in cidrs[i + 1 :]), "pod pools overlap"
    assert {_env(s)["VMFENCE_NETWORK"] for s in agents.values()} == {"user"}, "unprivileged agents: user networking"
    vols = [v.split(":")[0] for s in agents.values() for v in s["volumes"] if not str(v).startswith(("$", "."))]
    assert len(vols) == len(set(vols)) == 6, "a ledger and a snapshot volume per host"

    kvm = yaml.safe_load((REPO / "deploy" / "compose" / "kvm.yaml").read_text())
    assert sorted(kvm["services"]) == sorted(agents)
    for svc in kvm["services"].values():
        assert svc["environment"]["VMFENCE_ACCEL"] == "kvm"
        assert any(str(d).startswith("/dev/kvm") for d in svc["devices"])


def test_partitionable_networks(compose: dict[str, Any]) -> None:
    """Routes between the NATS servers on a network of their own (a NATS node can be cut off from
    its peers and still serve clients); the dev API server off the bus network."""
    services = compose["services"]
    for n in (1, 2, 3):
        nets = services[f"nats-{n}"]["networks"]
        assert set(nets) == {"bus", "routes"}
        assert nets["routes"]["aliases"] == [f"nats-{n}-route"]
        conf = (NATS_DIR / f"nats-{n}.conf").read_text()
        assert f"advertise: nats-{n}-route:6222" in conf
        assert set(re.findall(r"nats-route://([\w-]+):6222", conf)) == {"nats-1-route", "nats-2-route", "nats-3-route"}
    for name, svc in services.items():
        if name.startswith("nats-"):
            continue
        nets = set(svc.get("networks") or compose["x-vmfence"]["networks"])
        assert "routes" not in nets, name
        assert ("kube" in nets) == (name in {"apiserver", "watcher", "reconciler-1", "reconciler-2"}), name
        assert ("bus" in nets) == (name != "apiserver"), name


def test_agents_hold_no_kubernetes_credentials(compose: dict[str, Any]) -> None:
    for name, svc in compose["services"].items():
        if svc.get("command", [None])[0] != "agent":
            continue
        env = _env(svc)
        assert not any("KUBE" in k for k in env), name
        assert "configs" not in svc, name
        assert not any("kube" in str(v) for v in svc.get("volumes", [])), name
        host = env["VMFENCE_HOST"]
        assert env["VMFENCE_NATS_USER"] == f"agent-{host}", "each agent logs in as its own host's user"
        assert env["VMFENCE_DATA_DIR"] and env["VMFENCE_SNAPSHOT_DIR"]


def test_each_service_uses_its_own_nats_user(compose: dict[str, Any]) -> None:
    """The user and password a service sends are the ones the NATS servers configure for it."""
    accounts = (NATS_DIR / "accounts.conf").read_text()
    configured = dict(re.findall(r"\{\s*user:\s*([\w-]+),\s*password:\s*\$(\w+)", accounts))
    nats_env = compose["x-nats"]["environment"]
    expected_user = {"watcher": "watcher", "reconciler": "reconciler", "agent": None}
    for name, svc in compose["services"].items():
        if name.startswith("nats-") or name == "apiserver":
            continue
        env = _env(svc)
        user = env["VMFENCE_NATS_USER"]
        role = svc["command"][0]
        if expected_user[role]:
            assert user == expected_user[role], name
        assert user in configured, f"{name}: NATS user {user} not in accounts.conf"
        var = configured[user]
        # same variable, same dev default on both sides
        assert env["VMFENCE_NATS_PASSWORD"] == nats_env[var], name
    for var in configured.values():
        assert var in nats_env, f"the NATS servers must receive {var}"
        assert re.fullmatch(r"\$\{" + var + r":-dev-[\w-]+\}", nats_env[var]), "dev-only default, overridable"
