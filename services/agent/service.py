"""The agent service: consumes ``<prefix>.cmd.<host>``, executes, reports.

Startup order matters: subscribe to runtime events *before* ``driver.open()`` (so VMs that died
while the agent was down are reported), report the full inventory, then start consuming. A
command is acked only after its result is recorded in the ledger *and* published; a redelivery is
answered from the ledger. SIGTERM stops consuming, finishes in-flight commands (bounded), and
closes the driver without killing VMs — an agent restart never kills VMs.

In-process API (tests, demo)::

    agent = Agent(config, driver=None)          # driver: inject e.g. a SimDriver to fault it
    async with agent:                           # starts run() in a task it owns; ready on entry
        ...                                     # agent.http_port, agent.ledger, agent.driver
    # or: await agent.run(ready=event) in your own TaskGroup, and agent.stop() to end it.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import signal
import sys
import time
import uuid
from collections.abc import Awaitable
from types import TracebackType
from typing import Any, Self, TypeVar

import msgspec
import nats.errors
import nats.js.errors
from nats.aio.msg import Msg
from nats.js import api
from nats.js.kv import KeyValue

from services.agent.answers import inventory_responder, vnc_responder
from services.agent.collect import Collector
from services.agent.config import AgentConfig, host_cpus, host_memory_mib
from services.agent.delivery import Malformed, delivered, heals, retry_delay, validate_command
from services.agent.executor import Executor, VMLocks
from services.agent.kubelet import KubeletServer, KubeletTls
from services.agent.ledger import LEDGER_FILE, TRANSIENT_STATES, Ledger
from services.agent.logs import cmd_fields, fence_fields
from services.agent.metrics import AgentMetrics
from services.agent.network import (
    DEFAULT_POD_CIDR_POOL,
    HOST_PREFIX,
    SIM_HOST_PREFIX,
    SIM_POD_CIDR_POOL,
    HostNetwork,
    NetworkError,
    parse_cidr,
)
from services.agent.probes import Prober
from services.agent.rounds import round_items
from services.agent.runtime import (
    RuntimeDriver,
    VMExitedEvent,
    VMGoneEvent,
    make_driver,
)
from services.agent.verify import Verifier
from shared.bus.append import AppendFailed, publish_input
from shared.bus.connect import Bus, NatsAuthError
from shared.bus.deadletter import dead_letter
from shared.bus.provision import StreamsConfig, provision
from shared.bus.retry import Retry, backoff_delay
from shared.config import EXIT_CONFIG, start
from shared.fence.heartbeat import HostHeartbeat
from shared.fence.keys import Key, encode_token
from shared.fence.schema import (
    H_KIND,
    VERIFY_KIND,
    Command,
    CommandResult,
    Fence,
    Inventoried,
    ProbeChanged,
    VMExited,
    VMGone,
    decode_command,
    encode,
)
from shared.httpserve import HealthServer
from shared.subjects import Subjects
from shared.tasks import cancel_and_wait, end_within, run_main, run_within, sleep_unless_set, unless_set

log = logging.getLogger("vmfence.agent")

T = TypeVar("T")

NET_TIMEOUT_S = 5.0  # one NATS request (ack, KV put, consumer create)
DLQ_SOURCE = "agent"
ACK_RETRY_S = 15.0  # a lost ack is retried this long: otherwise the command waits out ack_wait
FETCH_ERROR_BACKOFF_S = 1.0
LOST_REPORTED_S = 600.0  # inventories repeat a VM the runtime lost for this long
REPORT_RETRY_MAX_S = 5.0  # a runtime event's report is retried at least this often until stored
LOCK_FILE = "agent.lock"
DATA_DIR_MODE = 0o700
CANCEL_ATTEMPTS = 50  # re-cancels of a startup step that swallowed a cancel
CANCEL_RETRY_S = 0.1


SUBSCRIBE_ATTEMPTS = 8  # consumer creation at start, about 40 s in all
SUBSCRIBE_BACKOFF_MAX_S = 8.0

START_LIMIT_S = 120.0  # the whole startup of an in-process agent (each step has its own bound)
STOP_GRACE_S = 15.0  # beyond shutdown_timeout, for the driver, HTTP server, bus and ledger to close

class AgentStartError(Exception):
    """The agent could not start (NATS unreachable, data dir locked...); one line for the operator."""


class _StoppedDuringStartup(Exception):
    """stop() (SIGTERM) arrived before the agent was ready: a clean exit, not an error."""


async def _cancel_hard(task: asyncio.Future[Any]) -> None:
    """Cancel until it takes (see shared.tasks): nats-py's initial connect otherwise just tries
    the next server."""
    await cancel_and_wait([task], what="agent step", attempts=CANCEL_ATTEMPTS, recancel_after_s=CANCEL_RETRY_S)


class Agent:
    """One host's executor. See the module docstring for the in-process API."""

    def __init__(self, config: AgentConfig, *, driver: RuntimeDriver | None = None) -> None:
        self.config = config
        self.subjects = Subjects(config.prefix, config.partitions)
        self.boot = uuid.uuid4().hex[:8]  # distinguishes this process's reports' Msg-Ids
        self.metrics = AgentMetrics()
        self.ledger = Ledger(os.path.join(config.data_dir, LEDGER_FILE))
        self._driver = driver
        self.bus: Bus | None = None
        self.http_port: int | None = None
        self.executor: Executor | None = None
        self.prober: Prober | None = None
        self._stopping = asyncio.Event()
        self._ready = False
        self._seq = 0
        self._round = 0
        self._lock_fd: int | None = None
        self._health: HealthServer | None = None
        self._task: asyncio.Task[None] | None = None
        self._kv: KeyValue | None = None
        # the sim's VMs are in this process: a loopback pool (unless one is given), large enough for
        # the thousands of VMs a scale bench puts on one sim host
        sim_pool = config.runtime == "sim" and config.pod_cidr_pool == DEFAULT_POD_CIDR_POOL
        self.network = HostNetwork(
            mode=config.network, data_dir=config.data_dir, host=config.host,  # type: ignore[arg-type]
            subnet=parse_cidr(config.pod_cidr) if config.pod_cidr else None,
            pool_cidr=parse_cidr(SIM_POD_CIDR_POOL if sim_pool else config.pod_cidr_pool),
            taps=config.runtime == "qemu", host_prefix=SIM_HOST_PREFIX if sim_pool else HOST_PREFIX,
        )
        self.collector: Collector | None = None
        self.verifier: Verifier | None = None
        self.kubelet: KubeletServer | None = None

    @property
    def driver(self) -> RuntimeDriver:
        if self._driver is None:
            raise RuntimeError("agent not started")
        return self._driver

    @property
    def ready(self) -> bool:
        """/readyz: started, connected, and the ledger takes writes (else no VM may be placed here)."""
        return self._ready and self.bus is not None and self.bus.nc.is_connected and self.ledger.writable

    # ------------------------------------------------------------------ lifecycle API
    def stop(self) -> None:
        """Ask run() to stop: no new commands, in-flight ones finish (bounded), VMs keep running."""
        self._stopping.set()

    async def __aenter__(self) -> Self:
        ready = asyncio.Event()
        self._task = asyncio.create_task(self.run(ready=ready), name=f"agent-{self.config.host}")
        waiter = asyncio.create_task(ready.wait())
        try:
            await asyncio.wait(
                {self._task, waiter}, return_when=asyncio.FIRST_COMPLETED, timeout=START_LIMIT_S
            )
        finally:
            waiter.cancel()
        if self._task.done():
            self._task.result()  # raises the startup error
        if not ready.is_set():
            await _cancel_hard(self._task)
            raise AgentStartError(f"agent not ready within {START_LIMIT_S:g}s")
        return self

    async def __aexit__(self, et: type[BaseException] | None, e: BaseException | None,
                        tb: TracebackType | None) -> None:
        self.stop()
        if self._task is not None:  # a bounded stop: where it hung is logged, then it is cancelled
            await end_within([self._task], self.config.shutdown_timeout + STOP_GRACE_S, what="agent")

    async def run(self, *, ready: asyncio.Event | None = None) -> None:
        """Run until stop(); sets ``ready`` once the inventory is out and commands are consumed."""
        cfg = self.config
        self._lock_data_dir()
        try:
            await self.ledger.open()
            try:  # the pool (and bridge) before any VM: a rediscovered VM's tap goes back on it
                await self.network.open()
            except (NetworkError, OSError) as e:
                raise AgentStartError(f"pod network: {e}") from e
            if self._driver is None:
                self._driver = self._make_driver()
            driver = self._driver
            events = driver.events()  # before open(): exits found while rediscovering are seen
            await driver.open()
            self.executor = Executor(
                self.ledger, driver, cfg.host, cfg.snapshots, image_dir=cfg.images,
                vnc=cfg.vnc_range is not None, op_timeout=cfg.op_timeout, locks=VMLocks(),
                network=self.network if self.network.enabled else None, partitions=cfg.partitions,
            )
            self.collector = Collector(self.executor, self.metrics, grace_s=cfg.collect_grace)
            self.verifier = Verifier(
                self.executor, self.subjects, self.metrics, publish=self._publish_verified,
                keepalive=self._keepalive, ack=self._ack,
                nak=lambda m: self._nak(m, self._retry_delay(m)), dead_letter=self._dead_letter,
                msg_id=lambda ask: f"verified:{cfg.host}:{ask.partition}:{ask.gen}:{self.boot}:{self._next_id()}",
            )
            await self.executor.reserve_runtime_addresses()  # before any command can allocate one
            self.prober = Prober(self.ledger, driver, cfg.host, self._publish_probe,
                                 interval=cfg.probe_interval, timeout=cfg.probe_timeout,
                                 on_liveness_failure=self._liveness_failed)
            where = cfg.nats_display  # a password in a URL is never logged
            log.info("connecting to NATS at %s", where, extra={"host": cfg.host, "event": "connecting"})
            try:
                self.bus = await self._startup(
                    Bus.open(cfg.nats_url, name=f"vmfence-agent-{cfg.host}", subjects=self.subjects,
                             auth=cfg.nats_auth),
                    f"connect to NATS at {where}",
                )
            except NatsAuthError as e:
                raise AgentStartError(str(e)) from e
            except (OSError, nats.errors.Error) as e:
                raise AgentStartError(f"cannot connect to NATS at {where}: {e!r}") from e
            if cfg.provision:
                await self._startup(
                    provision(self.bus.js, self.subjects, StreamsConfig(partitions=cfg.partitions)), "provision"
                )
            psub = await self._startup(self._subscribe(), "create the command consumer")
            await self._startup(self._answer_queries(), "answer inventory queries")
            await self._start_http()
            await self._start_kubelet()
            await self._startup(self.inventory(), "publish the inventory")
            await self._startup(self._first_heartbeat(), "write the heartbeat")
            self._ready = True
            log.info("agent ready", extra={"host": cfg.host, "event": "ready"})
            if ready is not None:
                ready.set()
            async with asyncio.TaskGroup() as tg:
                background = [
                    tg.create_task(self._events(events), name="agent-events"),
                    tg.create_task(self._every(cfg.inventory_interval, self.inventory), name="inventory"),
                    tg.create_task(self._every(cfg.heartbeat_interval, self.heartbeat), name="heartbeat"),
                    tg.create_task(self.prober.run(), name="probes"),
                    tg.create_task(self._every(cfg.collect_interval, self.collect), name="collector"),
                ]
                if self.kubelet is not None:
                    background.append(tg.create_task(self.kubelet.run_clock(), name="console-clock"))
                try:
                    await self._consume(psub)  # returns once stopping and in-flight work is done
                finally:  # also when run() itself is cancelled: the group would cancel them only once
                    self._ready = False
                    await cancel_and_wait(background, what="agent loop")
        except _StoppedDuringStartup:
            log.info("stopped before the agent was ready", extra={"host": cfg.host})
        finally:
            await self._shutdown()

    async def _startup(self, aw: Awaitable[T], what: str) -> T:
        """One startup step, bounded by connect_timeout and abandoned at once on stop(): NATS'
        initial connect otherwise retries forever and SIGTERM would go unheard."""
        step = await unless_set(aw, self._stopping, within_s=self.config.connect_timeout, what="agent step",
                                attempts=CANCEL_ATTEMPTS, recancel_after_s=CANCEL_RETRY_S)
        if step is not None:
            return step.result()
        if self._stopping.is_set():
            raise _StoppedDuringStartup
        raise AgentStartError(f"could not {what} within {self.config.connect_timeout:g}s")

    async def _shutdown(self) -> None:
        """Every step runs even when one fails or the agent is cancelled during it: a skipped bus
        close or data-dir unlock would outlive the agent."""
        self._ready = False
        async with contextlib.AsyncExitStack() as steps:  # run last-pushed first
            steps.callback(log.info, "agent stopped", extra={"host": self.config.host, "event": "stopped"})
            steps.callback(self._unlock_data_dir)
            # the pool's lease; its claim stays only while VMs of this host hold addresses
            steps.callback(lambda: self.network.close(keep_claim=self.ledger.holds_addresses()))
            steps.push_async_callback(self.ledger.close)
            if self.bus is not None:
                steps.push_async_callback(run_within, self.bus.close(), NET_TIMEOUT_S, what="closing NATS")
            if self._health is not None:
                steps.push_async_callback(self._health.stop)
                self._health = None
            if self.kubelet is not None:
                steps.push_async_callback(self.kubelet.stop)
            if self._driver is not None:  # drops connections; never kills VMs
                steps.push_async_callback(run_within, self._driver.close(), NET_TIMEOUT_S, what="closing the driver")
            if self.config.cleanup_on_stop and self.executor is not None:
                n = await self.executor.remove_all()
                log.info("cleanup on stop: removed %d VMs", n, extra={"host": self.config.host})
                if not self.ledger.vms():  # the bridge only once no VM of this agent needs it
                    steps.push_async_callback(run_within, self.network.teardown(), NET_TIMEOUT_S,
                                              what="removing the pod network")

    def _unlock_data_dir(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def _lock_data_dir(self) -> None:
        """One agent per data dir: two writers of one ledger would each believe they own the VMs.
        The data dir holds the ledger (VNC passwords) and the VMs' files: the agent user's alone."""
        os.makedirs(self.config.data_dir, mode=DATA_DIR_MODE, exist_ok=True)
        if os.stat(self.config.data_dir).st_mode & 0o777 != DATA_DIR_MODE:
            os.chmod(self.config.data_dir, DATA_DIR_MODE)
        fd = os.open(os.path.join(self.config.data_dir, LOCK_FILE), os.O_RDWR | os.O_CREAT, 0o600)
        os.fchmod(fd, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise AgentStartError(f"data dir {self.config.data_dir} is in use by another agent") from None
        self._lock_fd = fd

    def _make_driver(self) -> RuntimeDriver:
        cfg = self.config
        displays = cfg.vnc_range if cfg.vnc_range is not None else range(0)
        if cfg.runtime == "qemu":
            return make_driver("qemu", state_dir=cfg.runtime_dir, accel=cfg.accel, vnc_displays=displays,
                               vnc_listen=cfg.vnc_listen, image_store=cfg.images,
                               user_network=cfg.network == "user")
        driver = make_driver("sim", state_dir=cfg.runtime_dir, seed=cfg.sim_seed, vnc_displays=displays,
                             image_store=cfg.images)
        driver.faults.apply_flags(cfg.sim_faults)  # type: ignore[attr-defined]
        return driver

    async def _subscribe(self) -> Any:
        """Durable pull consumer ``agent-<host>`` on the CMD stream, filtered to this host."""
        assert self.bus is not None
        cfg = self.config
        durable = f"agent-{encode_token(cfg.host)}"
        subject = self.subjects.command(cfg.host)
        conf = api.ConsumerConfig(
            durable_name=durable, name=durable, filter_subject=subject,
            ack_policy=api.AckPolicy.EXPLICIT, ack_wait=cfg.ack_wait,
            max_ack_pending=cfg.max_ack_pending, deliver_policy=api.DeliverPolicy.ALL,
            # unbounded on the server on purpose: past max_deliver JetStream drops a command
            # silently. The bound is the agent's (command_attempts): a command that keeps failing
            # is answered failed with its reason, and acked.
            max_deliver=-1,
        )
        last: BaseException | None = None
        for attempt in range(SUBSCRIBE_ATTEMPTS):  # a JetStream leader election answers with timeouts
            try:
                await asyncio.wait_for(self.bus.js.add_consumer(self.subjects.stream_cmd, conf), NET_TIMEOUT_S)
                return await asyncio.wait_for(
                    self.bus.js.pull_subscribe_bind(durable=durable, stream=self.subjects.stream_cmd),
                    NET_TIMEOUT_S,
                )
            except nats.js.errors.NotFoundError as e:
                stream = self.subjects.stream_cmd
                raise AgentStartError(f"stream {stream} does not exist (provision first)") from e
            except (TimeoutError, nats.errors.Error) as e:
                last = e
                log.warning("creating consumer %s failed (%r); retrying", durable, e, extra={"host": cfg.host})
                await asyncio.sleep(min(SUBSCRIBE_BACKOFF_MAX_S, 0.5 * 2**attempt))
        raise AgentStartError(f"cannot create consumer {durable}: {last!r}") from last

    # ------------------------------------------------------------------ HTTP
    async def _start_http(self) -> None:
        """/metrics (this agent's registry), /livez, /readyz on the shared health server."""
        health = HealthServer(host=self.config.http_host, port=self.config.http_port,
                              ready=lambda: self.ready, registry=self.metrics.registry)
        try:
            await health.start()
        except OSError as e:
            raise AgentStartError(f"cannot listen on {self.config.http_host}:{self.config.http_port}: "
                                  f"{e.strerror}") from e
        self._health = health
        self.http_port = health.port

    async def _start_kubelet(self) -> None:
        """The kubelet endpoint kubectl logs reaches through the API server (services/agent/kubelet.py)."""
        cfg = self.config
        if not cfg.kubelet_tls_cert:
            return
        names = tuple(n.strip() for n in cfg.kubelet_client_names.split(",") if n.strip())
        console = tuple(n.strip() for n in cfg.console_client_names.split(",") if n.strip())
        tls = KubeletTls(cfg.kubelet_tls_cert, cfg.kubelet_tls_key, cfg.kubelet_client_ca, names, console)
        server = KubeletServer(self.ledger, self.driver, cfg.host, tls,
                               listen=cfg.kubelet_listen or self.host_ip or "127.0.0.1", port=cfg.kubelet_port)
        try:
            await server.start()
        except (OSError, ValueError) as e:
            where = f"{server.listen}:{cfg.kubelet_port}"
            raise AgentStartError(f"cannot serve the kubelet endpoint on {where}: {e}") from e
        self.kubelet = server

    # ------------------------------------------------------------------ publishing
    def _next_id(self) -> int:
        self._seq += 1
        return self._seq

    async def _report(self, kind: str, fence: Fence, payload: msgspec.Struct, msg_id: str) -> None:
        assert self.bus is not None
        # the subject names this host: NATS lets this agent's user publish only under it (rule 4's
        # "a report's host is bound to its sender"), and the reconciler refuses a report naming another
        subject = self.subjects.host_report(Key.parse(fence.key), self.config.host)
        await publish_input(self.bus.js, subject, encode(payload), msg_id=msg_id)
        self.metrics.reports.labels(kind=kind).inc()

    async def _publish_verified(self, subject: str, data: bytes, msg_id: str) -> None:
        assert self.bus is not None
        await publish_input(self.bus.js, subject, data, msg_id=msg_id)

    async def _publish_probe(self, p: ProbeChanged) -> None:
        f = p.fence
        msg_id = f"probe:{self.config.host}:{p.vm_id}:{f.uid}:{f.epoch}:{self.boot}:{self._next_id()}"
        await self._report("probe", p.fence, p, msg_id)
        log.info("probe changed: ready=%s", p.ready, extra=fence_fields(p.fence, p.vm_id, event="probe"))

    # ------------------------------------------------------------------ commands
    async def _consume(self, psub: Any) -> None:
        cfg = self.config
        inflight: set[asyncio.Task[None]] = set()
        async with asyncio.TaskGroup() as tg:
            while not self._stopping.is_set():
                free = cfg.max_concurrency - len(inflight)
                if free <= 0:
                    stop_wait = tg.create_task(self._stopping.wait())
                    await asyncio.wait({*inflight, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
                    stop_wait.cancel()
                    continue
                try:
                    msgs = await psub.fetch(free, timeout=cfg.fetch_timeout)
                except TimeoutError:
                    continue
                except (nats.errors.Error, OSError) as e:
                    log.warning("fetch failed: %r", e, extra={"host": cfg.host})
                    await self._sleep(FETCH_ERROR_BACKOFF_S)
                    continue
                for msg in msgs:  # tasks start in order: per-VM locks are taken in stream order
                    if (msg.headers or {}).get(H_KIND) == VERIFY_KIND:
                        assert self.verifier is not None
                        t = tg.create_task(self.verifier.handle(msg, before=set(inflight)))
                    else:
                        t = tg.create_task(self._handle(msg))
                    inflight.add(t)
                    t.add_done_callback(inflight.discard)
            if inflight:
                log.info("stopping: %d commands in flight", len(inflight), extra={"host": cfg.host})
                _, pending = await asyncio.wait(set(inflight), timeout=cfg.shutdown_timeout)
                # not acked: redelivered to the next agent process
                await cancel_and_wait(pending, what="command")

    async def _handle(self, msg: Msg) -> None:
        assert self.executor is not None and self.bus is not None
        try:
            cmd = decode_command(msg.data)
            validate_command(cmd, self.config.host)
        except (msgspec.DecodeError, msgspec.ValidationError, Malformed) as e:
            await self._dead_letter(msg, f"malformed command: {e}")
            return
        keepalive = asyncio.create_task(self._keepalive(msg))  # owned: cancelled in finally
        try:
            result, replayed = await self.executor.execute(cmd)
        except Exception as e:
            if self.config.sim_faults and type(e).__name__ == "AgentCrash":
                os._exit(137)  # injected "agent died between effect and report" (sim faults only)
            given_up = await self._failed_execution(msg, cmd, e)
            if given_up is None:
                return
            result, replayed = given_up, False
        finally:
            keepalive.cancel()
        if replayed:
            self.metrics.redeliveries.inc()
        else:
            self.metrics.commands.labels(op=cmd.op, result=result.outcome).inc()
        assert self.prober is not None
        new_run = result.outcome == "ok" and cmd.op in ("create", "start", "wake", "adopt") and not replayed
        if not new_run:
            self.prober.kick(cmd.vm_id)
        # a refusal below the floor is an answer to *this copy* only: it must not take the command
        # id's Msg-Id, or the stream's dedupe would drop the real result of the newer writer's
        # copy, sent right after (the key would wait a duplicate window, or for ever)
        msg_id = result.command_id if result.floor == 0 else f"{result.command_id}|refused:{cmd.gen}<{result.floor}"
        ready = await self.prober.first_readiness(cmd.vm_id, result.fence) if new_run and cmd.op != "adopt" else None
        if ready is not None:  # decided with the binding (one status write); the ledger keeps it without
            result = msgspec.structs.replace(result, ready=ready)
        told = None  # the readiness the published result carries
        try:
            await self._report("result", result.fence, result, msg_id)
            told = ready
        except (AppendFailed, nats.errors.Error, TimeoutError) as e:
            log.warning("result not published (%r); redelivery will republish it", e, extra=cmd_fields(cmd))
            await self._nak(msg, self._retry_delay(msg))
            return
        finally:
            if new_run:
                # only now: a probe of the new run published before its result would be decided
                # before the binding and dropped (not bound yet), the VM not Ready until an inventory
                self.prober.restart(cmd.vm_id, None if told is None else (result.fence, told))
        await self._ack(msg)

    def _retry_delay(self, msg: Msg) -> float:
        return retry_delay(delivered(msg), self.config.retry_base, self.config.retry_max)

    async def _failed_execution(self, msg: Msg, cmd: Command, e: Exception) -> CommandResult | None:
        """The command raised ``e``: redelivered later (exponential backoff, None) while the error may
        heal and deliveries are left (``command_attempts``), else answered ``failed`` with the reason."""
        assert self.executor is not None
        n, bound = delivered(msg), self.config.command_attempts
        if heals(e) and n < bound:
            delay = self._retry_delay(msg)
            if n == 1:
                log.exception("command failed (delivery 1 of %d); retrying in %.1fs", bound, delay,
                              extra=cmd_fields(cmd))
            else:
                log.warning("command failed again (%r; delivery %d of %d); retrying in %.1fs", e, n, bound,
                            delay, extra=cmd_fields(cmd))
            self.metrics.command_retries.inc()
            await self._nak(msg, delay)
            return None
        if heals(e):
            why = f"cannot be executed after {n} deliveries: {type(e).__name__}: {e}"
        else:
            why = f"cannot be executed: {type(e).__name__}: {e}"
        if not self.ledger.writable:
            why += " (the agent's ledger cannot be written)"
        log.error("command %s: failed: %s", cmd.op, why, exc_info=not heals(e), extra=cmd_fields(cmd, outcome="failed"))
        return await self.executor.give_up(cmd, why)

    async def _keepalive(self, msg: Msg) -> None:
        """Long ops (migration) outlive ack_wait: tell the server the command is being worked on."""
        while True:
            await asyncio.sleep(self.config.ack_wait / 3)
            with contextlib.suppress(nats.errors.Error, TimeoutError):
                await msg.in_progress()

    async def _ack(self, msg: Msg) -> None:
        """A command whose ack is lost (a node or consumer leader away) is redelivered only after
        ack_wait, and counts as unfinished until then: the ack is retried for a while first."""
        retry = Retry(budget_s=min(ACK_RETRY_S, self.config.ack_wait / 2))
        while True:
            try:
                await msg.ack_sync(timeout=NET_TIMEOUT_S)
                return
            except (nats.errors.Error, TimeoutError) as e:
                if not await retry.backoff(stop=self._stopping):
                    log.warning("ack failed (%r, %d tries): the command will be redelivered and answered "
                                "from the ledger", e, retry.attempt, extra={"host": self.config.host})
                    return

    async def _nak(self, msg: Msg, delay: float) -> None:
        with contextlib.suppress(nats.errors.Error, TimeoutError):
            await msg.nak(delay=delay)

    async def _dead_letter(self, msg: Msg, reason: str) -> None:
        assert self.bus is not None
        log.warning("dead-lettering: %s", reason, extra={"host": self.config.host, "event": "dlq"})
        self.metrics.commands.labels(op="unknown", result="malformed").inc()
        try:
            await dead_letter(self.bus.js, self.subjects, source=DLQ_SOURCE, reason=reason,
                              subject=msg.subject, data=msg.data, headers=msg.headers)
        except (AppendFailed, nats.errors.Error, TimeoutError) as e:
            log.warning("dead letter not stored (%r); redelivering", e)
            await self._nak(msg, self._retry_delay(msg))
            return
        await self._ack(msg)

    # ------------------------------------------------------------------ runtime events
    async def _events(self, events: Any) -> None:
        """Runtime exits/losses → VMExited/VMGone under the ledger's owner fence, one task per
        event so a long command on one VM does not hold up events of the others."""
        async with asyncio.TaskGroup() as tg:
            async for ev in events:
                tg.create_task(self._on_event(ev))

    async def _on_event(self, ev: VMExitedEvent | VMGoneEvent) -> None:
        assert self.executor is not None
        host = self.config.host
        try:
            if isinstance(ev, VMExitedEvent):
                fence = await self.executor.on_exited(ev.vm_id, ev.exit_code)
                if fence is not None:
                    payload = VMExited(fence=fence, host=host, vm_id=ev.vm_id, exit_code=ev.exit_code)
                    msg_id = f"exit:{host}:{ev.vm_id}:{self.boot}:{self._next_id()}"
                    if await self._report_until_stored("exited", fence, payload, msg_id):
                        log.info("VM exited (code %s)", ev.exit_code,
                                 extra=fence_fields(fence, ev.vm_id, event="exited"))
            else:
                fence = await self.executor.on_gone(ev.vm_id)
                if fence is not None:
                    await self._publish_gone(fence, ev.vm_id)
        except Exception:
            log.exception("runtime event not reported", extra={"vm_id": ev.vm_id})

    async def _liveness_failed(self, vm_id: str, fence: Fence) -> None:
        """The pod's livenessProbe failed its threshold: stop the VM (only while ``fence`` owns it) and
        report the exit as the VM's own, so the reconciler restarts it by the pod's restartPolicy — as
        a kubelet kills a container."""
        assert self.executor is not None
        ex = self.executor
        async with ex.locks.hold(vm_id):
            row = self.ledger.vm(vm_id)
            if row is None or row.fence != fence or row.state not in ("running", "paused"):
                return
            log.warning("liveness probe failed: stopping the VM", extra=fence_fields(fence, vm_id, event="liveness"))
            await ex.timed(self.driver.stop(vm_id))
        await self._on_event(VMExitedEvent(vm_id=vm_id, exit_code=None, signal=9))

    async def _report_until_stored(self, kind: str, fence: Fence, payload: msgspec.Struct, msg_id: str) -> bool:
        """A runtime event happens once: nothing would report it again, so its report is retried
        (same Msg-Id) until JetStream stores it or the agent stops. False if it stopped first; the
        next inventory still shows the VM's state."""
        attempt = 0
        while True:
            try:
                await self._report(kind, fence, payload, msg_id)
                return True
            except (AppendFailed, nats.errors.Error, TimeoutError) as e:
                delay = min(REPORT_RETRY_MAX_S, backoff_delay(attempt))
                attempt += 1
                log.warning("%s report not stored (%r); retrying in %.1fs", kind, e, delay,
                            extra=fence_fields(fence, getattr(payload, "vm_id", None), event=kind))
                if await self._sleep(delay):
                    return False

    async def _publish_gone(self, fence: Fence, vm_id: str) -> None:
        host = self.config.host
        if await self._report_until_stored("gone", fence, VMGone(fence=fence, host=host, vm_id=vm_id),
                                           f"gone:{host}:{vm_id}"):
            log.warning("VM gone: the runtime no longer knows it", extra=fence_fields(fence, vm_id, event="gone"))

    # ------------------------------------------------------------------ inventory & heartbeat
    async def _answer_queries(self) -> None:
        """Answer ``vmfence verify``'s inventory queries and ``vmfence vnc``'s display questions
        (read-only; ended with the connection)."""
        assert self.bus is not None
        await self.bus.nc.subscribe(self.subjects.inventory_query(self.config.host),
                                    cb=inventory_responder(self.config.host, self.ledger, self.driver))
        await self.bus.nc.subscribe(self.subjects.vnc_query(self.config.host),
                                    cb=vnc_responder(self.config.host, self.ledger, self.config.vnc_listen))

    async def inventory(self) -> str:
        """Publish one Inventoried per VM (ledger plus runtime) and return the round id."""
        assert self.executor is not None
        self._round += 1
        round_id = f"{self.config.host}-{self.boot}-{self._round}"
        host = self.config.host
        listed = {i.vm_id: i for i in await asyncio.wait_for(self.driver.list(), self.config.op_timeout)}
        for known in self.ledger.vms():
            if known.vm_id not in listed and known.state not in TRANSIENT_STATES:
                lost = await self.executor.check_gone(known.vm_id)
                if lost is not None:
                    await self._publish_gone(lost, known.vm_id)
        named, cfg = 0, self.config
        async for vm_id, fence, state in round_items(self.ledger, listed, cfg.inventory_rate, cfg.inventory_interval,
                                                     self._sleep):
            named += 1
            ready = self.prober.readiness(vm_id, fence) if self.prober is not None and state == "running" else None
            payload = Inventoried(fence=fence, host=host, vm_id=vm_id, state=state, round=round_id, ready=ready)
            await self._report("inventory", fence, payload, f"inv:{round_id}:{vm_id}")
        if self._stopping.is_set():
            return round_id  # left incomplete, as an agent that died in it would leave it
        # a lost VM's VMGone may never have been stored (the agent died first): rounds repeat it a while
        for tomb in self.ledger.lost(since=time.time() - LOST_REPORTED_S):
            payload = Inventoried(fence=tomb.fence, host=host, vm_id=tomb.vm_id, state="lost", round=round_id)
            await self._report("inventory", tomb.fence, payload, f"inv:{round_id}:{tomb.vm_id}")
        self.metrics.set_vms([r.state for r in self.ledger.vms()])
        log.info("inventory round %s: %d VMs", round_id, named, extra={"host": host, "event": "inventory"})
        return round_id

    async def _first_heartbeat(self) -> None:
        """The first heartbeat, waiting (within the startup bound) for the hosts bucket: in a stack
        whose services start together the reconciler that provisions it may not have yet."""
        attempt = 0
        while True:
            try:
                await self.heartbeat()
                return
            except (nats.js.errors.BucketNotFoundError, TimeoutError, nats.errors.NoRespondersError,
                    nats.js.errors.NoStreamResponseError, nats.js.errors.ServiceUnavailableError) as exc:
                # not there yet (provisioning), or there with no stream leader yet (an R3 stream
                # just created, an election after a node loss): the same wait, not a failed start
                delay = min(SUBSCRIBE_BACKOFF_MAX_S, 0.25 * 2**attempt)
                attempt += 1
                why = ("does not exist yet (provisioning?)" if isinstance(exc, nats.js.errors.BucketNotFoundError)
                       else f"did not answer ({exc!r})")
                log.warning("hosts bucket %s %s; retrying in %.1fs", self.subjects.kv_hosts, why, delay,
                            extra={"host": self.config.host})
                if await self._sleep(delay):
                    return

    async def heartbeat(self) -> None:
        """Capacity and usage into KV ``<prefix>_hosts`` under the host name."""
        assert self.bus is not None
        cfg = self.config
        if self._kv is None:
            self._kv = await asyncio.wait_for(self.bus.js.key_value(self.subjects.kv_hosts), NET_TIMEOUT_S)
        # a ledger that cannot be written takes no new VM: nothing is free here until it heals
        # (the probe also notices the heal when no command writes)
        writable = await self.ledger.probe_write()
        self.metrics.ledger_writable.set(1 if writable else 0)
        rows = self.ledger.vms()
        used = [r for r in rows if r.state not in ("exited",)]
        cpus_free = max(0, cfg.cpus - sum(r.spec.cpus for r in used)) if writable else 0
        memory_free = max(0, cfg.memory_mib - sum(r.spec.memory_mib for r in used)) if writable else 0
        if not writable:
            log.warning("heartbeat: ledger not writable (%s): no capacity offered, not ready",
                        self.ledger.write_error, extra={"host": cfg.host, "event": "ledger_unwritable"})
        hb = HostHeartbeat(
            host=cfg.host, runtime=self.driver.name,
            cpus_total=cfg.cpus, cpus_free=cpus_free, memory_total_mib=cfg.memory_mib,
            memory_free_mib=memory_free, vms=len(rows), at=time.time(), accel=getattr(self.driver, "accel", None),
            ip=self.host_ip or (self.kubelet.listen if self.kubelet is not None else None), network=cfg.network,
            kubelet_port=self.kubelet.port if self.kubelet is not None else None,
            # the host's own figures (the Node's capacity); cpus_total/memory_total are what VMs may take
            cpus_capacity=max(cfg.cpus, host_cpus()), memory_capacity_mib=max(cfg.memory_mib, host_memory_mib()),
        )
        await asyncio.wait_for(self._kv.put(cfg.host, encode(hb)), NET_TIMEOUT_S)
        self.metrics.reports.labels(kind="heartbeat").inc()
        self.metrics.set_vms([r.state for r in rows])

    @property
    def host_ip(self) -> str | None:
        """This host's address (the Node's InternalIP): --host-ip, else the pod network's gateway."""
        if self.config.host_ip:
            return self.config.host_ip
        return self.network.gateway if self.network.taps else None  # the sim's pool is on no interface

    async def collect(self) -> None:
        """One collector pass (see services/agent/collect.py)."""
        if self.collector is not None:
            await self.collector.collect()

    async def _every(self, interval: float, fn: Any) -> None:
        """Run ``fn`` every ``interval`` s until stopping; a failed round is logged, not fatal."""
        while not await self._sleep(interval):
            try:
                await fn()
            except Exception as e:
                log.warning("%s failed: %r", getattr(fn, "__name__", fn), e, extra={"host": self.config.host})

    async def _sleep(self, seconds: float) -> bool:
        """Sleep, waking early on stop; True if stopping."""
        return await sleep_unless_set(self._stopping, seconds)


# ---------------------------------------------------------------------------------- CLI


async def _serve(config: AgentConfig) -> None:
    agent = Agent(config)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, agent.stop)
    await agent.run()


def main(argv: list[str] | None = None) -> int:
    """``vmfence agent``: 0 after a clean stop, 2 on a bad configuration, 1 if it cannot start."""
    config = start(AgentConfig, argv)
    if config is None:
        return EXIT_CONFIG
    try:
        run_main(_serve(config))
    except AgentStartError as e:
        print(f"{config.PROG}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # includes ExceptionGroup from the task group: logged in full above
        log.exception("agent crashed")
        first: BaseException = e
        while isinstance(first, BaseExceptionGroup) and first.exceptions:
            first = first.exceptions[0]
        print(f"{config.PROG}: error: {first!r}", file=sys.stderr)
        return 1
    return 0
