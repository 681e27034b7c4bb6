"""The real Kubernetes control plane on loopback: etcd, kube-apiserver, kube-scheduler and
kube-controller-manager as child processes, built by ``make kube`` into ``.venv/kube/bin``.

:class:`KubeControlPlane` in one directory (``<dir>/stack.lock`` refuses a second start there while
the first runs, :class:`services.testbed.stack.DirLock`):

1. certificates and keys (:mod:`services.testbed.kubecp.pki`) under ``pki/``;
2. etcd on free loopback ports (``--unsafe-no-fsync``), until ``/health`` says true;
3. kube-apiserver on ``127.0.0.1:<free port>`` with ``--authorization-mode=Node,RBAC``, the
   default admission plugins plus NodeRestriction, service-account issuer and keys, until
   ``/readyz`` answers 200 to the admin;
4. kube-scheduler and kube-controller-manager (``--leader-elect=false``), each with a kubeconfig of
   its own client certificate, the controller-manager with the service-account key and the root CA
   (token controllers, ``kube-root-ca.crt``) and short node-monitor periods (NotReady and
   taint eviction within seconds), until their ``/healthz`` answers 200;
5. the ``default`` ServiceAccount exists (pods can be admitted) and ``deploy/crds/`` is installed
   and Established;
6. ``admin.kubeconfig`` (``system:masters``; for the harness and the user, never for vmfence's
   services: see :mod:`services.testbed.kubecp.rbac`).

Each process logs to ``logs/<name>.log``. :meth:`KubeControlPlane.stop` ends them in reverse
order (SIGTERM, SIGKILL after ``STOP_TIMEOUT_S``) and removes everything but ``logs/``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import ssl
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import aiohttp
import yaml
from kubernetes_asyncio import client, config
from kubernetes_asyncio.client.exceptions import ApiException

from services.testbed.kubecp.pki import ClusterPki, Pair, make_pki
from services.testbed.natsserver import LOOPBACK, free_port, write_private
from services.testbed.stack import LOCK_FILE, DirLock, private_dir
from shared.kubeclient import api_client

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[3]
KUBE_BIN = Path(os.environ.get("VMFENCE_KUBE_BIN", str(ROOT / ".venv" / "kube" / "bin")))
BUILD_ERROR_FILE = "build-error"  # beside bin/: scripts/build-kube.sh's one line when a build failed
BINARIES = ("etcd", "kube-apiserver", "kube-scheduler", "kube-controller-manager")
CRD_DIR = ROOT / "deploy" / "crds"
SERVICE_CIDR = "10.0.0.0/24"
SA_ISSUER = "https://kubernetes.default.svc.cluster.local"
ADMIN_KUBECONFIG = "admin.kubeconfig"
KEEP_ON_STOP = ("logs", LOCK_FILE)

ETCD_READY_S = 30.0
APISERVER_READY_S = 90.0  # cold start on 2 shared cores: bootstrap RBAC, priority levels, CRD informers
COMPONENT_READY_S = 60.0
OBJECT_WAIT_S = 60.0  # the default ServiceAccount, a CRD's Established condition
STOP_TIMEOUT_S = 15.0
KILL_WAIT_S = 5.0
POLL_S = 0.2  # readiness has no event to wait on from outside the process: poll with a deadline
HTTP_TIMEOUT_S = 3.0
LOG_TAIL_LINES = 25
NODE_MONITOR_PERIOD_S = 1
NODE_MONITOR_GRACE_S = 10  # a stopped host's Node turns NotReady/Unknown after this (default 50 s)


class KubeUnavailable(RuntimeError):
    """The binaries are not built (or the build failed): the one line a skip or a user sees."""


BIND_ATTEMPTS = 3  # kube-apiserver starts again on a new port when its port was taken meanwhile


class ControlPlaneError(RuntimeError):
    """A process of the control plane exited or never became ready; names it and its log."""


def binaries(bin_dir: Path = KUBE_BIN) -> dict[str, Path]:
    """The four binaries, or KubeUnavailable with the build's own reason when it recorded one."""
    missing = [b for b in BINARIES if not os.access(bin_dir / b, os.X_OK)]
    if not missing:
        return {b: bin_dir / b for b in BINARIES}
    err = bin_dir.parent / BUILD_ERROR_FILE
    if err.is_file():
        reason = err.read_text(errors="replace").strip().splitlines()
        raise KubeUnavailable(f"the real control plane was not built: {reason[0] if reason else 'unknown error'}")
    raise KubeUnavailable(f"the real control plane is not built ({', '.join(missing)} missing in {bin_dir}): "
                          "run `make kube`")


