"""`vmfence chaos --compose`: the shipped compose.yaml in containers on this machine, broken on purpose.

The stack is ``compose.yaml`` as users get it (the ``dev`` profile: three NATS servers in one
JetStream cluster, the development API server, the watcher, two reconcilers, three QEMU agents),
started by a real Compose implementation (``podman-compose``, pinned in the dev extras) on podman
with runc. Each service is a container with its own network namespace; the images come from
``make images``. The run adds only an override file (the servers on the run's own loopback ports,
no VNC ports: other stacks on this machine keep theirs) and an ``.env`` with fresh passwords.

While pods churn through the API server (the process campaign's workload,
:meth:`ProcessChaos.churn`), faults follow a schedule the seed fixes, one at a time:

- ``kill``: ``podman kill`` (SIGKILL) of any container — an agent (its VMs die with it, like a
  host's), a reconciler, the watcher, the API server or a NATS node — then ``podman start``;
- ``partition``: ``podman network disconnect``/``connect`` — an agent cut off from NATS (network
  ``bus``), a NATS node cut off from its peers (network ``routes``; it still serves its clients),
  or a reconciler that holds leases cut off from NATS (it keeps the API server): its leases must
  expire and the other reconciler take them over;
- ``pause``: ``podman pause`` (the cgroup freezer, SIGSTOP-like) of a lease-holding reconciler or
  an agent for longer than a lease, then ``podman unpause`` — the paused old owner.

The oracle is outside vmfence: the host's ``/proc`` (every ``qemu-system-*`` process whose cgroup
is one of the project's agent containers, its VM's key and incarnation read from the spec file the
agent wrote, through ``/proc/<pid>/root``), the API server's pods, and the decision log, which
``vmfence replay`` and ``vmfence verify`` (run as the ``audit`` identity) must find clean.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import secrets
import shutil
import signal
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import msgspec
import yaml

from services.testbed.chaos.oracles import NS, Oracle, SeenVM, incarnation_of, lost_inputs, proc_alive
from services.testbed.chaos.processes import ProcessChaos
from services.testbed.natsserver import free_port
from shared.tasks import cancel_and_wait

ROOT = Path(__file__).resolve().parents[3]  # the repository
PROJECT = "vmfence-chaos"
HOSTS = ("host-a", "host-b", "host-c")
NATS_NODES = ("nats-1", "nats-2", "nats-3")
RECONCILERS = ("reconciler-1", "reconciler-2")
AGENTS = tuple(f"agent-{h}" for h in HOSTS)
SERVICES = (*NATS_NODES, "apiserver", "watcher", *RECONCILERS, *AGENTS)
PARTITIONS = 16  # compose.yaml's VMFENCE_PARTITIONS default
LEASE_TTL_S = 10.0  # the reconcilers' default --lease-ttl, which compose.yaml keeps
PODMAN_TIMEOUT_S = 60.0  # one podman command (kill, start, network connect, inspect)
COMPOSE_TIMEOUT_S = 300.0  # `podman-compose up` / `down` of the whole project
HEALTHY_TIMEOUT_S = 120.0  # a (re)started container passes its compose healthcheck
TAKEOVER_TIMEOUT_S = 3 * LEASE_TTL_S  # the other reconciler holds a cut-off owner's partitions
POLL_S = 0.5  # healthchecks and lease holders have no event to wait on: bounded polling
ORACLE_PERIOD_S = 0.2
FAULT_KINDS = ("kill", "partition", "pause")
TARGETS = ("agent", "nats", "reconciler", "watcher", "apiserver")
IMAGE_ENV = ("VMFENCE_IMAGE", "VMFENCE_NATS_IMAGE")
PASSWORD_VARS = {
    "watcher": "VMFENCE_NATS_WATCHER_PASSWORD",
    "reconciler": "VMFENCE_NATS_RECONCILER_PASSWORD",
    **{f"agent-{h}": f"VMFENCE_NATS_AGENT_{h.upper().replace('-', '_')}_PASSWORD" for h in HOSTS},
    "audit": "VMFENCE_NATS_AUDIT_PASSWORD",
    "operator": "VMFENCE_NATS_OPERATOR_PASSWORD",
    "admin": "VMFENCE_NATS_ADMIN_PASSWORD",
}


class ComposeError(RuntimeError):
    """podman or podman-compose failed; the message says which command and why."""


def kind_of(service: str) -> str:
    for k in ("agent", "nats", "reconciler"):
        if service.startswith(k):
            return k
    return service


def container(service: str, project: str = PROJECT) -> str:
    """podman-compose's container name for a service of the project."""
    return f"{project}_{service}_1"


