"""The reconciler process: partition leases, one Partition per lease held, effects, snapshots.

Partitions are shared fairly among live reconcilers: each registers a member entry in the leases
bucket, takes free partitions up to its fair share, and hands back surplus when others join. A
lease is renewed by compare-and-set on its KV revision; the moment a renewal fails the partition
stops appending (its fenced appends would fail anyway: rule 1 does not depend on the lease).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import msgspec
import nats.errors
import nats.js.errors
from nats.js.kv import KeyValue

from services.reconciler import metrics
from services.reconciler.config import ReconcilerConfig
from services.reconciler.effects import EffectRunner
from services.reconciler.hosts import HostsView, worth_checking
from services.reconciler.images import ImageStore
from services.reconciler.kube import KubeGateway
from services.reconciler.partition import Partition
from services.reconciler.snapshot import SnapshotStore
from shared.bus.connect import Bus, NatsAuthError
from shared.bus.leases import LeaseLost, PartitionLease
from shared.bus.provision import ProvisionFailed, StreamsConfig, provision
from shared.bus.retry import backoff_delay
from shared.config import EXIT_CONFIG, start
from shared.fence.decide import PLACE_RETRY_S, DecideEnv, HostView
from shared.fence.drift import DriftReport, HostVM, InventoryAnswer, drift
from shared.fence.keys import Key
from shared.fence.schema import Input, TimerArmed
from shared.fence.state import KeyState
from shared.httpserve import HealthServer, ListenError
from shared.subjects import Subjects
from shared.tasks import cancel_and_wait, run_main, sleep_unless_set, unless_set

log = logging.getLogger(__name__)
T = TypeVar("T")


class StoppedDuringStartup(Exception):
    """SIGTERM arrived while JetStream was still being waited for."""

MEMBER_PREFIX = "member."
FLEET_LEASE = "fleet"
FLEET_SYNC_S = 2.0
INVENTORY_QUERY_TIMEOUT_S = 5.0  # one host's inventory answer (as `vmfence verify` waits)
DRIFT_REPORTED = 5  # drift items named in the warning line of one check
RELEASE_FLUSH_S = 5.0  # logging the deferred completions of a partition handed over
# after the number of members changes, a reconciler below its share runs its lease rounds this often
# (instead of every third of the lease TTL) for this long: enough for the others' hand-overs
SETTLING_ROUND_S = 0.25
SETTLING_S = 15.0
_answer = msgspec.json.Decoder(InventoryAnswer)


class Reconciler:
    def __init__(
        self,
        cfg: ReconcilerConfig,
        *,
        gateway: KubeGateway | None = None,
        health: bool = True,
    ) -> None:
        self.cfg = cfg
        self.writer = cfg.owner_id()
        self.subjects = Subjects(cfg.prefix, cfg.partitions)
        self._gateway = gateway
        self._health_enabled = health
        self.partitions: dict[int, Partition] = {}
        self._tasks: dict[int, asyncio.Task[None]] = {}
        self._leases: dict[int, PartitionLease] = {}
        self._members = 0  # live reconcilers at the last lease round
        self._settle_until = 0.0  # loop time: the membership changed lately (see SETTLING_S)
        self._short_until = 0.0  # loop time: lease rounds are SETTLING_ROUND_S apart until then
        # set when a lease or a member entry goes (a release, a graceful leave): the next lease round
        # runs at once, so what a stopping reconciler handed back waits no round for its taker
        self._lease_gone = asyncio.Event()
        self.hosts = HostsView(stale_after_s=cfg.host_stale_s)
        self._stop = asyncio.Event()
        self.ready = asyncio.Event()
        self.bus: Bus | None = None
        self.health: HealthServer | None = None
        self.effects: EffectRunner | None = None
        self.snapshots: SnapshotStore | None = None
        self.images: ImageStore | None = None
        self.drift_counts: dict[str, int] | None = None  # by kind, at the last drift check
        self.bind_unscheduled = cfg.bind_unscheduled != "off"  # "auto" is settled once the gateway is up
        metrics.DRIFT.watch(self)

    def __hash__(self) -> int:  # held in the drift gauge's WeakSet by identity
        return id(self)

    # ------------------------------------------------------------------ environment
    def env(self) -> DecideEnv:
        return DecideEnv(
            hosts=self.hosts.live(),
            restart_backoff_base_s=self.cfg.restart_backoff_base_s,
            writer=self.writer,
            bind_unscheduled=self.bind_unscheduled,
        )

    def owns(self, p: int) -> bool:
        part = self.partitions.get(p)
        return part is not None and part.held

    async def _feed(self, key: str, inp: Input) -> bool:
        part = self.partitions.get(self.subjects.partition(key))
        return part is not None and await part.feed(key, inp)

    def _host_network(self, host: str) -> str | None:
        h = self.hosts.hosts.get(host)
        return h.beat.network if h is not None else None

    def _host_ip(self, host: str) -> str | None:
        h = self.hosts.hosts.get(host)
        return h.beat.ip if h is not None else None

    def stop(self) -> None:
        self._stop.set()

    # --------------------------------------------------------------------------- run
    async def run(self) -> None:
        cfg = self.cfg
        self.bus = bus = await Bus.open(
            cfg.nats_url, name=f"vmfence-reconciler-{self.writer}", subjects=self.subjects, auth=cfg.nats_auth,
        )
        try:
            streams = StreamsConfig(replicas=cfg.replicas, partitions=cfg.partitions, lease_ttl_s=cfg.lease_ttl_s)  # type: ignore[arg-type]
            await self._until_done("provision the streams", lambda: provision(bus.js, self.subjects, streams))
            info = await self._until_done("read the log stream", lambda: bus.js.stream_info(self.subjects.stream_log))
            identity = f"{info.config.name}:{info.created}" if hasattr(info, "created") else info.config.name or ""
            self.snapshots = SnapshotStore(os.path.join(cfg.data_dir, f"snapshot-{self.safe_id()}.sqlite"))
            await self.snapshots.open(stream_identity=str(identity))
            self.images = ImageStore(bus.js, self.subjects, stream_identity=str(identity), writer=self.writer)
            gateway = self._gateway or await _default_gateway(cfg, self._host_ip, self._host_network)
            self.bind_unscheduled = await _bind_unscheduled(cfg, gateway)
            log.info("pods without a nodeName: %s", "placed and bound by vmfence" if self.bind_unscheduled
                     else "left to the scheduler")
            self.effects = EffectRunner(
                bus.js, self.subjects, gateway, workers=cfg.effect_workers, owns=self.owns, feed=self._feed,
                gen=self._gen,
            )
            leases_kv = await self._until_done("open the leases", lambda: bus.js.key_value(self.subjects.kv_leases))
            hosts_kv = await self._until_done("open the hosts", lambda: bus.js.key_value(self.subjects.kv_hosts))
            if self._health_enabled:
                self.health = HealthServer(host=cfg.http_host, port=cfg.http_port, ready=self.ready.is_set)
                await self.health.start()
            async with asyncio.TaskGroup() as tg:
                hosts_task = tg.create_task(self.hosts.watch(hosts_kv))
                effects_task = tg.create_task(self.effects.run())
                snap_task = tg.create_task(self._snapshot_loop())
                lease_task = tg.create_task(self._lease_loop(leases_kv, tg))
                lease_watch = tg.create_task(self._watch_leases(leases_kv))
                fleet_task = tg.create_task(self._fleet_loop(leases_kv, gateway))
                drift_task = tg.create_task(self._drift_loop())
                place_task = tg.create_task(self._place_again(self.effects))
                await self._stop.wait()
                await cancel_and_wait([drift_task, place_task, lease_task, lease_watch], what="lease loop")
                await self._release_all()
                await cancel_and_wait([fleet_task, snap_task, hosts_task, effects_task], what="reconciler loop")
                self.drift_counts = None  # holds no keys: judges nothing
                self.effects.close()
            with contextlib.suppress(Exception):
                await leases_kv.delete(MEMBER_PREFIX + self.safe_id())
            if self._gateway is None:
                await gateway.close()
        finally:
            # a run that ends any way at all (a crash, a cancelled task) holds nothing and judges
            # nothing: the process's gauges must not keep reporting its last figures
            self.drift_counts = None
            for part in self.partitions.values():
                part.held = False
            if self.health is not None:
                await self.health.stop()
            if self.snapshots is not None:
                await self.snapshots.close()
            await bus.close()

    async def _until_done(self, what: str, step: Callable[[], Awaitable[T]]) -> T:
        """A startup step against JetStream, retried while it is slow or away (a lost answer, a
        leader election, a cut link): a reconciler that exits here would only be restarted into the
        same wait. Not ready meanwhile; SIGTERM still ends it."""
        attempt = 0
        while True:
            try:
                return await self._unless_stopped(step())
            except (ProvisionFailed, nats.errors.Error, TimeoutError) as exc:
                delay = backoff_delay(attempt)
                attempt += 1
                if not self._stop.is_set():
                    log.warning("could not %s (%r); retrying in %.1fs", what, exc, delay)
                if await sleep_unless_set(self._stop, delay):
                    raise StoppedDuringStartup from exc

    async def _unless_stopped(self, aw: Awaitable[T]) -> T:
        """``aw``, abandoned the moment stop() is called: a startup step waiting out a JetStream
        request timeout (several, for provisioning) would otherwise hold a SIGTERM for as long."""
        step = await unless_set(aw, self._stop, what="startup step")
        if step is None:
            raise StoppedDuringStartup
        return step.result()

    def safe_id(self) -> str:
        return "".join(ch if ch.isalnum() or ch in "-_" else "_" for ch in self.writer)

    # ------------------------------------------------------------------------ leases
    async def _lease_loop(self, kv: KeyValue, tg: asyncio.TaskGroup) -> None:
        interval = max(0.2, self.cfg.lease_ttl_s / 3)
        member = PartitionLease(kv, MEMBER_PREFIX + self.safe_id(), self.writer, ttl_hint_s=self.cfg.lease_ttl_s)
        while True:
            self._lease_gone.clear()  # what goes from here on wakes the next round
            try:
                await self._lease_round(kv, member, tg)
            except asyncio.CancelledError:
                raise
            except (nats.errors.Error, nats.js.errors.Error, TimeoutError) as exc:
                log.warning("lease round failed: %r", exc)
            # below our share while the membership settles, the partitions a member hands back are
            # taken within SETTLING_ROUND_S, not at our next round: their inputs wait meanwhile
            # (a third of the lease TTL was most of an 8 s stall of a burst in the fleet bench)
            settling = self._short_until > asyncio.get_running_loop().time()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(min(interval, SETTLING_ROUND_S) if settling else interval):
                    await self._lease_gone.wait()

    async def _watch_leases(self, kv: KeyValue) -> None:
        """Wake the lease loop when a partition lease or a member entry is deleted: a reconciler
        that stops hands its partitions back and leaves, and its partitions' inputs wait until
        someone's next round takes them (a third of the TTL, 3.3 s by default, in the middle of a
        rolling restart). Headers only; the renewals it also sees are a few a second."""
        delay = 1.0
        while True:
            watcher = None
            try:
                watcher = await kv.watchall(meta_only=True)
                async for entry in watcher:
                    delay = 1.0  # a watch that delivers is healthy
                    if entry is not None and entry.operation in ("DEL", "PURGE"):
                        self._lease_gone.set()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the watch died (a server restart, a permission missing): the
                # rounds go on meanwhile, and it is tried again less and less often
                log.warning("lease watch restarting in %.0f s: %r", delay, exc)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 60.0)
            finally:
                if watcher is not None:
                    with contextlib.suppress(Exception):
                        await watcher.stop()  # type: ignore[no-untyped-call]

    async def _lease_round(self, kv: KeyValue, member: PartitionLease, tg: asyncio.TaskGroup) -> None:
        # membership: how many reconcilers share the partitions
        try:
            if member.revision is None:
                await member.acquire()
            else:
                await member.renew()
        except LeaseLost:
            await member.acquire()
        members = max(await self._count_members(), 1)
        share = math.ceil(self.cfg.partitions / members)
        if self.cfg.max_partitions:
            share = min(share, self.cfg.max_partitions)
        now = asyncio.get_running_loop().time()
        if members != self._members:
            self._members, self._settle_until = members, now + SETTLING_S
        # short rounds only while the membership settles and we hold less than our share
        self._short_until = self._settle_until if len(self._leases) < share else 0.0
        # renew what we hold
        for p, lease in list(self._leases.items()):
            try:
                await lease.renew()
            except LeaseLost:
                log.error("lease lost; stopping partition", extra={"partition": p})
                metrics.LEASE_LOST.labels(self.writer).inc()
                await self._drop(p, release=False)
        # hand back surplus (highest numbers first), take free ones up to the share
        surplus = sorted(self._leases, reverse=True)[: max(0, len(self._leases) - share)]
        # side by side: each hand-over flushes its partition's deferred completions first
        async with asyncio.TaskGroup() as drops:
            for p in surplus:
                drops.create_task(self._drop(p, release=True))
        if len(self._leases) < share:
            won: list[tuple[int, PartitionLease]] = []
            for p in range(self.cfg.partitions):
                if len(self._leases) + len(won) >= share:
                    break
                if p in self._leases:
                    continue
                lease = PartitionLease(kv, p, self.writer, ttl_hint_s=self.cfg.lease_ttl_s)
                if await lease.acquire() is not None:
                    won.append((p, lease))
            # loaded side by side: each reads its partition's log since our last snapshot of it
            # (after a hand-over, thousands of entries: 0.4 s each in the fleet bench)
            async with asyncio.TaskGroup() as loads:
                for p, lease in won:
                    loads.create_task(self._take_or_hand_back(p, lease, tg))
        metrics.PARTITIONS_OWNED.labels(self.writer).set(len(self._leases))
        if not self.ready.is_set():
            self.ready.set()

    async def _count_members(self) -> int:
        """Live member entries, from the bucket stream's per-subject counts: one API call, no
        consumer (KeyValue.keys() leaves one consumer behind per call in nats-py 2.16)."""
        assert self.bus is not None
        bucket = self.subjects.kv_leases
        info = await self.bus.js.stream_info(f"KV_{bucket}", subjects_filter=f"$KV.{bucket}.{MEMBER_PREFIX}>")
        subjects = info.state.subjects or {}
        # a deleted or expired member leaves a delete marker or nothing; count live values only
        live = 0
        for subject in subjects:
            entry_key = subject.removeprefix(f"$KV.{bucket}.")
            try:
                entry = await self.bus.js.get_last_msg(f"KV_{bucket}", subject)
            except nats.js.errors.NotFoundError:
                continue
            op = (entry.headers or {}).get("KV-Operation")
            if op not in ("DEL", "PURGE") and entry_key.startswith(MEMBER_PREFIX):
                live += 1
        return live

    async def _take(self, p: int, lease: PartitionLease, tg: asyncio.TaskGroup) -> None:
        assert self.bus is not None and self.effects is not None
        part = Partition(
            p, js=self.bus.js, subjects=self.subjects, writer=self.writer, effects=self.effects,
            snapshots=self.snapshots, images=self.images, env=self.env, on_placed=self.hosts.placed,
            confirm=self.effects.gateway.confirm,
            ack_wait_s=self.cfg.ack_wait_s, max_ack_pending=self.cfg.max_ack_pending,
            fetch_batch=self.cfg.fetch_batch, gen=lease.revision or 0, done_linger_s=self.cfg.done_linger_s,
        )
        self._leases[p] = lease
        self.partitions[p] = part
        try:
            await part.load()
        except BaseException:
            # not ours after all: held by no task, it must not be renewed (its inputs would wait
            # forever); handed back for the next round, ours or another's
            part.held = False
            self._leases.pop(p, None)
            self.partitions.pop(p, None)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(lease.release(), RELEASE_FLUSH_S)
            raise
        log.info("partition taken (caught up %d entries)", part.stats["caught_up"], extra={"partition": p})
        self._tasks[p] = tg.create_task(part.run(), name=f"partition-{p}")

    async def _take_or_hand_back(self, p: int, lease: PartitionLease, tg: asyncio.TaskGroup) -> None:
        """``_take``; a load the bus failed hands the lease back (the next round tries again) and
        leaves the other partitions' loads going."""
        try:
            await self._take(p, lease, tg)
        except (nats.errors.Error, nats.js.errors.Error, TimeoutError) as exc:
            log.warning("partition not taken, its load failed: %r", exc, extra={"partition": p})

    def _gen(self, p: int) -> int:
        """The generation this process writes partition ``p`` under (0: not ours)."""
        part = self.partitions.get(p)
        return part.gen if part is not None else 0

    async def _drop(self, p: int, *, release: bool) -> None:
        part = self.partitions.pop(p, None)
        lease = self._leases.pop(p, None)
        task = self._tasks.pop(p, None)
        if part is not None and release and part.held:
            # handed over on purpose, the lease still ours: log what is deferred rather than leave
            # the next owner to make those writes again
            with contextlib.suppress(Exception):
                await asyncio.wait_for(part.flush_deferred(older_than_s=0), RELEASE_FLUSH_S)
        if part is not None:
            await part.stop(task, settle=release)
        elif task is not None:
            await cancel_and_wait([task], what="partition")
        if part is not None:
            # what it fetched and did not answer goes to the next owner now, not after ack_wait
            with contextlib.suppress(Exception):
                await asyncio.wait_for(part.hand_back(), RELEASE_FLUSH_S)
        if self.effects is not None:
            self.effects.cancel_partition(p)
        if part is not None and release:
            with contextlib.suppress(Exception):
                await part.flush()
            with contextlib.suppress(Exception):  # for whoever takes it next (images.py)
                await asyncio.wait_for(part.put_image(), RELEASE_FLUSH_S)
        if lease is not None and release:
            with contextlib.suppress(Exception):
                await lease.release()

    async def _release_all(self) -> None:
        async with asyncio.TaskGroup() as drops:  # side by side: each waits out its last fetch
            for p in list(self.partitions):
                drops.create_task(self._drop(p, release=True))
        metrics.PARTITIONS_OWNED.labels(self.writer).set(0)

    async def _fleet_loop(self, kv: KeyValue, gateway: KubeGateway) -> None:
        """Writes that belong to no pod key (virtual Nodes) are made by whoever holds ``fleet``."""
        from services.reconciler.kube import K8sGateway
        from services.reconciler.nodes import sync_nodes

        if not isinstance(gateway, K8sGateway):
            return
        lease = PartitionLease(kv, FLEET_LEASE, self.writer, ttl_hint_s=self.cfg.lease_ttl_s)
        interval = max(0.2, min(self.cfg.lease_ttl_s / 3, FLEET_SYNC_S))
        while True:
            try:
                if lease.revision is None:
                    await lease.acquire()
                else:
                    await lease.renew()
                if lease.revision is not None:
                    await sync_nodes(gateway.api, self.hosts.ages(), stale_after_s=self.cfg.host_stale_s)
            except asyncio.CancelledError:
                with contextlib.suppress(Exception):
                    await lease.release()
                raise
            except LeaseLost:
                pass
            except Exception as exc:
                log.warning("fleet sync failed: %r", exc)
            await asyncio.sleep(interval)

    # ------------------------------------------------------------------------- hosts
    async def _place_again(self, effects: EffectRunner) -> None:
        """When a host comes live or reports more room, the pods waiting for one that it could take
        (``decide.placeable``), and the keys waiting for any live host to survey, are checked at
        once rather than at the end of their backoff (``decide.place_retry_s``, up to a minute); at
        most once per PLACE_RETRY_S. A pod bound to a dead node is not checked each time another
        host frees room: in a busy fleet that would undo its backoff."""
        while True:
            await self.hosts.roomier.wait()
            roomier = self.hosts.take_roomier()
            views = [h for h in self.hosts.live() if h.name in roomier]
            fired = effects.fire_host_waits(functools.partial(self._worth_checking, views))
            if fired:
                log.info("a host came live or has more room: %d check(s) for a host now", fired)
                metrics.PLACE_CHECKS_EARLY.inc(fired)
            await asyncio.sleep(PLACE_RETRY_S)  # a bound on the rate, not a synchronisation

    def _worth_checking(self, hosts: list[HostView], key: str, timer: TimerArmed) -> bool:
        part = self.partitions.get(self.subjects.partition(key))
        slot = part.keys.get(key) if part is not None else None
        return worth_checking(hosts, slot.peek() if slot is not None else None, timer)

    # ------------------------------------------------------------------------- drift
    async def _drift_loop(self) -> None:
        """Every ``drift_interval_s``: the held keys against every live host's inventory."""
        interval = self.cfg.drift_interval_s
        if interval <= 0:
            return
        while True:
            await asyncio.sleep(interval)  # a period, not a synchronisation
            try:
                await self.check_drift()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("drift check failed: %r", exc)

    async def check_drift(self) -> DriftReport | None:
        """One look, as `vmfence verify` takes it (services/cli/verify.py) but over the keys this
        reconciler holds: each reconciler judges its own partitions, whose states it has in memory
        (no fold of the whole log, no lease to wait for, and a check goes on while any reconciler
        runs). A host's VM is judged by the holder of its key's partition (a VM naming no key, by
        the holder of partition 0); quarantined keys are left out (their state is unknown, and
        ``vmfence_quarantined_keys`` says so). API objects are not listed here: the object kinds
        stay 0 and are `vmfence verify`'s. None when no partition is held."""
        assert self.bus is not None
        held = [part for part in list(self.partitions.values()) if part.held]
        if not held:
            self.drift_counts = None
            return None
        hosts = [h.name for h in self.hosts.live()]
        # the hosts first, the log's states after: a VM created meanwhile is in the log before any host has it
        answers = await asyncio.gather(*(self._inventory(h) for h in hosts))
        mine = {part.p for part in held}
        quarantined: set[str] = set()
        states: dict[str, KeyState] = {}
        for part in held:
            quarantined |= part.quarantined.keys()
            for i, (key, slot) in enumerate(list(part.keys.items())):
                state = slot.peek()
                if state.vms:
                    states[key] = state
                if i % 1000 == 999:
                    await asyncio.sleep(0)

        def judged_here(vm: HostVM) -> bool:
            if vm.key in quarantined:
                return False
            try:
                p = self.subjects.partition(Key.parse(vm.key))
            except ValueError:
                p = 0
            return p in mine

        inventories = {h: None if vms is None else [vm for vm in vms if judged_here(vm)]
                       for h, vms in zip(hosts, answers, strict=True)}
        report = drift(states, inventories, [], last_entry_s={}, now_s=time.time())
        counts = dict.fromkeys(metrics.DRIFT_KINDS, 0)
        for d in report.drift:
            counts[d.kind] += 1
        self.drift_counts = counts
        metrics.DRIFT_CHECKS.labels("drift" if report.drift else "clean").inc()
        if report.drift:
            named = "; ".join(f"{d.kind} {d.key or '-'} {d.host or '-'} {d.vm_id or '-'}"
                              for d in report.drift[:DRIFT_REPORTED])
            more = len(report.drift) - DRIFT_REPORTED
            log.warning("drift: %d between the log and the hosts: %s%s", len(report.drift), named,
                        f" (and {more} more)" if more > 0 else "", extra={"event": "drift"})
        return report

    async def _inventory(self, host: str) -> list[HostVM] | None:
        """A host's inventory over core NATS request/reply; None if it did not answer in time."""
        assert self.bus is not None
        try:
            msg = await self.bus.nc.request(self.subjects.inventory_query(host), b"", timeout=INVENTORY_QUERY_TIMEOUT_S)
            answer = _answer.decode(msg.data)
        except (nats.errors.Error, TimeoutError, msgspec.DecodeError):
            return None
        return list(answer.vms) if answer.host == host else None

    async def _snapshot_loop(self) -> None:
        """Snapshots every --snapshot-interval; images every --image-interval (0: at hand-overs only)."""
        loop = asyncio.get_running_loop()
        next_images = loop.time() + self.cfg.image_interval_s
        while True:
            await asyncio.sleep(self.cfg.snapshot_interval_s)
            images = self.cfg.image_interval_s > 0 and loop.time() >= next_images
            if images:
                next_images = loop.time() + self.cfg.image_interval_s
            for part in list(self.partitions.values()):
                try:
                    await part.flush()
                    if images:
                        await part.put_image()
                except Exception as exc:
                    log.warning("snapshot or image failed: %r", exc, extra={"partition": part.p})