def kubeconfig_text(server: str, ca_pem: bytes, user: str, *, token: str | None = None,
                    cert: Pair | None = None) -> str:
    """A kubeconfig with one cluster, one user (a bearer token or a client certificate)."""
    import base64

    def b64(data: bytes) -> str:
        return base64.b64encode(data).decode()

    creds: dict[str, str] = {}
    if token is not None:
        creds["token"] = token
    if cert is not None:
        creds["client-certificate-data"] = b64(cert.cert.read_bytes())
        creds["client-key-data"] = b64(cert.key.read_bytes())
    doc = {
        "apiVersion": "v1", "kind": "Config", "current-context": user,
        "clusters": [{"name": "vmfence-kube", "cluster": {"server": server,
                                                           "certificate-authority-data": b64(ca_pem)}}],
        "users": [{"name": user, "user": creds}],
        "contexts": [{"name": user, "context": {"cluster": "vmfence-kube", "user": user}}],
    }
    return yaml.safe_dump(doc, sort_keys=False)


@dataclass
class Proc:
    name: str
    argv: list[str]
    log: Path
    popen: subprocess.Popen[bytes] | None = None

    def tail(self) -> str:
        try:
            lines = self.log.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-LOG_TAIL_LINES:])

    def check(self) -> None:
        if self.popen is not None and self.popen.poll() is not None:
            raise ControlPlaneError(f"{self.name} exited with {self.popen.returncode}; see {self.log}:\n{self.tail()}")