def network(name: str, project: str = PROJECT) -> str:
    return f"{project}_{name}"


def podman_env() -> dict[str, str]:
    """podman as scripts/build-images.sh configures it (runc, no default ulimits)."""
    conf = ROOT / ".venv" / "podman" / "containers.conf"
    env = dict(os.environ)
    if conf.is_file():
        env["CONTAINERS_CONF"] = str(conf)
    return env


def compose_binary() -> str:
    here = Path(sys.executable).parent / "podman-compose"
    found = str(here) if here.is_file() else shutil.which("podman-compose")
    if not found:
        raise ComposeError("podman-compose not installed (pip install -e '.[dev]')")
    return found


async def run_cmd(argv: list[str], *, within_s: float = PODMAN_TIMEOUT_S, check: bool = True) -> tuple[int, str]:
    """One command, bounded; its return code and output (stdout + stderr). The output goes to a
    file, not a pipe: the conmon that `podman start`/`compose up` leave behind inherit it, and a
    pipe would never reach its end."""
    with tempfile.TemporaryFile() as out:
        proc = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.DEVNULL, stdout=out, stderr=asyncio.subprocess.STDOUT,
            env=podman_env(), cwd=ROOT,
        )
        try:
            await asyncio.wait_for(proc.wait(), within_s)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
            raise ComposeError(f"{' '.join(argv[:4])}: no answer within {within_s:.0f}s") from None
        out.seek(0)
        text = out.read().decode(errors="replace")
    rc = proc.returncode if proc.returncode is not None else -1
    if check and rc != 0:
        raise ComposeError(f"{' '.join(argv[:6])} exited {rc}: {text.strip()[-600:]}")
    return rc, text


# ----------------------------------------------------------------------------------- oracle


def container_ids(project: str = PROJECT) -> dict[str, str]:
    """Full container id -> service, for the project's agents (ids survive restarts)."""
    import subprocess

    out = subprocess.run(
        ["podman", "ps", "-a", "--no-trunc", "--filter", f"label=io.podman.compose.project={project}",
         "--format", "{{.ID}} {{.Names}}"],
        capture_output=True, text=True, timeout=PODMAN_TIMEOUT_S, env=podman_env(), check=True,
    ).stdout
    ids: dict[str, str] = {}
    for line in out.splitlines():
        cid, _, name = line.partition(" ")
        service = name.removeprefix(f"{project}_").rsplit("_", 1)[0]
        if service in AGENTS:
            ids[cid] = service
    return ids


def scan_containers(ids: dict[str, str]) -> list[SeenVM]:
    """Every live QEMU on this machine that runs in one of the agent containers ``ids`` (by the
    ``libpod-<id>`` of its cgroup), with its VM's key and incarnation from the agent's spec file."""
    out: list[SeenVM] = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid = int(entry)
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
            if not argv or b"qemu-system" not in os.path.basename(argv[0]):
                continue
            with open(f"/proc/{pid}/cgroup") as f:
                cgroup = f.read()
        except OSError:
            continue
        service = next((s for cid, s in ids.items() if f"libpod-{cid}" in cgroup), None)
        if service is None or not proc_alive(pid):
            continue
        try:
            pidfile = argv[argv.index(b"-pidfile") + 1].decode()
        except (ValueError, IndexError):
            continue  # the agent's accel probe: not a VM
        vm_dir = os.path.dirname(pidfile)
        labels: dict[str, str] = {}
        with contextlib.suppress(OSError, ValueError):
            with open(f"/proc/{pid}/root{vm_dir}/spec.json") as f:
                labels = dict((json.load(f).get("spec") or {}).get("labels") or {})
        key, uid8 = incarnation_of(os.path.basename(vm_dir), labels)
        out.append(SeenVM(os.path.basename(vm_dir), key, uid8, pid, service.removeprefix("agent-")))
    return out


class ContainerOracle(Oracle):
    """The process campaign's oracle (worst VM count per key and incarnation, a second scan to
    confirm an overlap) over the agent containers' QEMU processes."""

    def __init__(self, ids: dict[str, str], forced: set[tuple[str, str]] | None = None) -> None:
        super().__init__(ROOT, "qemu", forced)  # force-deleted incarnations' overlaps are counted apart
        self.ids = ids
        self.last: list[SeenVM] = []

    def scan(self) -> list[SeenVM]:
        self.last = scan_containers(self.ids)
        return self.last

    def sample(self) -> None:
        """The base sample; an overlap it records also names each VM's host."""
        before = len(self.worst)
        super().sample()
        if len(self.worst) > before:
            where = {vm.vm_id: vm.host for vm in self.last}
            self.worst[before:] = [f"{line} on {where}" for line in self.worst[before:]]


