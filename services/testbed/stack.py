"""A whole vmfence stack on this machine, for `vmfence up` and `vmfence demo`.

Embedded nats-server, the development API server (unless a kubeconfig is given), the watcher and
the agents in this process, and the reconcilers as child processes (so the demo can SIGKILL one
and start it again, as an operator's node failure would). Everything writes under one directory
(``.vmfence/run`` by default) and is stopped in reverse order.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import fcntl
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

import yaml
from kubernetes_asyncio import client, config
from kubernetes_asyncio.config.config_exception import ConfigException

from services.agent.config import AgentConfig
from services.agent.runtime.images import install_guest_image
from services.agent.runtime.qemu import REPO_GUEST_IMAGE
from services.agent.service import Agent
from services.apiserver.server import ApiServer, ApiServerConfig, write_kubeconfig
from services.testbed.natsserver import (
    LOOPBACK,
    NatsServer,
    NatsUsers,
    agent_user,
    free_port,
    local_accounts,
    start_nats,
    write_private,
)
from services.watcher.watch import Watcher
from shared.bus.connect import Bus
from shared.bus.provision import StreamsConfig, provision
from shared.kubeclient import api_client
from shared.subjects import Subjects
from shared.tasks import end_within, run_within

log = logging.getLogger(__name__)

READY_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 20.0
ROOT = Path(__file__).resolve().parents[2]
LOCK_FILE = "stack.lock"  # in the run directory, flock'ed for the stack's whole life
USERS_FILE = "nats-users.json"  # the generated password of every NATS user of this stack (0600)
HARNESS_USER = "admin"  # the stack's own connection: tests inject faults through it (see LocalStack)
OPERATOR_USER = "audit"  # what stack.json gives `vmfence decisions/replay/status/verify`
PRIVATE_DIR = 0o700  # a stack's directories: only its user reads them (passwords, guest files)
PRIVATE_FILE = 0o600


class StackBusy(RuntimeError):
    """Another live stack holds the run directory; the message is the one line the user sees."""


class StackConfigError(RuntimeError):
    """An ordinary mistake in what the stack was given (a kubeconfig that is missing or not one);
    the message is the one line the user sees, found before anything is started."""


def check_kubeconfig_file(path: str) -> None:
    """StackConfigError (one line) unless ``path`` is a readable file."""
    if not os.path.exists(path):
        raise StackConfigError(f"kubeconfig {path}: no such file")
    if not os.path.isfile(path) or not os.access(path, os.R_OK):
        raise StackConfigError(f"kubeconfig {path}: not a readable file")


async def load_kubeconfig(path: str) -> client.Configuration:
    """The client configuration of a kubeconfig file, or StackConfigError in one line."""
    check_kubeconfig_file(path)
    cfg = client.Configuration()
    try:
        await config.load_kube_config(config_file=path, client_configuration=cfg)
    except (ConfigException, yaml.YAMLError, ValueError, TypeError, KeyError, AttributeError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise StackConfigError(f"kubeconfig {path}: not a usable kubeconfig ({first})") from None
    return cfg


class DirLock:
    """An exclusive ``flock`` on ``<dir>/stack.lock`` held while a stack runs in ``dir``.

    Acquired before anything in the directory is touched, so a second stack in the same directory
    is refused without removing or writing a file of the first. The kernel drops the lock when
    the holder exits, however it exits: a stale lock file never blocks the next stack.
    """

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.path = directory / LOCK_FILE
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    @property
    def inherit(self) -> tuple[int, ...]:
        """For a child's ``pass_fds``: a child holds the lock with its parent, so processes a killed
        stack leaves behind (nats-server, reconcilers) keep their directory from the next one."""
        return () if self._fd is None else (self._fd,)

    def acquire(self) -> None:
        if self._fd is not None:
            return
        self.directory.mkdir(parents=True, exist_ok=True, mode=PRIVATE_DIR)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, PRIVATE_FILE)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise StackBusy(
                f"another stack is running in {self.directory} (pid {holder}, or processes it started); "
                "stop it first or use another --dir"
            ) from None
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd

    def clear_directory(self) -> None:
        """Remove everything a previous (finished) stack left in the directory but the lock file."""
        if self._fd is None:
            raise RuntimeError("clearing a stack directory needs its lock")
        for entry in self.directory.iterdir():
            if entry.name == LOCK_FILE:
                continue
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)
            os.close(fd)  # closing the descriptor drops the flock


def qemu_available() -> bool:
    return shutil.which("qemu-system-x86_64") is not None and shutil.which("qemu-img") is not None


def pick_runtime(requested: str) -> str:
    if requested == "auto":
        return "qemu" if qemu_available() else "sim"
    return requested


@dataclass
class ReconcilerProc:
    name: str
    port: int
    log: Path
    proc: subprocess.Popen[bytes] | None = None
    kills: int = 0


def private_dir(path: Path) -> Path:
    """Create (or tighten) a directory only its owner may enter."""
    path.mkdir(parents=True, exist_ok=True, mode=PRIVATE_DIR)
    os.chmod(path, PRIVATE_DIR)
    return path


def private_append(path: Path) -> int:
    """A descriptor appending to a 0600 log file."""
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, PRIVATE_FILE)


def _without_nats_identity(env: dict[str, str]) -> dict[str, str]:
    """The environment minus any NATS identity a caller's shell set: a child logs in as the stack says."""
    return {k: v for k, v in env.items() if not k.startswith("VMFENCE_NATS_")}