@dataclass
class KubeControlPlane:
    """One control plane in ``directory``; ``async with`` starts and stops it."""

    directory: Path
    bin_dir: Path = KUBE_BIN
    node_monitor_grace_s: int = NODE_MONITOR_GRACE_S
    extra_apiserver_args: tuple[str, ...] = ()
    # False: etcd and kube-apiserver only (a benchmark's bare API server: no scheduler, no
    # controllers; the default ServiceAccount that admission needs is created by start() itself)
    controllers: bool = True

    pki: ClusterPki | None = field(default=None, init=False)
    url: str = field(default="", init=False)
    admin_kubeconfig: Path = field(init=False)
    procs: dict[str, Proc] = field(default_factory=dict, init=False)
    timings: dict[str, float] = field(default_factory=dict, init=False)  # seconds per start step
    _lock: DirLock = field(init=False)

    def __post_init__(self) -> None:
        self.directory = self.directory.absolute()
        self.admin_kubeconfig = self.directory / ADMIN_KUBECONFIG
        self._lock = DirLock(self.directory)

    async def __aenter__(self) -> Self:
        try:
            await self.start()
        except BaseException:
            await self.stop()
            raise
        return self

    async def __aexit__(self, et: type[BaseException] | None, e: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.stop()

    # ------------------------------------------------------------------------- start
    async def start(self) -> None:
        bins = binaries(self.bin_dir)
        self._lock.acquire()  # StackBusy before anything of another control plane is touched
        self._lock.clear_directory()
        private_dir(self.directory)
        logs = private_dir(self.directory / "logs")
        t0 = time.monotonic()
        self.pki = pki = await asyncio.to_thread(make_pki, self.directory / "pki")
        self.timings["pki_s"] = time.monotonic() - t0
        etcd_port, peer_port, api_port = free_port(), free_port(), free_port()
        sched_port, cm_port = free_port(), free_port()
        self.url = f"https://{LOOPBACK}:{api_port}"
        etcd_url = f"http://{LOOPBACK}:{etcd_port}"
        peer_url = f"http://{LOOPBACK}:{peer_port}"
        data = private_dir(self.directory / "etcd")

        def proc(name: str, argv: list[str]) -> Proc:
            p = Proc(name, argv, logs / f"{name}.log")
            self.procs[name] = p
            self._spawn(p)
            return p

        t = time.monotonic()
        etcd = proc("etcd", [
            str(bins["etcd"]), "--name", "vmfence", "--data-dir", str(data),
            "--listen-client-urls", etcd_url, "--advertise-client-urls", etcd_url,
            "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
            "--initial-cluster", f"vmfence={peer_url}", "--initial-cluster-state", "new",
            "--unsafe-no-fsync", "--log-level", "warn", "--quota-backend-bytes", str(2 * 1024**3),
        ])
        await self._wait(etcd, lambda: self._etcd_healthy(etcd_port), ETCD_READY_S, "etcd /health")
        self.timings["etcd_s"] = time.monotonic() - t
        t = time.monotonic()
        for attempt in range(1, BIND_ATTEMPTS + 1):
            api = proc("kube-apiserver", [
                str(bins["kube-apiserver"]),
                "--bind-address", LOOPBACK, "--advertise-address", LOOPBACK, "--secure-port", str(api_port),
                "--etcd-servers", etcd_url,
                "--tls-cert-file", str(pki.apiserver.cert), "--tls-private-key-file", str(pki.apiserver.key),
                "--client-ca-file", str(pki.ca.cert),
                "--authorization-mode", "Node,RBAC",
                "--enable-admission-plugins", "NodeRestriction",
                "--service-cluster-ip-range", SERVICE_CIDR,
                "--service-account-issuer", SA_ISSUER,
                "--service-account-key-file", str(pki.sa_pub),
                "--service-account-signing-key-file", str(pki.sa_key),
                "--kubelet-client-certificate", str(pki.kubelet_client.cert),
                "--kubelet-client-key", str(pki.kubelet_client.key),
                # a virtual Node's Hostname is its agent's host name, no DNS name: reach the agent's
                # kubelet endpoint (kubectl logs) by its InternalIP
                "--kubelet-preferred-address-types", "InternalIP,Hostname",
                "--requestheader-client-ca-file", str(pki.front_proxy_ca.cert),
                "--requestheader-allowed-names", "front-proxy-client",
                "--requestheader-username-headers", "X-Remote-User",
                "--requestheader-group-headers", "X-Remote-Group",
                "--requestheader-extra-headers-prefix", "X-Remote-Extra-",
                "--proxy-client-cert-file", str(pki.front_proxy_client.cert),
                "--proxy-client-key-file", str(pki.front_proxy_client.key),
                # the kubernetes Service's endpoint would be 127.0.0.1, which Endpoints validation refuses
                # (a loopback address); nothing in these tests reaches the API server through the Service
                "--endpoint-reconciler-type", "none",
                "--profiling=false",
                *self.extra_apiserver_args,
            ])
            try:
                await self._wait(api, self._apiserver_ready, APISERVER_READY_S, "kube-apiserver /readyz")
                break
            except ControlPlaneError as exc:
                # the port was free when picked, but something took it meanwhile (free_port's race)
                if attempt == BIND_ATTEMPTS or "address already in use" not in str(exc):
                    raise
                api_port = free_port()
                self.url = f"https://{LOOPBACK}:{api_port}"
        self.timings["apiserver_s"] = time.monotonic() - t
        write_private(self.admin_kubeconfig, kubeconfig_text(self.url, pki.ca_pem(), "vmfence-admin", cert=pki.admin))
        if not self.controllers:
            api_client = await self.admin_client()
            try:
                await client.CoreV1Api(api_client).create_namespaced_service_account(
                    "default", {"metadata": {"name": "default"}}, _request_timeout=HTTP_TIMEOUT_S)
            finally:
                await api_client.close()
            self.timings["total_s"] = time.monotonic() - t0
            return
        t = time.monotonic()
        sched_kc = self._component_kubeconfig("kube-scheduler", pki.scheduler)
        cm_kc = self._component_kubeconfig("kube-controller-manager", pki.controller_manager)
        sched = proc("kube-scheduler", [
            str(bins["kube-scheduler"]), "--kubeconfig", str(sched_kc), "--leader-elect=false",
            "--bind-address", LOOPBACK, "--secure-port", str(sched_port), "--profiling=false",
        ])
        grace = str(self.node_monitor_grace_s)
        cm = proc("kube-controller-manager", [
            str(bins["kube-controller-manager"]), "--kubeconfig", str(cm_kc), "--leader-elect=false",
            "--bind-address", LOOPBACK, "--secure-port", str(cm_port), "--profiling=false",
            "--use-service-account-credentials=true",
            "--service-account-private-key-file", str(pki.sa_key),
            "--root-ca-file", str(pki.ca.cert),
            "--cluster-signing-cert-file", str(pki.ca.cert), "--cluster-signing-key-file", str(pki.ca.key),
            "--node-monitor-period", f"{NODE_MONITOR_PERIOD_S}s",
            "--node-monitor-grace-period", f"{grace}s",
            "--node-startup-grace-period", f"{grace}s",
            "--kube-api-qps", "100", "--kube-api-burst", "200",
        ])
        await self._wait(sched, lambda: self._https_ok(sched_port, "/healthz"), COMPONENT_READY_S,
                         "kube-scheduler /healthz")
        await self._wait(cm, lambda: self._https_ok(cm_port, "/healthz"), COMPONENT_READY_S,
                         "kube-controller-manager /healthz")
        self.timings["scheduler_controller_manager_s"] = time.monotonic() - t
        t = time.monotonic()
        api_client = await self.admin_client()
        try:
            await self._wait_default_service_account(api_client)
            await install_crds(api_client)
        finally:
            await api_client.close()
        self.timings["crds_s"] = time.monotonic() - t
        self.timings["total_s"] = time.monotonic() - t0
        log.info("control plane up at %s in %.1fs (%s)", self.url, self.timings["total_s"],
                 ", ".join(f"{k}={v:.1f}" for k, v in self.timings.items()))

    def _spawn(self, p: Proc) -> None:
        fd = os.open(p.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        try:
            p.popen = subprocess.Popen(p.argv, stdin=subprocess.DEVNULL, stdout=fd, stderr=fd,
                                       cwd=self.directory, start_new_session=True, pass_fds=self._lock.inherit)
        finally:
            os.close(fd)

    def _component_kubeconfig(self, name: str, cert: Pair) -> Path:
        assert self.pki is not None
        path = self.directory / f"{name}.kubeconfig"
        write_private(path, kubeconfig_text(self.url, self.pki.ca_pem(), name, cert=cert))
        return path

    async def admin_client(self) -> client.ApiClient:
        """A client as the admin (``system:masters``): the harness's, never a vmfence service's."""
        cfg = client.Configuration()
        await config.load_kube_config(config_file=str(self.admin_kubeconfig), client_configuration=cfg)
        return api_client(cfg)

    async def _wait(self, p: Proc, ready: Any, within_s: float, what: str) -> None:
        deadline = time.monotonic() + within_s
        while True:
            p.check()
            if await ready():
                return
            if time.monotonic() > deadline:
                raise ControlPlaneError(f"{what} not ready within {within_s:.0f}s; see {p.log}:\n{p.tail()}")
            await asyncio.sleep(POLL_S)

    def _admin_ssl(self) -> ssl.SSLContext:
        assert self.pki is not None
        ctx = ssl.create_default_context(cafile=str(self.pki.ca.cert))
        ctx.load_cert_chain(str(self.pki.admin.cert), str(self.pki.admin.key))
        return ctx

    async def _get(self, url: str, ssl_ctx: ssl.SSLContext | bool) -> tuple[int, str]:
        timeout = aiohttp.ClientTimeout(total=HTTP_TIMEOUT_S)
        try:
            async with aiohttp.ClientSession(timeout=timeout) as s, s.get(url, ssl=ssl_ctx) as r:
                return r.status, await r.text()
        except (aiohttp.ClientError, TimeoutError, OSError):
            return 0, ""

    async def _etcd_healthy(self, port: int) -> bool:
        status, body = await self._get(f"http://{LOOPBACK}:{port}/health", False)
        return status == 200 and '"health":"true"' in body.replace(" ", "")

    async def _apiserver_ready(self) -> bool:
        status, _ = await self._get(f"{self.url}/readyz", self._admin_ssl())
        return status == 200

    async def _https_ok(self, port: int, path: str) -> bool:
        # the scheduler's and controller-manager's self-signed serving certificates, on loopback:
        # only their liveness is asked, nothing is sent
        insecure = ssl.create_default_context()
        insecure.check_hostname = False
        insecure.verify_mode = ssl.CERT_NONE
        status, _ = await self._get(f"https://{LOOPBACK}:{port}{path}", insecure)
        return status == 200

    async def _wait_default_service_account(self, api: client.ApiClient) -> None:
        core = client.CoreV1Api(api)
        deadline = time.monotonic() + OBJECT_WAIT_S
        while True:
            try:
                await core.read_namespaced_service_account("default", "default", _request_timeout=HTTP_TIMEOUT_S)
                return
            except ApiException as exc:
                if exc.status != 404:
                    raise
            for p in self.procs.values():
                p.check()
            if time.monotonic() > deadline:
                raise ControlPlaneError("the controller-manager made no default ServiceAccount within "
                                        f"{OBJECT_WAIT_S:.0f}s; see {self.procs['kube-controller-manager'].log}")
            await asyncio.sleep(POLL_S)

    # ------------------------------------------------------------------------- stop
    async def stop(self) -> None:
        """Every process in reverse order, then everything in the directory but its logs."""
        try:
            for p in reversed(list(self.procs.values())):
                await self._end(p)
            if self._lock.held:
                for entry in self.directory.iterdir():
                    if entry.name in KEEP_ON_STOP:
                        continue
                    if entry.is_dir() and not entry.is_symlink():
                        await asyncio.to_thread(shutil.rmtree, entry, True)
                    else:
                        entry.unlink(missing_ok=True)
        finally:
            self._lock.release()

    async def _end(self, p: Proc) -> None:
        if p.popen is None or p.popen.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            p.popen.send_signal(signal.SIGTERM)
        try:
            await asyncio.to_thread(p.popen.wait, STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            log.warning("%s ignored SIGTERM for %.0fs; killing it", p.name, STOP_TIMEOUT_S)
            p.popen.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                await asyncio.to_thread(p.popen.wait, KILL_WAIT_S)

    def pids(self) -> dict[str, int]:
        """name -> pid of every running process (etcd, kube-apiserver, …), for CPU accounting."""
        return {n: p.popen.pid for n, p in self.procs.items() if p.popen is not None and p.popen.poll() is None}

    def alive(self) -> dict[str, bool]:
        return {n: p.popen is not None and p.popen.poll() is None for n, p in self.procs.items()}


def _crd_docs(directory: Path) -> list[dict[str, Any]]:
    docs = [d for p in sorted(directory.glob("*.yaml")) for d in yaml.safe_load_all(p.read_text())]
    return [d for d in docs if d and d.get("kind") == "CustomResourceDefinition"]


async def install_crds(api: client.ApiClient, directory: Path = CRD_DIR) -> list[str]:
    """Create every CustomResourceDefinition of ``directory`` and wait until each is Established."""
    ext = client.ApiextensionsV1Api(api)
    names: list[str] = []
    for doc in await asyncio.to_thread(_crd_docs, directory):
        try:
            await ext.create_custom_resource_definition(doc, _request_timeout=HTTP_TIMEOUT_S * 3)
        except ApiException as exc:
            if exc.status != 409:
                raise
        names.append(doc["metadata"]["name"])
    deadline = time.monotonic() + OBJECT_WAIT_S
    for name in names:
        while True:
            crd = await ext.read_custom_resource_definition(name, _request_timeout=HTTP_TIMEOUT_S)
            conds = {c.type: c.status for c in (crd.status.conditions or [])} if crd.status else {}
            if conds.get("Established") == "True":
                break
            if time.monotonic() > deadline:
                raise ControlPlaneError(f"CRD {name} not Established within {OBJECT_WAIT_S:.0f}s")
            await asyncio.sleep(POLL_S)
    return names
