"""Readiness and liveness probes of running VMs, each probe carrying the fence it was started under.

A probe result is published only if it changed *and* the probe's fence is still the VM's owner in
the ledger, checked right before publishing — so a probe that started before an adopt moved the VM
to a newer incarnation never reports for the superseded one (the seed provider's bug: a late probe
writing the successor's readiness).

What is probed (issue 12 §2):

- the pod's own ``readinessProbe`` (``Spec.readiness``: ``tcpSocket`` or ``httpGet``) against the
  VM's address in the ledger (its pool address on the host's bridge), with Kubernetes' timing:
  nothing before ``initialDelaySeconds`` (not ready meanwhile), one probe every ``periodSeconds``,
  each bounded by ``timeoutSeconds``, ``successThreshold`` successes in a row to become ready and
  ``failureThreshold`` failures in a row to become not ready. An ``httpGet`` succeeds on a status
  200-399 (HTTPS without verifying the guest's certificate, as a kubelet does);
- without one, the runtime's own probe (``vmfence.io/probe-port`` or the VM's run state), every
  ``--probe-interval``, as before;
- ``livenessProbe`` (``Spec.liveness``) the same way; ``failureThreshold`` failures in a row call
  ``on_liveness_failure(vm_id, fence)`` once per run of failures (the agent stops the VM there, so
  its exit is reported and the reconciler restarts it by the pod's restartPolicy, as a kubelet kills
  a container), only while the probe's fence still owns the VM. Without the hook a failure is logged.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from services.agent.ledger import Ledger, VMRow
from services.agent.logs import fence_fields
from services.agent.runtime import Inconclusive, RuntimeDriver, RuntimeFailure
from shared.fence.schema import Fence, Probe, ProbeChanged
from shared.tasks import cancel_and_wait

log = logging.getLogger("vmfence.agent.probes")

PROBED_STATES = ("running", "paused")
# the probe whose verdict a bring-up's result carries holds that result back: a short bound (a VM
# not answering by then is reported not ready, and the sweep reports it ready later)
FIRST_PROBE_S = 0.25
SWEEP_WORKERS = 16  # runtime probes in flight at once (a probe that hangs holds one until its timeout)

Publish = Callable[[ProbeChanged], Awaitable[None]]
LivenessFailed = Callable[[str, Fence], Awaitable[None]]

HTTP_HEADER_LIMIT = 8192  # bytes of an HTTP answer read to find its status line
_INSECURE_TLS = ssl.create_default_context()
_INSECURE_TLS.check_hostname = False
_INSECURE_TLS.verify_mode = ssl.CERT_NONE


async def check(probe: Probe, ip: str) -> bool:
    """One probe of ``ip``: a TCP connect (tcpSocket) or an HTTP GET answered 200-399 (httpGet),
    the whole of it within ``probe.timeout_s``. Never raises for what the guest does."""
    try:
        async with asyncio.timeout(probe.timeout_s):
            tls = _INSECURE_TLS if probe.kind == "http" and probe.scheme == "HTTPS" else None
            reader, writer = await asyncio.open_connection(ip, probe.port, ssl=tls)
            try:
                if probe.kind == "tcp":
                    return True
                host = f"[{ip}]" if ":" in ip else ip
                writer.write(f"GET {probe.path} HTTP/1.1\r\nHost: {host}:{probe.port}\r\n"
                             f"User-Agent: vmfence-probe/1\r\nAccept: */*\r\nConnection: close\r\n\r\n".encode())
                await writer.drain()
                line = await reader.readline()
                if len(line) > HTTP_HEADER_LIMIT:
                    return False
                parts = line.decode("latin-1").split()
                return len(parts) >= 2 and parts[0].startswith("HTTP/") and parts[1].isdigit() \
                    and len(parts[1]) == 3 and 200 <= int(parts[1]) < 400
            finally:
                writer.close()
                try:
                    await writer.wait_closed()
                except (OSError, ssl.SSLError):
                    pass
    except (OSError, TimeoutError, ssl.SSLError, ValueError, UnicodeError):
        return False


class Streak:
    """Kubernetes' thresholds: ``success`` results in a row turn a probe's verdict good, ``failure``
    in a row turn it bad; anything between keeps the last verdict (``start``)."""

    def __init__(self, success: int, failure: int, start: bool) -> None:
        self.success, self.failure = success, failure
        self.verdict = start
        self._ok = self._bad = 0

    def add(self, ok: bool) -> bool:
        if ok:
            self._ok, self._bad = self._ok + 1, 0
            if self._ok >= self.success:
                self.verdict = True
        else:
            self._ok, self._bad = 0, self._bad + 1
            if self._bad >= self.failure:
                self.verdict = False
        return self.verdict


@dataclass(eq=False)
class _Swept:
    """A VM probed by the sweep: queued or not, its probes under way, what was last reported for
    it, and a generation that ``restart`` moves on, so that a probe begun before the restart is not
    reported."""

    gen: int = 0
    reported: tuple[Fence, bool] | None = None
    queued: bool = False
    probing: int = 0  # one at a time, but for a restart's, which does not wait for its past's


def _own_probe(row: VMRow) -> bool:
    """Does the VM's spec carry a probe of its own (its own timing, so a loop of its own)?"""
    return row.spec.readiness is not None or row.spec.liveness is not None


