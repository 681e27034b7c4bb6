"""Readiness and liveness probes: one loop per running VM, each carrying the fence it was started under.

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

from services.agent.ledger import Ledger
from services.agent.logs import fence_fields
from services.agent.runtime import Inconclusive, RuntimeDriver, RuntimeFailure
from shared.fence.schema import Fence, Probe, ProbeChanged
from shared.tasks import cancel_and_wait

log = logging.getLogger("vmfence.agent.probes")

PROBED_STATES = ("running", "paused")

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


class Prober:
    """Supervises per-VM probe loops inside its own TaskGroup (no ownerless tasks)."""

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
        self._touched: set[str] = set()
        self._probed: dict[str, tuple[Fence, bool]] = {}  # vm_id -> its last readiness, and the fence

    def readiness(self, vm_id: str, fence: Fence) -> bool | None:
        """The readiness last probed for ``vm_id`` under ``fence`` while it runs (inventories repeat
        it: a ProbeChanged may have been decided before the VM's binding, reordered by a redelivery)."""
        got = self._probed.get(vm_id)
        return got[1] if got is not None and got[0] == fence else None

    def kick(self, vm_id: str | None = None) -> None:
        """The ledger changed for ``vm_id`` (a command finished): start/stop its loop now, not at
        the next full sweep. Only that VM is looked at, so a bring-up of N VMs costs O(N)."""
        if vm_id is not None:
            self._touched.add(vm_id)
        self._kick.set()

    def restart(self, vm_id: str) -> None:
        """The VM was (re)started: probe it afresh, so its readiness is reported again even if an
        exit and restart both fell between two probes (the reconciler forgot readiness at the exit)."""
        task = self._tasks.pop(vm_id, None)
        if task is not None:
            task.cancel()
        self.kick(vm_id)

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        async with asyncio.TaskGroup() as tg:
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
                await cancel_and_wait(list(self._tasks.values()), what="probe loop")

    def _sync_one(self, tg: asyncio.TaskGroup, vm_id: str) -> None:
        row = self.ledger.vm(vm_id)
        task = self._tasks.get(vm_id)
        wanted = row is not None and row.state in PROBED_STATES
        if task is not None and (task.done() or not wanted):
            task.cancel()
            del self._tasks[vm_id]
            task = None
        if wanted and task is None:
            self._tasks[vm_id] = tg.create_task(self._loop(vm_id), name=f"probe-{vm_id}")

    def _sync(self, tg: asyncio.TaskGroup) -> None:
        want = {r.vm_id for r in self.ledger.vms() if r.state in PROBED_STATES}
        for vm_id, task in list(self._tasks.items()):
            if task.done() or vm_id not in want:
                task.cancel()
                del self._tasks[vm_id]
        for vm_id in want - self._tasks.keys():
            self._tasks[vm_id] = tg.create_task(self._loop(vm_id), name=f"probe-{vm_id}")

    async def _loop(self, vm_id: str) -> None:
        """Probe until the VM stops being probed or this loop is replaced. A replaced loop was
        cancelled, but on Python 3.11 a cancel racing a publish's answer can be swallowed (see
        shared.tasks): it then ends here, rather than probe on beside its successor."""
        last: dict[Fence, bool] = {}
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
                delay = self.interval
                try:
                    # asyncio.timeout, not wait_for: no task per probe (one probe per VM per interval
                    # is the agent's largest cost that grows with its VMs)
                    async with asyncio.timeout(self.timeout):
                        ready = await self.driver.probe(vm_id)
                except (RuntimeFailure, Inconclusive, TimeoutError) as e:
                    log.debug("probe failed: %s", e, extra=fence_fields(fence, vm_id))
                    ready = False
            if liveness is not None and row.ip:
                delay = min(delay, max(0.0, next_live - loop.time()) or liveness.period_s)
            # right before publishing: is this probe's fence still the owner?
            if self.ledger.owner(vm_id) != fence:
                log.info("probe result dropped: its fence was superseded",
                         extra=fence_fields(fence, vm_id, event="probe_superseded"))
            elif last.get(fence) != ready:
                self._probed[vm_id] = (fence, ready)
                try:
                    await self.publish(ProbeChanged(fence=fence, host=self.host, vm_id=vm_id, ready=ready))
                    last[fence] = ready
                except Exception as e:  # the next round retries
                    log.warning("probe change not published: %r", e, extra=fence_fields(fence, vm_id))
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