# ------------------------------------------------------------------------------- the campaign


@dataclass(frozen=True)
class Fault:
    kind: str  # kill | partition | pause
    target: str  # a service kind (TARGETS) or a service name


def parse_plan(text: str) -> list[Fault]:
    """``partition:agent,kill:nats``: these faults in this order, then none."""
    plan: list[Fault] = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        kind, _, target = item.partition(":")
        if kind not in FAULT_KINDS or (target not in TARGETS and target not in SERVICES):
            raise ValueError(f"--plan {item!r}: want KIND:TARGET, KIND one of {FAULT_KINDS}, "
                             f"TARGET one of {TARGETS} or a service name")
        if kind == "partition" and kind_of(target) not in ("agent", "nats", "reconciler"):
            raise ValueError(f"--plan {item!r}: partitions cut an agent, a NATS node or a reconciler")
        if kind == "pause" and kind_of(target) not in ("agent", "reconciler"):
            raise ValueError(f"--plan {item!r}: pauses stop an agent or a reconciler")
        plan.append(Fault(kind, target))
    return plan


# what the run changes on the agents: hosts sized for the churn (the churned pods ask for the
# default size, and more of them must fit than the machine has CPUs) and an inventory round every
# 15 s instead of 60 s, so that an orphan a fault left is collected within the settle time
AGENT_ENV = {"VMFENCE_CPUS": "32", "VMFENCE_MEMORY_MIB": "32768", "VMFENCE_INVENTORY_INTERVAL": "15"}


def override_text(ports: dict[str, int]) -> str:
    """The run's compose override: the other two NATS servers published on the run's own loopback
    ports (``ports``; nats-1's and the API server's come from compose.yaml's VMFENCE_*_HOST_PORT
    variables in the run's .env), no VNC ranges (`!reset`), AGENT_ENV on the agents. The harness
    and the audit reach the servers there: a restarted container gets a new address on podman's
    bridges, and a published port follows it."""
    lines = ["# written by vmfence chaos --compose: the run's own loopback ports; hosts sized for the churn",
             "services:"]
    for s in NATS_NODES[1:]:
        lines += [f"  {s}:", "    ports:", f'      - "127.0.0.1:{ports[s]}:4222"']
    for s in AGENTS:
        lines += [f"  {s}:", "    ports: !reset []", "    environment:",
                  *(f'      {k}: "{v}"' for k, v in AGENT_ENV.items())]
    return "\n".join(lines) + "\n"


PUBLISHED_PORTS = range(21000, 30000)


def free_ports(n: int) -> list[int]:
    """n loopback ports free now, outside the ephemeral range that other stacks' port-0 binds use
    and apart from the ports ``free_port`` hands out (a published port is forwarded by the firewall:
    it must never be a port someone binds later)."""
    return [free_port(PUBLISHED_PORTS) for _ in range(n)]