class Prober:
    """Probes every running VM, inside its own TaskGroup (no ownerless tasks).

    A VM whose spec has a readiness or liveness probe gets a loop of its own (its own period,
    thresholds and delay). Every other VM is *swept*: each ``interval`` it is queued once, and
    ``SWEEP_WORKERS`` long-lived tasks probe the queue through the runtime. A sweep costs one timer
    per probe (its timeout) instead of a task wake-up, a sleep's timer and a timeout's timer per VM,
    which is what a host with thousands of VMs spent most of its idle time on."""

    def __init__(self, ledger: Ledger, driver: RuntimeDriver, host: str, publish: Publish, *,
                 interval: float, timeout: float, on_liveness_failure: LivenessFailed | None = None) -> None:
        self.ledger = ledger
        self.driver = driver
        self.host = host
        self.publish = publish
        self.interval = interval
        self.timeout = timeout
        self.on_liveness_failure = on_liveness_failure
        self._kick = asyncio.Event()
        self._tasks: dict[str, asyncio.Task[None]] = {}  # the one current loop per VM (a replaced one ends itself)
        self._swept: dict[str, _Swept] = {}  # the VMs the sweep probes
        self._due: asyncio.Queue[str] = asyncio.Queue()  # swept VMs to probe now, each at most once
        self._touched: set[str] = set()
        self._probed: dict[str, tuple[Fence, bool]] = {}  # vm_id -> its last readiness, and the fence

    def readiness(self, vm_id: str, fence: Fence) -> bool | None:
        """The readiness last probed for ``vm_id`` under ``fence`` while it runs (inventories repeat
        it: a ProbeChanged may have been decided before the VM's binding, reordered by a redelivery)."""
        got = self._probed.get(vm_id)
        return got[1] if got is not None and got[0] == fence else None

    def kick(self, vm_id: str | None = None) -> None:
        """The ledger changed for ``vm_id`` (a command finished): start/stop its probing now, not at
        the next full sweep. Only that VM is looked at, so a bring-up of N VMs costs O(N)."""
        if vm_id is not None:
            self._touched.add(vm_id)
        self._kick.set()

    async def first_readiness(self, vm_id: str, fence: Fence) -> bool | None:
        """The runtime's probe of a VM just brought up under ``fence``, for its result to carry
        (``CommandResult.ready``), when the sweep probes it by its run state. None for a VM another
        fence owns, with a probe of its own (its thresholds and delay decide, in its loop), whose
        readiness is its guest's (``probe_port``: a guest still booting would only hold the result
        back, then say no), or not running."""
        row = self.ledger.vm(vm_id)
        if (row is None or row.fence != fence or row.state not in PROBED_STATES or _own_probe(row)
                or row.spec.probe_port is not None):
            return None
        ready = await self._runtime_probe(vm_id, fence, min(self.timeout, FIRST_PROBE_S))
        # what inventories repeat from now on, even one taken before the result's publish returns
        self._probed[vm_id] = (fence, ready)
        return ready

    def restart(self, vm_id: str, reported: tuple[Fence, bool] | None = None) -> None:
        """The VM was (re)started: probe it afresh, so its readiness is reported again even if an
        exit and restart both fell between two probes (the reconciler forgot readiness at the exit).
        ``reported``: the readiness its published result carried (``first_readiness``), which the
        sweep then reports only when it changes."""
        task = self._tasks.pop(vm_id, None)
        if task is not None:
            task.cancel()
        swept = self._swept.get(vm_id)
        if swept is None and reported is not None:
            swept = self._swept[vm_id] = _Swept()
        if swept is not None:
            swept.gen += 1
            swept.reported = reported
            self._queue(vm_id, swept, fresh=True)
        self.kick(vm_id)

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        async with asyncio.TaskGroup() as tg:
            workers = [tg.create_task(self._sweeper(), name=f"probe-sweep-{i}") for i in range(SWEEP_WORKERS)]
            try:
                next_sweep = 0.0
                while True:
                    if loop.time() >= next_sweep:
                        self._sync(tg)
                        next_sweep = loop.time() + self.interval
                    else:
                        for vm_id in self._touched:
                            self._sync_one(tg, vm_id)
                    self._touched.clear()
                    self._kick.clear()
                    try:
                        await asyncio.wait_for(self._kick.wait(), max(0.0, next_sweep - loop.time()))
                    except TimeoutError:
                        pass
            finally:  # each ended for sure: a TaskGroup cancels only once, and waits for all
                await cancel_and_wait([*self._tasks.values(), *workers], what="probe loop")

    def _sync_one(self, tg: asyncio.TaskGroup, vm_id: str) -> None:
        row = self.ledger.vm(vm_id)
        probed = row is not None and row.state in PROBED_STATES
        self._place(tg, vm_id, probed=probed, own=probed and row is not None and _own_probe(row))

    def _sync(self, tg: asyncio.TaskGroup) -> None:
        """Every VM in its place, and every swept VM queued: one round of the sweep."""
        probed = {r.vm_id: _own_probe(r) for r in self.ledger.vms() if r.state in PROBED_STATES}
        for vm_id in (self._tasks.keys() | self._swept.keys()) - probed.keys():
            self._place(tg, vm_id, probed=False, own=False)
        for vm_id, own in probed.items():
            self._place(tg, vm_id, probed=True, own=own)

    def _place(self, tg: asyncio.TaskGroup, vm_id: str, *, probed: bool, own: bool) -> None:
        """A probed VM with a probe of its ``own`` gets a loop; any other probed VM is swept, and
        queued for its next probe; a VM not probed has neither, nor a readiness to repeat."""
        task = self._tasks.get(vm_id)
        if task is not None and (task.done() or not (probed and own)):
            task.cancel()
            del self._tasks[vm_id]
            task = None
        if probed and own and task is None:
            self._tasks[vm_id] = tg.create_task(self._loop(vm_id), name=f"probe-{vm_id}")
        if probed and not own:
            self._queue(vm_id, self._swept.setdefault(vm_id, _Swept()))
        else:
            self._swept.pop(vm_id, None)
        if not probed:
            self._probed.pop(vm_id, None)

    def _queue(self, vm_id: str, swept: _Swept, *, fresh: bool = False) -> None:
        """Queue a swept VM, unless it is queued or being probed (``fresh``: of its past)."""
        if not swept.queued and (fresh or not swept.probing):
            swept.queued = True
            self._due.put_nowait(vm_id)

    async def _sweeper(self) -> None:
        """One of the sweep's workers: probes queued VMs one at a time, for ever."""
        while True:
            vm_id = await self._due.get()
            swept = self._swept.get(vm_id)
            if swept is not None:
                swept.queued = False
                swept.probing += 1
                try:
                    await self._sweep_one(vm_id, swept)
                finally:
                    swept.probing -= 1

    async def _sweep_one(self, vm_id: str, swept: _Swept) -> None:
        row = self.ledger.vm(vm_id)
        if row is None or row.state not in PROBED_STATES:
            return  # the next sync forgets it
        fence, gen = row.fence, swept.gen  # the fence this probe runs under
        ready = await self._runtime_probe(vm_id, fence)
        if self._swept.get(vm_id) is not swept or swept.gen != gen:
            return  # restarted, or no longer swept, while it was probed: a result of the VM's past
        reported = await self._report(vm_id, fence, ready, swept.reported)
        if swept.gen == gen:
            swept.reported = reported

    async def _runtime_probe(self, vm_id: str, fence: Fence, timeout: float | None = None) -> bool:  # noqa: ASYNC109
        """The runtime's own probe, within ``timeout`` (default: the probes'); whatever fails is not ready."""
        try:
            # asyncio.timeout, not wait_for: no task per probe (one probe per VM per interval
            # is the agent's largest cost that grows with its VMs)
            async with asyncio.timeout(self.timeout if timeout is None else timeout):
                return await self.driver.probe(vm_id)
        except (RuntimeFailure, Inconclusive, TimeoutError) as e:
            log.debug("probe failed: %s", e, extra=fence_fields(fence, vm_id))
            return False

    async def _report(self, vm_id: str, fence: Fence, ready: bool,
                      reported: tuple[Fence, bool] | None) -> tuple[Fence, bool] | None:
        """Publish ``ready`` under ``fence`` if it is not what was ``reported`` and the fence still
        owns the VM, checked right before publishing; returns what is reported now."""
        if self.ledger.owner(vm_id) != fence:
            log.info("probe result dropped: its fence was superseded",
                     extra=fence_fields(fence, vm_id, event="probe_superseded"))
            return reported
        if reported == (fence, ready):
            return reported
        self._probed[vm_id] = (fence, ready)
        try:
            await self.publish(ProbeChanged(fence=fence, host=self.host, vm_id=vm_id, ready=ready))
        except Exception as e:  # the next round retries
            log.warning("probe change not published: %r", e, extra=fence_fields(fence, vm_id))
            return reported
        return (fence, ready)

    async def _loop(self, vm_id: str) -> None:
        """Probe a VM with a probe of its own until it stops being probed or this loop is replaced.
        A replaced loop was cancelled, but on Python 3.11 a cancel racing a publish's answer can be
        swallowed (see shared.tasks): it then ends here, rather than probe on beside its successor."""
        reported: tuple[Fence, bool] | None = None
        loop = asyncio.get_running_loop()
        started = loop.time()  # the loop starts with the VM's run (restart() replaces it)
        streaks: dict[tuple[Fence, Probe], Streak] = {}
        next_live = 0.0
        while self._tasks.get(vm_id) is asyncio.current_task():
            row = self.ledger.vm(vm_id)
            if row is None or row.state not in PROBED_STATES:
                self._probed.pop(vm_id, None)  # a VM not probed has no readiness to repeat
                return
            fence = row.fence  # the fence this probe runs under
            readiness, liveness = row.spec.readiness, row.spec.liveness
            now = loop.time()
            if liveness is not None and row.ip and now >= next_live and now - started >= liveness.initial_delay_s:
                next_live = now + liveness.period_s
                await self._live(vm_id, fence, liveness, row.ip, streaks)
            if readiness is not None and row.ip:
                wait = started + readiness.initial_delay_s - loop.time()
                if wait > 0:
                    ready, delay = False, wait  # not ready before initialDelaySeconds, as in Kubernetes
                else:
                    streak = streaks.setdefault(
                        (fence, readiness), Streak(readiness.success_threshold, readiness.failure_threshold, False))
                    ready, delay = streak.add(await check(readiness, row.ip)), float(readiness.period_s)
            else:
                ready, delay = await self._runtime_probe(vm_id, fence), self.interval
            if liveness is not None and row.ip:
                delay = min(delay, max(0.0, next_live - loop.time()) or liveness.period_s)
            reported = await self._report(vm_id, fence, ready, reported)
            await asyncio.sleep(delay)

    async def _live(self, vm_id: str, fence: Fence, probe: Probe, ip: str,
                    streaks: dict[tuple[Fence, Probe], Streak]) -> None:
        """One liveness probe; ``failureThreshold`` failures in a row, under a fence that still owns
        the VM, call the hook once (the streak starts again after it)."""
        key = (fence, probe)
        streak = streaks.setdefault(key, Streak(probe.success_threshold, probe.failure_threshold, True))
        if streak.add(await check(probe, ip)):
            return
        del streaks[key]  # counted afresh after the restart it asks for
        if self.ledger.owner(vm_id) != fence:
            return
        log.warning("liveness probe failed %d times in a row", probe.failure_threshold,
                    extra=fence_fields(fence, vm_id, event="liveness_failed"))
        if self.on_liveness_failure is not None:
            try:
                await self.on_liveness_failure(vm_id, fence)
            except Exception as e:  # the next failure asks again
                log.warning("liveness restart not carried out: %r", e, extra=fence_fields(fence, vm_id))