async def _default_gateway(cfg: ReconcilerConfig, host_ip: Callable[[str], str | None],
                           host_network: Callable[[str], str | None] | None = None) -> KubeGateway:
    from services.reconciler.kube import K8sGateway, NullGateway

    if cfg.kube == "none":
        return NullGateway()
    return await K8sGateway.connect(kubeconfig=cfg.kubeconfig, host_ip=host_ip, host_network=host_network,
                                    instance=cfg.owner_id())


async def _bind_unscheduled(cfg: ReconcilerConfig, gateway: KubeGateway) -> bool:
    """--bind-unscheduled: on/off as given; auto binds only where no scheduler runs — the
    development API server (its gitVersion says so) or no Kubernetes at all (benchmarks)."""
    from services.reconciler.kube import DEV_SERVER_MARK, K8sGateway

    if cfg.bind_unscheduled != "auto":
        return cfg.bind_unscheduled == "on"
    if not isinstance(gateway, K8sGateway):
        return True
    return DEV_SERVER_MARK in await gateway.git_version()


def main(argv: list[str] | None = None) -> int:
    cfg = start(ReconcilerConfig, argv)
    if cfg is None:
        return EXIT_CONFIG
    return run_main(_main(cfg))


async def _main(cfg: ReconcilerConfig) -> int:
    rec = Reconciler(cfg)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, rec.stop)
    try:
        await rec.run()
    except StoppedDuringStartup:
        log.info("stopped before the reconciler was ready")
    except (NatsAuthError, ListenError) as exc:
        print(f"{cfg.PROG}: error: {exc}", file=sys.stderr)
        return 1
    except (OSError, nats.errors.NoServersError) as exc:
        print(f"{cfg.PROG}: error: cannot reach NATS at {cfg.nats_display}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