@dataclass
class ComposeChaos(ProcessChaos):
    """The process campaign's workload and quiescence over the compose stack's containers."""

    partitions: Counter[str] = field(default_factory=Counter, init=False)
    pauses: Counter[str] = field(default_factory=Counter, init=False)
    events: list[str] = field(default_factory=list, init=False)
    violations: list[str] = field(default_factory=list, init=False)
    takeovers: list[float] = field(default_factory=list, init=False)
    commands: list[str] = field(default_factory=list, init=False)  # shapes of the commands run (self.shape)
    layout_hosts: ClassVar[tuple[str, ...]] = HOSTS
    layout_partitions: ClassVar[int] = PARTITIONS

    def __post_init__(self) -> None:
        super().__post_init__()
        self.runtime = "qemu"
        self.plan = parse_plan(self.args.plan or "")
        self.project = str(getattr(self.args, "project", None) or PROJECT)
        # a letter first: nats-server reads an environment value that starts with a digit (or "-")
        # as a number and refuses to start ("Expected a digit but got ...")
        self.passwords = {u: "p" + secrets.token_urlsafe(18) for u in PASSWORD_VARS}

    # --------------------------------------------------------------------------- stack
    def shape(self, argv: list[str]) -> str:
        """A command as an operator types it: the repository's paths relative, the run's files as
        $RUN, the console scripts by name (docs/operations.md shows these; a test compares)."""
        words = ["podman-compose" if a == compose_binary() else a for a in argv]
        if words[:3] == [sys.executable, "-m", "services.cli"]:
            words = ["vmfence", *words[3:]]
        return " ".join(w.replace(str(self.run_dir), "$RUN").replace(str(ROOT) + "/", "") for w in words)

    async def sh(self, argv: list[str], **kw: Any) -> tuple[int, str]:
        """run_cmd, and the command's shape in the run's command log."""
        line = self.shape(argv)
        if line not in self.commands:
            self.commands.append(line)
        return await run_cmd(argv, **kw)

    async def podman(self, *args: str, **kw: Any) -> tuple[int, str]:
        return await self.sh(["podman", *args], **kw)

    def _compose(self, *args: str) -> list[str]:
        return [compose_binary(), "--env-file", str(self.run_dir / "compose.env"), "-f", str(ROOT / "compose.yaml"),
                "-f", str(self.run_dir / "override.yaml"), "-p", self.project, "--profile", "dev", *args]

    def _write_files(self) -> None:
        shutil.rmtree(self.run_dir, ignore_errors=True)
        self.run_dir.mkdir(parents=True, mode=0o700)
        env = {v: self.passwords[u] for u, v in PASSWORD_VARS.items()}
        env["VMFENCE_IMAGE"] = os.environ.get("VMFENCE_IMAGE", "localhost/vmfence:dev")
        env["VMFENCE_NATS_IMAGE"] = os.environ.get("VMFENCE_NATS_IMAGE") or self._nats_image()
        self.images = {k: env[k] for k in IMAGE_ENV}
        self.ports = dict(zip((*NATS_NODES, "apiserver", "nats-monitor"), free_ports(5), strict=True))
        env |= {"VMFENCE_NATS_HOST_PORT": str(self.ports["nats-1"]),
                "VMFENCE_NATS_MONITOR_HOST_PORT": str(self.ports["nats-monitor"]),
                "VMFENCE_API_HOST_PORT": str(self.ports["apiserver"])}
        path = self.run_dir / "compose.env"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write("# the passwords of this run (vmfence chaos --compose)\n")
            f.writelines(f"{k}={v}\n" for k, v in env.items())
        (self.run_dir / "override.yaml").write_text(override_text(self.ports))

    @staticmethod
    def _nats_image() -> str:
        import subprocess

        binary = Path(sys.executable).parent / "nats-server"
        out = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=10).stdout
        return f"localhost/vmfence-nats:{out.strip().rsplit('v', 1)[-1]}"

    async def _inspect(self, service: str) -> dict[str, Any]:
        _, out = await self.podman("inspect", container(service, self.project))
        info: list[dict[str, Any]] = json.loads(out)
        return info[0]

    async def wait_healthy(self, service: str, within_s: float = HEALTHY_TIMEOUT_S) -> bool:
        """compose.yaml's own healthcheck of the service passes (podman runs it on request: this
        machine has no systemd to schedule it)."""
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline:
            rc, _ = await self.podman("healthcheck", "run", container(service, self.project), check=False)
            if rc == 0:
                return True
            await asyncio.sleep(POLL_S)
        return False

    async def start_stack(self) -> None:
        from kubernetes_asyncio import client, config

        from shared.bus.connect import Bus, NatsAuth
        from shared.kubeclient import api_client
        from shared.subjects import Subjects

        self._write_files()
        for var, image in self.images.items():
            rc, _ = await self.podman("image", "exists", image, check=False)
            if rc != 0:
                raise ComposeError(f"image {image} ({var}) not built: make images")
        await self.sh(self._compose("down", "-v", "-t", "5"), within_s=COMPOSE_TIMEOUT_S, check=False)  # a leftover
        self.say(f"podman-compose up ({self.images['VMFENCE_IMAGE']}, {self.images['VMFENCE_NATS_IMAGE']})")
        t0 = time.monotonic()
        await self.sh(self._compose("up", "-d"), within_s=COMPOSE_TIMEOUT_S)
        self.compose_up_seconds = round(time.monotonic() - t0, 1)
        self.healthy_at: dict[str, float] = {}
        for s in SERVICES:
            if not await self.wait_healthy(s):
                _, logs = await self.podman("logs", "--tail", "20", container(s, self.project), check=False)
                raise ComposeError(f"{s} not healthy within {HEALTHY_TIMEOUT_S:.0f}s:\n{logs[-2000:]}")
            self.healthy_at[s] = round(time.monotonic() - t0, 1)
        self.healthy_seconds = round(time.monotonic() - t0, 1)
        self.ids = await asyncio.to_thread(container_ids, self.project)
        self.nats_urls = [f"nats://127.0.0.1:{self.ports[n]}" for n in NATS_NODES]
        self.api_url = f"http://127.0.0.1:{self.ports['apiserver']}"
        kubeconfig = self.run_dir / "kubeconfig"
        kubeconfig.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config",
            "clusters": [{"name": "compose", "cluster": {"server": self.api_url}}],
            "users": [{"name": "compose", "user": {}}],
            "contexts": [{"name": "compose", "context": {"cluster": "compose", "user": "compose"}}],
            "current-context": "compose",
        }))
        self.kubeconfig = str(kubeconfig)
        self.subjects = Subjects(partitions=PARTITIONS)
        # admin: it reads every consumer's lag and the lease holders
        self.bus = await Bus.open(self.nats_urls, name="vmfence-chaos-compose", subjects=self.subjects,
                                  auth=NatsAuth(user="admin", password=self.passwords["admin"]))
        cfg = client.Configuration()
        await config.load_kube_config(config_file=self.kubeconfig, client_configuration=cfg)
        self.api = api_client(cfg)
        self.core = client.CoreV1Api(self.api)

    async def stop_stack(self) -> dict[str, Any]:
        for attr in ("api", "bus"):
            obj = getattr(self, attr, None)
            if obj is not None:
                with contextlib.suppress(Exception):
                    await obj.close()
        if self.args.keep:
            return {"stack": f"kept: {' '.join(self._compose('down', '-v'))}"}
        for s in SERVICES:  # a paused container cannot be stopped
            await self.podman("unpause", container(s, self.project), check=False)
        rc, out = await self.sh(self._compose("down", "-v", "-t", "10"), within_s=COMPOSE_TIMEOUT_S, check=False)
        left = await asyncio.to_thread(container_ids, self.project) if rc == 0 else {}
        return {"compose_down_rc": rc, "containers_left": len(left)} | ({"compose_down": out[-500:]} if rc else {})

    # ---------------------------------------------------------------------------- faults
    async def lease_holders(self) -> dict[str, str]:
        """lease key (a partition number or ``fleet``) -> owner id, from the leases bucket's
        per-subject last messages (no KV watch: nats-py's keys() leaves a consumer behind per call).
        Membership entries (``member.*``) are not leases."""
        import nats.js.errors

        from shared.bus.leases import LeaseValue

        bucket = self.subjects.kv_leases
        stream = f"KV_{bucket}"
        out: dict[str, str] = {}
        try:
            info = await asyncio.wait_for(self.bus.js.stream_info(stream, subjects_filter=f"$KV.{bucket}.>"), 10)
        except (nats.errors.Error, nats.js.errors.Error, TimeoutError):
            return out
        for subject in info.state.subjects or {}:
            key = subject.removeprefix(f"$KV.{bucket}.")
            if key.startswith("member."):
                continue
            try:
                msg = await asyncio.wait_for(self.bus.js.get_last_msg(stream, subject), 5)
            except (nats.errors.Error, nats.js.errors.Error, TimeoutError):
                continue
            if (msg.headers or {}).get("KV-Operation") in ("DEL", "PURGE") or not msg.data:
                continue
            with contextlib.suppress(msgspec.DecodeError):
                out[key] = msgspec.json.decode(msg.data, type=LeaseValue).owner
        return out

    async def settled_holders(self, within_s: float = 20.0) -> dict[str, str]:
        """The lease holders once every partition has one (right after a NATS node's kill or cut
        the bucket's stream may not answer for a moment; a fault on "the reconciler that holds
        leases" must see them)."""
        deadline = time.monotonic() + within_s
        holders = await self.lease_holders()
        while sum(k.isdigit() for k in holders) < PARTITIONS and time.monotonic() < deadline:
            await asyncio.sleep(POLL_S)
            holders = await self.lease_holders()
        return holders

    @staticmethod
    def _held_by(holders: dict[str, str], reconciler: str) -> set[str]:
        return {p for p, owner in holders.items() if owner == reconciler or owner.startswith(reconciler + ":")}

    async def _victim(self, fault: Fault) -> str:
        if fault.target in SERVICES:
            return fault.target
        if fault.target == "reconciler" and fault.kind in ("partition", "pause"):
            holders = await self.settled_holders()  # the one holding leases: the old owner of the story
            held = {r: len(self._held_by(holders, r)) for r in RECONCILERS}
            best = max(held.values())
            return self.rng.choice(sorted(r for r, n in held.items() if n == best))
        return self.rng.choice([s for s in SERVICES if kind_of(s) == fault.target])

    def random_fault(self) -> Fault:
        kind = self.rng.choices(FAULT_KINDS, weights=(0.6, 0.32, 0.08))[0]
        if kind == "kill":
            target = self.rng.choices(TARGETS, weights=(0.35, 0.25, 0.2, 0.1, 0.1))[0]
        elif kind == "partition":
            target = self.rng.choice(("agent", "nats", "reconciler"))
        else:
            target = self.rng.choice(("agent", "reconciler"))
        return Fault(kind, target)

    async def _restarted(self, service: str, why: str) -> None:
        if not await self.wait_healthy(service):
            self.restart_timeouts.append(f"{service}: not healthy within {HEALTHY_TIMEOUT_S:.0f}s after {why}")

    async def _watch_takeover(self, reconciler: str, held: set[str], t_cut: float) -> None:
        """The other reconciler holds every partition ``reconciler`` held when it was cut off."""
        if not held:
            return
        deadline = t_cut + TAKEOVER_TIMEOUT_S
        seen: list[str] = []
        while time.monotonic() < deadline:
            holders = await self.lease_holders()
            still, free = held & self._held_by(holders, reconciler), held - set(holders)
            line = f"{time.monotonic() - t_cut:.1f}s: {len(still)} still {reconciler}'s, {len(free)} free"
            if not seen or seen[-1].split(": ", 1)[1] != line.split(": ", 1)[1]:
                seen.append(line)
            if not still and not free:
                self.takeovers.append(round(time.monotonic() - t_cut, 1))
                return
            await asyncio.sleep(POLL_S)
        self.violations.append(f"{reconciler} cut off holding leases {sorted(held)}: the other reconciler did not "
                               f"hold them all within {TAKEOVER_TIMEOUT_S:.0f}s ({'; '.join(seen[-6:])})")


    async def inject(self, fault: Fault) -> None:
        victim = await self._victim(fault)
        kind = kind_of(victim)
        name = container(victim, self.project)
        t = f"{time.monotonic() - self._t0:.1f}s (t={time.time():.1f})"
        if fault.kind == "kill":
            down_s = self.rng.uniform(0.5, 3.0)
            await self.podman("kill", name)
            self.kills[kind] += 1
            self.events.append(f"{t} kill {victim}")
            self.say(f"podman kill {victim}; down {down_s:.1f}s")
            await asyncio.sleep(down_s)  # the outage itself
            await self.podman("start", name)
            await self._restarted(victim, "kill")
            return
        if fault.kind == "partition":
            net, what = {"agent": ("bus", "agent-from-nats"), "nats": ("routes", "nats-from-peers"),
                         "reconciler": ("bus", "reconciler-from-nats")}[kind]
            alias = f"{victim}-route" if kind == "nats" else victim
            held = self._held_by(await self.settled_holders(), victim) if kind == "reconciler" else set()
            hold_s = self.rng.uniform(LEASE_TTL_S + 3, LEASE_TTL_S + 8) if kind == "reconciler" else \
                self.rng.uniform(3.0, 9.0)
            await self.podman("network", "disconnect", network(net, self.project), name)
            t_cut = time.monotonic()
            self.partitions[what] += 1
            self.events.append(f"{t} partition {victim} off {net} ({hold_s:.1f}s, leases {len(held)})")
            self.say(f"{victim} cut off network {net} for {hold_s:.1f}s (holding {len(held)} leases)")
            if kind == "reconciler":
                await asyncio.gather(self._watch_takeover(victim, held, t_cut),
                                     asyncio.sleep(max(0.0, hold_s - (time.monotonic() - t_cut))))
            else:
                await asyncio.sleep(hold_s)
            await self.podman("network", "connect", "--alias", alias, network(net, self.project), name)
            await self._restarted(victim, "partition")
            return
        held = self._held_by(await self.settled_holders(), victim) if kind == "reconciler" else set()
        pause_s = self.rng.uniform(LEASE_TTL_S + 3, LEASE_TTL_S + 8)
        await self.podman("pause", name)
        t_cut = time.monotonic()
        self.pauses[kind] += 1
        self.events.append(f"{t} pause {victim} ({pause_s:.1f}s, leases {len(held)})")
        self.say(f"podman pause {victim} for {pause_s:.1f}s (holding {len(held)} leases)")
        if kind == "reconciler":
            await asyncio.gather(self._watch_takeover(victim, held, t_cut),
                                 asyncio.sleep(max(0.0, pause_s - (time.monotonic() - t_cut))))
        else:
            await asyncio.sleep(pause_s)
        await self.podman("unpause", name)
        await self._restarted(victim, "pause")

    async def faulter(self) -> None:
        """The plan's faults in order, or (no plan) seeded random faults until the time is up."""
        every = self.args.fault_every
        planned = list(self.plan)
        while not self._stop_faults.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop_faults.wait(), self.rng.uniform(0.5 * every, 1.5 * every))
            if self._stop_faults.is_set():
                return
            if self.plan and not planned:
                return
            fault = planned.pop(0) if self.plan else self.random_fault()
            try:
                await self.inject(fault)
            except ComposeError as exc:
                self.notes.append(f"{fault.kind} {fault.target}: {exc!s:.400}")
                self.say(f"fault {fault.kind} {fault.target} failed: {exc!s:.200}")

    # ------------------------------------------------------------------------- the end
    async def audit_cli(self) -> dict[str, Any]:
        """`vmfence replay --json` and `vmfence verify --json` as an operator runs them, as audit."""
        env = {"VMFENCE_NATS_URL": ",".join(self.nats_urls), "VMFENCE_NATS_USER": "audit",
               "VMFENCE_NATS_PASSWORD": self.passwords["audit"], "VMFENCE_PARTITIONS": str(PARTITIONS)}
        out: dict[str, Any] = {}
        for what, argv in (("replay", ["replay", "--json"]),
                           ("verify", ["verify", "--json", "--kubeconfig", self.kubeconfig])):
            self.commands.append(self.shape([sys.executable, "-m", "services.cli", *argv]))
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "services.cli", *argv, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE, cwd=ROOT,
                env={k: v for k, v in os.environ.items() if not k.startswith("VMFENCE_")} | env,
            )
            try:
                stdout, stderr = await asyncio.wait_for(proc.communicate(), 180)
            except TimeoutError:
                proc.kill()
                await proc.wait()
                out[what] = {"exit": None, "error": "no answer within 180s"}
                continue
            try:
                body = json.loads(stdout or b"{}")
            except ValueError:
                body = {}
            res: dict[str, Any] = {"exit": proc.returncode, "clean": body.get("clean")}
            if what == "replay":
                res["violations"] = [f"{v.get('rule')}: {v.get('key')} entry {v.get('n')}: {v.get('message')}"
                                     for v in body.get("violations") or []][:20]
                res["entries"] = body.get("entries")
            else:
                res["drift"] = [str(d)[:300] for d in body.get("drift") or []][:20]
            if proc.returncode not in (0, 1) or not body:
                res["stderr"] = stderr.decode(errors="replace")[-600:]
            out[what] = res
        return out

    async def verdict(self) -> dict[str, Any]:
        from shared.bus.logstream import audit_records, read_log

        pods = await self._pods()
        live = {f"{NS}/{n}": (str(p.metadata.uid), p) for n, p in pods.items()}
        vms = await asyncio.to_thread(scan_containers, self.ids)
        leaked = [f"{vm.vm_id} on {vm.host} (key {vm.key}, uid {vm.uid8})" for vm in vms
                  if vm.key not in live or live[vm.key][0].replace("-", "")[:8] != vm.uid8]
        by_key = Counter(vm.key for vm in vms if vm.key in live)
        without_vm = sorted(k for k, (_uid, p) in live.items()
                            if (p.metadata.annotations or {}).get("vmfence.io/hibernate") != "true" and by_key[k] != 1)
        records = [r async for r in read_log(self.bus.js, self.subjects)]
        report = audit_records(records)
        lost = lost_inputs(records, {
            k: (uid, (p.metadata.annotations or {}).get("vmfence.io/hibernate") == "true")
            for k, (uid, p) in live.items()
        })
        return {
            "pods_live": len(live),
            "vms_running": len(vms),
            "vms_by_host": dict(Counter(vm.host for vm in vms)),
            "leaked_vms": len(leaked),
            "leaked": leaked,
            "pods_without_vm": without_vm,
            "lost_inputs": len(lost),
            "lost": lost,
            "audit_violations": [f"{v.rule}: {v.key} entry {v.n}: {v.message}" for v in report.violations],
            "log_entries": report.entries,
            "vms_created": report.vms_created,
            "vms_released": report.vms_released,
            "keys": report.keys,
        }

    async def run(self) -> dict[str, Any]:
        self._t0 = time.monotonic()
        me = asyncio.current_task()
        if me is not None:  # SIGTERM/SIGINT still take the stack down
            for sig in (signal.SIGTERM, signal.SIGINT):
                asyncio.get_running_loop().add_signal_handler(sig, me.cancel)
        result: dict[str, Any] = {"minutes": self.args.minutes, "runtime": "qemu", "rng_seed": self.rng_seed,
                                  "plan": self.args.plan or None, "project": self.project}
        oracle: ContainerOracle | None = None
        tasks: list[asyncio.Task[None]] = []
        ok = False
        try:
            self.say(f"compose stack {self.project} from {ROOT / 'compose.yaml'} (run files in {self.run_dir})")
            await self.start_stack()
            result.update({"compose_up_seconds": self.compose_up_seconds, "healthy_seconds": self.healthy_seconds,
                           "healthy_at": self.healthy_at, "images": self.images})
            self.say(f"stack healthy after {self.healthy_seconds}s; churn and faults begin")
            oracle = ContainerOracle(self.ids, self.forced)
            tasks.append(asyncio.create_task(self._sample(oracle), name="oracle"))
            churn = asyncio.create_task(self.churn(), name="churn")
            faulter = asyncio.create_task(self.faulter(), name="faults")
            tasks += [churn, faulter]
            chaos_t0 = time.monotonic()
            minutes = asyncio.create_task(asyncio.sleep(self.args.minutes * 60))
            done_faults = asyncio.ensure_future(faulter)
            await asyncio.wait({minutes, done_faults}, return_when=asyncio.FIRST_COMPLETED)
            if self.plan and done_faults.done() and not minutes.done():
                await minutes  # the plan is done early: the churn runs the minutes out
            minutes.cancel()
            self._stop_faults.set()
            await asyncio.gather(churn, faulter)  # the faulter finishes its fault (reconnect, unpause) first
            result["chaos_seconds"] = round(time.monotonic() - chaos_t0, 1)
            await self.settle(result, recheck_after_s=35.0)
            result["audit_cli"] = await self.audit_cli()
            await asyncio.to_thread(oracle.sample)
            ok = True
        finally:
            await cancel_and_wait(tasks, what="chaos task")
            self._stop_faults.set()
            result.update(await self.stop_stack())
        replay = result.get("audit_cli", {}).get("replay", {})
        verify = result.get("audit_cli", {}).get("verify", {})
        violations = [*result.get("audit_violations", []), *self.violations,
                      *(f"vmfence replay: {v}" for v in replay.get("violations", [])),
                      *(f"vmfence verify: {d}" for d in verify.get("drift", []))]
        if ok and replay.get("exit") != 0:
            violations.append(f"vmfence replay exited {replay.get('exit')}: {replay.get('stderr', '')[:300]}")
        if ok and verify.get("exit") != 0:
            violations.append(f"vmfence verify exited {verify.get('exit')}: {verify.get('stderr', '')[:300]}")
        result.update({
            "seconds": round(time.monotonic() - self._t0, 1),
            "containers": len(SERVICES),
            "kills": dict(self.kills),
            "kills_total": sum(self.kills.values()),
            "partitions": dict(self.partitions),
            "partitions_total": sum(self.partitions.values()),
            "pauses": sum(self.pauses.values()),
            "pauses_by_kind": dict(self.pauses),
            "lease_takeover_seconds": self.takeovers,
            "pods_churned": sum(self.ops[k] for k in ("create", "recreate", "delete", "hibernate", "wake")),
            "ops": dict(self.ops),
            "max_vms_per_key": oracle.max_per_key if oracle else 0,
            "max_vms_per_incarnation": oracle.max_per_incarnation if oracle else 0,
            "oracle_samples": oracle.samples if oracle else 0,
            "oracle_overlaps": oracle.worst[:20] if oracle else [],
            "overlaps_after_force_delete": len(oracle.forced_overlaps) if oracle else 0,
            "overlaps_after_force_delete_first": oracle.forced_overlaps[:5] if oracle else [],
            "violations": violations,
            "restart_timeouts": self.restart_timeouts,
            "events": self.events,
            "commands": self.commands,
            "notes": self.notes[:20],
        })
        # Two VMs of one key where all but one belong to force-deleted incarnations (the churn's
        # grace-0 recreates; issue 11, decide.bringup._stranded) are counted apart, in
        # overlaps_after_force_delete; any other overlap, and two VMs of one incarnation, fail.
        broken = bool(
            violations or result.get("leaked_vms") or result.get("lost_inputs") or result.get("pods_without_vm")
            or result["max_vms_per_key"] > 1 or result["max_vms_per_incarnation"] != 1 or not result.get("quiesced")
        )  # fmt: skip
        result["ok"] = ok and not broken
        return result

    async def _sample(self, oracle: ContainerOracle) -> None:
        while True:
            await asyncio.to_thread(oracle.sample)
            await asyncio.sleep(ORACLE_PERIOD_S)


def run_compose_chaos(args: argparse.Namespace) -> dict[str, Any]:
    from shared.tasks import run_main

    return run_main(ComposeChaos(args).run())