@dataclass
class LocalStack:
    """A whole stack in one directory, NATS with the deployment's users and permissions
    (deploy/nats/accounts.conf, passwords generated per start into ``<root>/nats-users.json``).

    Identities: the watcher logs in as ``watcher``, each agent as ``agent-<host>`` (a host that
    accounts.conf has no user for gets one rendered from its host-a block), the reconcilers as
    ``reconciler`` (and provision the streams as that user), ``stack.json`` gives operator
    commands ``audit``. The stack's own connection, ``bus``, is ``admin``: the tests drive faults
    through it that no service may do (deleting log entries, reading VMFENCE_IN, benchmark streams).
    """

    root: Path
    runtime: str = "sim"
    partitions: int = 8
    reconcilers: int = 2
    hosts: tuple[str, ...] = ("host-a", "host-b")
    kubeconfig: str | None = None  # an existing cluster instead of the development API server
    # without a kubeconfig: "dev" starts the development API server, "kube" the real control plane
    # (services.testbed.kubecp: etcd, kube-apiserver, scheduler, controller-manager, the chart's RBAC)
    control_plane: str = "dev"
    # component ("watcher", "reconciler") -> the kubeconfig it runs with (the chart's service accounts);
    # a component not named uses ``kubeconfig``. Set by the stack itself for control_plane="kube".
    service_kubeconfigs: dict[str, str] | None = None
    kubelet_client_ca: str | None = None  # the CA of an external API server's kubelet client (kubectl logs)
    restart_backoff_s: float = 1.0
    host_cpus: int = 64
    host_memory_mib: int = 65536
    accel: str = "auto"
    fresh: bool = True
    watch_window: int = 1000
    host_stale_s: float = 15.0
    ack_wait_s: float | None = None  # reconcilers' and agents' redelivery delay (None: their defaults)
    streams: StreamsConfig | None = None  # default: StreamsConfig(partitions=partitions)
    # each component's door to the bus (component name, server URL) -> URL, e.g. a fault proxy
    bus_door: Callable[[str, str], Awaitable[str]] | None = None

    subjects: Subjects = field(init=False)
    nats: NatsServer | None = field(default=None, init=False)
    apiserver: ApiServer | None = field(default=None, init=False)
    kubeconfig_path: str = field(default="", init=False)
    recs: dict[str, ReconcilerProc] = field(default_factory=dict, init=False)
    agents: dict[str, Agent] = field(default_factory=dict, init=False)
    watcher: Watcher | None = field(default=None, init=False)
    bus: Bus | None = field(default=None, init=False)
    watcher_bus: Bus | None = field(default=None, init=False)
    urls: dict[str, str] = field(default_factory=dict, init=False)  # component -> its NATS URL
    users: NatsUsers | None = field(default=None, init=False)
    api: client.ApiClient | None = field(default=None, init=False)  # the harness's (admin on a real cluster)
    watcher_api: client.ApiClient | None = field(default=None, init=False)
    kube: Any = field(default=None, init=False)  # the KubeControlPlane this stack started, if any
    _tasks: list[asyncio.Task[None]] = field(default_factory=list, init=False)
    _agent_tasks: dict[str, asyncio.Task[None]] = field(default_factory=dict, init=False)
    kubelet_pki: Any = field(default=None, init=False)  # a KubeletPki: the agents' kubelet endpoints
    _lock: DirLock = field(init=False)

    def __post_init__(self) -> None:
        self.subjects = Subjects(partitions=self.partitions)
        self.root = self.root.absolute()  # child processes run from the repository root
        self._lock = DirLock(self.root)

    def lock(self) -> None:
        """Take the run directory (StackBusy if another stack holds it); start() does it first."""
        self._lock.acquire()

    # ------------------------------------------------------------------------- start
    async def start(self, on_status: Callable[[str, str], None] = lambda name, state: None) -> None:
        """Start everything; on any failure stop what was started (nats-server, the control plane,
        reconcilers, agents) and release the directory before the error goes on: a caller that
        never reaches its own stop() leaves no process behind. stop() after that is harmless."""
        try:
            await self._start(on_status)
        except BaseException:
            try:
                await self.stop()
            except Exception as exc:  # the start's error is the one the caller needs
                log.warning("stopping a stack whose start failed: %r", exc)
            raise

    async def _start(self, on_status: Callable[[str, str], None]) -> None:
        self.lock()
        cluster = await load_kubeconfig(self.kubeconfig) if self.kubeconfig is not None else None  # before any start
        if self.fresh:
            self._lock.clear_directory()
        private_dir(self.root)
        private_dir(self.root / "logs")
        from services.testbed.kubeletpki import make_kubelet_pki  # imports kubecp, which imports this module

        self.kubelet_pki = await asyncio.to_thread(make_kubelet_pki, self.root / "kubelet-pki")
        accounts, self.users = local_accounts(self.hosts)
        self.users.save(self.root / USERS_FILE)
        on_status("nats", "starting")
        self.nats = await start_nats(store_dir=str(self.root / "nats"), config_text=accounts,
                                     keep_fds=self._lock.inherit)
        on_status("nats", self.nats.url)
        self.bus = await self.open_bus(HARNESS_USER, "vmfence-stack")
        provisioner = await self.open_bus("reconciler", "vmfence-stack-provision")
        try:
            await provision(provisioner.js, self.subjects, self.streams or StreamsConfig(partitions=self.partitions))
        finally:
            await run_within(provisioner.close(), STOP_TIMEOUT_S, what="closing the provisioning connection")
        components = [*(f"reconciler-{i + 1}" for i in range(self.reconcilers)),
                      *(f"agent-{h}" for h in self.hosts), "watcher"]
        for c in components:
            self.urls[c] = await self.bus_door(c, self.nats.url) if self.bus_door else self.nats.url
        if self.kubeconfig is None and self.control_plane == "kube":
            from services.testbed.kubecp import start_control_plane  # imports this module

            on_status("kube", "starting")
            self.kube, creds = await start_control_plane(self.root / "kube")
            self.kubeconfig_path = str(self.kube.admin_kubeconfig)
            self.service_kubeconfigs = {c: str(p) for c, p in creds.kubeconfigs.items()}
            on_status("kube", f"{self.kube.url} ({self.kube.timings['total_s']:.1f}s)")
        elif self.kubeconfig is None:
            on_status("apiserver", "starting")
            kp = self.kubelet_pki
            self.apiserver = ApiServer(ApiServerConfig(
                db_path=None, watch_window=self.watch_window, kubelet_client_cert=str(kp.client.cert),
                kubelet_client_key=str(kp.client.key), kubelet_ca=str(kp.ca)))
            await self.apiserver.start()
            self.kubeconfig_path = write_kubeconfig(self.apiserver.url, str(self.root / "kubeconfig"))
            os.chmod(self.kubeconfig_path, PRIVATE_FILE)
            on_status("apiserver", self.apiserver.url)
        else:
            self.kubeconfig_path = self.kubeconfig
        self.api = api_client(cluster or await load_kubeconfig(self.kubeconfig_path))
        for i in range(self.reconcilers):
            name = f"reconciler-{i + 1}"
            self.recs[name] = ReconcilerProc(name, free_port(), self.root / "logs" / f"{name}.log")
            self.start_reconciler(name)
            on_status(name, "starting")
        for host in self.hosts:
            await self.start_agent(host)
            on_status(f"agent {host}", f"ready ({self.runtime})")
        self.watcher_bus = await self.open_bus("watcher", "vmfence-watcher", url=self.urls["watcher"])
        own = self.kubeconfig_of("watcher")
        self.watcher_api = self.api if own == self.kubeconfig_path else api_client(await load_kubeconfig(own))
        self.watcher = Watcher(self.watcher_api, self.watcher_bus.js, self.subjects)
        self._tasks.append(asyncio.create_task(self.watcher.run(), name="watcher"))
        try:
            await asyncio.wait_for(self.watcher.ready.wait(), READY_TIMEOUT_S)
        except TimeoutError:
            where = self.apiserver.url if self.apiserver is not None else f"the cluster of {self.kubeconfig_path}"
            raise RuntimeError(f"the watcher could not list pods within {READY_TIMEOUT_S:.0f}s: "
                               f"is {where} reachable?") from None
        on_status("watcher", "ready")
        for name in self.recs:
            await self.wait_reconciler_ready(name)
            on_status(name, "ready")

    def kubeconfig_of(self, component: str) -> str:
        """The kubeconfig a component runs with: its own (the chart's service account), else the stack's."""
        return (self.service_kubeconfigs or {}).get(component, self.kubeconfig_path)

    # ---------------------------------------------------------------------- identities
    def identity(self, user: str) -> tuple[str, str]:
        """The server URL and password of one of this stack's NATS users."""
        assert self.nats is not None and self.users is not None, "the stack is not started"
        return self.nats.url, self.users.password(user)

    async def open_bus(self, user: str, name: str, *, url: str | None = None) -> Bus:
        """A connection as ``user`` (to ``url``: a component's door, default the server)."""
        assert self.nats is not None and self.users is not None, "the stack is not started"
        return await Bus.open(url or self.nats.url, name=name, subjects=self.subjects, auth=self.users.auth(user))

    async def start_agent(self, host: str) -> Agent:
        assert self.nats is not None and self.users is not None
        agent_cfg = AgentConfig(
            nats_url=[self.urls.get(f"agent-{host}", self.nats.url)],
            nats_user=agent_user(host), nats_password=self.users.password(agent_user(host)),
            host=host, runtime=self.runtime,
            data_dir=str(self.root / "agents" / host), http_port=0, http_host="127.0.0.1",
            partitions=self.partitions, cpus=self.host_cpus, memory_mib=self.host_memory_mib,
            heartbeat_interval=1.0, inventory_interval=30.0, probe_interval=1.0, accel=self.accel,
            vnc_range=None, cleanup_on_stop=True, shutdown_timeout=10.0,
        )
        if self.ack_wait_s:
            agent_cfg = dataclasses.replace(agent_cfg, ack_wait=self.ack_wait_s)
        if self.kubelet_pki is not None:  # kubectl logs: the API server's kubelet client is the only one let in
            kp = self.kubelet_pki
            client_ca = self.kubelet_client_ca or (
                self.kube.pki.ca.cert if self.kube is not None and self.kube.pki is not None else kp.ca)
            agent_cfg = dataclasses.replace(agent_cfg, kubelet_port=0, kubelet_tls_cert=str(kp.server.cert),
                                            kubelet_tls_key=str(kp.server.key), kubelet_client_ca=str(client_ca))
        agent_cfg = agent_cfg.validate()
        if self.runtime == "qemu":  # pods may name the project's guest image: vmfence.io/image: guest
            await asyncio.to_thread(install_guest_image, agent_cfg.images, str(REPO_GUEST_IMAGE))
        agent = Agent(agent_cfg)
        ready = asyncio.Event()
        self.agents[host] = agent
        task = asyncio.create_task(agent.run(ready=ready), name=f"agent-{host}")
        self._agent_tasks[host] = task
        await asyncio.wait_for(ready.wait(), READY_TIMEOUT_S)
        return agent

    async def stop_agent(self, host: str) -> None:
        """Stop one agent as a host outage would: its VMs keep running."""
        agent = self.agents.pop(host)
        agent.config = dataclasses.replace(agent.config, cleanup_on_stop=False)
        agent.stop()
        task = self._agent_tasks.pop(host)
        await end_within([task], STOP_TIMEOUT_S, what="agent")
        if not task.cancelled() and task.exception() is not None:
            raise task.exception()  # type: ignore[misc]

    def start_reconciler(self, name: str) -> None:
        rp = self.recs[name]
        assert self.nats is not None and self.users is not None
        log = private_append(rp.log)
        env = {**_without_nats_identity(dict(os.environ)), **self.users.env("reconciler")}  # not in argv (ps)
        rp.proc = subprocess.Popen(
            [
                sys.executable, "-m", "services.cli", "reconciler", "--nats-url", self.urls.get(name, self.nats.url),
                "--kubeconfig", self.kubeconfig_of("reconciler"), "--id", name, "--partitions", str(self.partitions),
                "--data-dir", str(self.root / "reconcilers"), "--http-host", "127.0.0.1",
                "--http-port", str(rp.port), "--lease-ttl", "3", "--snapshot-interval", "0.5",
                "--restart-backoff", str(self.restart_backoff_s), "--host-stale", str(self.host_stale_s),
                *(["--ack-wait", str(self.ack_wait_s)] if self.ack_wait_s else []),
            ],
            stdout=subprocess.DEVNULL,
            stderr=log,
            cwd=ROOT,
            env=env,
            start_new_session=True,
            umask=0o077,
            pass_fds=self._lock.inherit,
        )
        os.close(log)  # the child has its own copy

    async def wait_reconciler_ready(self, name: str) -> None:
        rp = self.recs[name]
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if rp.proc is not None and rp.proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {rp.proc.returncode}; see {rp.log}")
            if await http_ok(rp.port, "/readyz"):
                return
            await asyncio.sleep(0.1)
        raise RuntimeError(f"{name} not ready after {READY_TIMEOUT_S}s; see {rp.log}")

    def kill_reconciler(self, name: str) -> None:
        rp = self.recs[name]
        if rp.proc is not None and rp.proc.poll() is None:
            rp.proc.send_signal(signal.SIGKILL)
            rp.proc.wait(10)
            rp.kills += 1

    # ----------------------------------------------------------------------- record
    def operator_url(self) -> str:
        """The server URL with the audit identity in it: what operator commands read from stack.json
        (shown only masked, ``nats://audit:***@…``)."""
        assert self.nats is not None and self.users is not None
        password = quote(self.users.password(OPERATOR_USER), safe="")
        return f"nats://{OPERATOR_USER}:{password}@{LOOPBACK}:{self.nats.port}"

    def record(self, path: str = ".vmfence/stack.json") -> None:
        """stack.json (0600, in a 0700 directory when this creates it) for operator commands: the
        server with the read-only ``audit`` identity, the API server, prefix and partitions."""
        assert self.nats is not None
        parent = Path(path).parent
        if not parent.exists():
            private_dir(parent)
        write_private(
            Path(path),
            json.dumps(
                {
                    "nats_url": self.operator_url(),
                    "apiserver_url": self.apiserver.url if self.apiserver else None,
                    "kubeconfig": os.path.abspath(self.kubeconfig_path),
                    "prefix": self.subjects.prefix,
                    "partitions": self.partitions,
                    "pid": os.getpid(),
                },
                indent=2,
            ),
        )

    # ------------------------------------------------------------------------- stop
    async def stop(self) -> None:
        """Reverse order. Agents were started with cleanup_on_stop: this throw-away stack removes
        the VMs it created (a real agent service never does). The directory's lock goes last."""
        try:
            await self._stop()
        finally:
            self._lock.release()

    async def _stop(self) -> None:
        for rp in self.recs.values():
            if rp.proc is not None and rp.proc.poll() is None:
                rp.proc.send_signal(signal.SIGTERM)
        for rp in self.recs.values():
            if rp.proc is not None:
                try:
                    await asyncio.to_thread(rp.proc.wait, STOP_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    rp.proc.kill()
        if self.watcher is not None:
            self.watcher.stop()
        for agent in self.agents.values():
            agent.stop()
        # every step bounded: a stop that hangs would hide what it hung on (it is logged instead)
        await end_within([*self._tasks, *self._agent_tasks.values()], STOP_TIMEOUT_S, what="stack task")
        if self.watcher_api is not None and self.watcher_api is not self.api:
            await run_within(self.watcher_api.close(), STOP_TIMEOUT_S, what="closing the watcher's Kubernetes client")
        if self.api is not None:
            await run_within(self.api.close(), STOP_TIMEOUT_S, what="closing the Kubernetes client")
        if self.watcher_bus is not None and self.watcher_bus is not self.bus:
            await run_within(self.watcher_bus.close(), STOP_TIMEOUT_S, what="closing the watcher's NATS")
        if self.bus is not None:
            await run_within(self.bus.close(), STOP_TIMEOUT_S, what="closing NATS")
        if self.apiserver is not None:
            await run_within(self.apiserver.stop(), STOP_TIMEOUT_S, what="stopping the API server")
        if self.kube is not None:
            await self.kube.stop()  # bounded per process (SIGTERM, then SIGKILL)
        if self.nats is not None:
            await run_within(self.nats.stop(), STOP_TIMEOUT_S, what="stopping nats-server")


async def http_ok(port: int, path: str) -> bool:
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 1.0)
    except (OSError, TimeoutError):
        return False
    try:
        writer.write(f"GET {path} HTTP/1.0\r\nHost: localhost\r\n\r\n".encode())
        await writer.drain()
        line = await asyncio.wait_for(reader.readline(), 2.0)
        return b" 200 " in line
    except (OSError, TimeoutError):
        return False
    finally:
        writer.close()
