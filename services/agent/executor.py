"""Command execution: the one runner of the agent's ops, and the only code that calls the runtime's
effects.

Each op is a step (services/agent/ops): it looks at the ledger row and the runtime, acts only on the
difference and records the result by command id together with the ledger change, so a crash anywhere
is recovered by running the same command again (rule 11). The runner owns what every step shares:

- the per-VM lock (work on one VM is serial, different VMs run concurrently);
- the ledger replay: a redelivery is answered with the stored result;
- the fence checks, looked up in the kernel's tables (shared/fence/agentfence.py, rule 4): the key's
  mark, a buried vm_id (never brought back), the VM's owner fence;
- the runtime's doubts as outcomes: an inconclusive inspect answers ``inconclusive``, a failed or
  timed-out one ``failed`` (or ``inconclusive`` for ops that change nothing);
- intent before effect: a VM coming up has its ``creating``/``waking`` row in the ledger before the
  runtime is called (a SIGKILL mid-create leaves a row the inventory reports) and is looked at again
  when the runtime fails; a VM going away is ``removing``/``hibernating`` first and put back when
  the runtime fails.

``adopt`` carries a newer fence by design and moves ownership only after the runtime confirms the
VM exists (rule 8).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from typing import TypeVar

import msgspec

from services.agent.labels import fence_labels, labels_fence
from services.agent.ledger import ADDRESS_KIND, TRANSIENT_STATES, Claim, Ledger, VMRow
from services.agent.logs import cmd_fields, fence_fields
from services.agent.network import HostNetwork
from services.agent.ops import OPS, Answer
from services.agent.runtime import (
    DisplayPool,
    ImageError,
    Inconclusive,
    NetAttach,
    RuntimeDriver,
    RuntimeFailure,
    VMInfo,
    VMSpec,
    resolve_image,
)
from shared.fence.agentfence import fence_verdict, floor_verdict, mark_verdict, raises_mark, refusal
from shared.fence.keys import DEFAULT_PARTITIONS, partition_of
from shared.fence.schema import (
    MAX_INPUT_BYTES,
    NO_INCARNATION,
    Command,
    CommandResult,
    Fence,
    Inventoried,
    PartitionVerified,
    PartitionVerify,
    ResultOutcome,
)

log = logging.getLogger("vmfence.agent.executor")

T = TypeVar("T")

__all__ = ["NEW_VM_OPS", "Executor", "VMLocks", "labels_fence"]

# ops that make a VM this host did not have: refused while the ledger cannot record them
NEW_VM_OPS = ("create", "wake")


class VMLocks:
    """FIFO per-vm_id locks: work on one VM is serial, different VMs run concurrently.

    Entries are reference counted and dropped when nobody holds or waits, so the map does not grow
    with every vm_id ever seen.
    """

    def __init__(self) -> None:
        self._locks: dict[str, tuple[asyncio.Lock, int]] = {}

    @asynccontextmanager
    async def hold(self, vm_id: str) -> AsyncIterator[None]:
        lock, n = self._locks.get(vm_id, (asyncio.Lock(), 0))
        self._locks[vm_id] = (lock, n + 1)
        try:
            async with lock:
                yield
        finally:
            lock, n = self._locks[vm_id]
            if n <= 1:
                del self._locks[vm_id]
            else:
                self._locks[vm_id] = (lock, n - 1)

    def busy(self, vm_id: str) -> bool:
        return vm_id in self._locks


@dataclass
class Executor:
    """Runs commands against one driver and ledger; see the module docstring for the rules."""

    ledger: Ledger
    driver: RuntimeDriver
    host: str
    snapshot_dir: str
    image_dir: str = ""
    vnc: bool = True
    op_timeout: float = 300.0
    locks: VMLocks = field(default_factory=VMLocks)
    network: HostNetwork | None = None  # bridge networking: every new VM gets an address of its pool
    partitions: int = DEFAULT_PARTITIONS  # the deployment's partition count: a key's floor is its partition's
    _alloc: asyncio.Lock = field(default_factory=asyncio.Lock, init=False, repr=False)
    _last_ip: str | None = field(default=None, init=False, repr=False)

    # ------------------------------------------------------------------ the runner
    async def execute(self, cmd: Command) -> tuple[CommandResult, bool]:
        """The command's result and whether it was replayed from the ledger (a redelivery)."""
        step = OPS[cmd.op]
        async with self.locks.hold(cmd.vm_id):
            stored = await self.ledger.result(cmd.id) if step.replay else None
            if stored is not None:
                log.info("redelivered command answered from the ledger", extra=cmd_fields(cmd))
                return stored, True
            floor = self.ledger.floor(partition_of(cmd.fence.key, self.partitions))
            why = floor_verdict(cmd.op, cmd.gen, floor)
            if why is not None:
                # a newer writer of the partition verified this host: nothing its predecessor sent
                # may act here now. Not stored: the newer writer's own copy (if the command is in its
                # log too) runs or is answered from here
                log.info("command %s: refused (%s)", cmd.op, why, extra=cmd_fields(cmd, outcome="inconclusive"))
                return msgspec.structs.replace(self.result(cmd, "inconclusive", error=why), floor=floor), False
            if cmd.op in NEW_VM_OPS and not self.ledger.writable:
                # no intent row could be written before the effect: take no new VM (the reconciler
                # places it elsewhere); nothing is recorded, a redelivery asks again
                why = f"not taking new VMs: the agent's ledger cannot be written ({self.ledger.write_error})"
                log.warning("command %s: failed (%s)", cmd.op, why, extra=cmd_fields(cmd, outcome="failed"))
                return self.result(cmd, "failed", error=why), False
            try:
                self._check_mark(cmd)
                if raises_mark(cmd.op):
                    fence = cmd.fence
                    await self.ledger.raise_key_mark(fence.key, fence.epoch, fence.uid or NO_INCARNATION)
                row = self.ledger.vm(cmd.vm_id)
                tomb = self.ledger.tombstone(cmd.vm_id)
                self._fenced(refusal(cmd.op, cmd.fence, cmd.vm_id, row.fence if row else None,
                                     tomb.reason if tomb else None))
                result = await step.run(self, cmd, row)
            except Answer as a:
                result = await self.answer(cmd, a.outcome, a.error)
            if result.outcome not in ("ok", "not_found"):
                level = logging.WARNING
            elif step.quiet and result.outcome == "ok" and not result.found:
                level = logging.DEBUG
            else:
                level = logging.INFO
            log.log(level, "command %s: %s%s", cmd.op, result.outcome,
                    f" ({result.error})" if result.error else "",
                    extra=cmd_fields(cmd, outcome=result.outcome))
            return result, False

    async def verify(self, ask: PartitionVerify) -> PartitionVerified:
        """Raise the partition's floor to ``ask.gen`` (durably) and name the keys of the partition
        with a VM here: the ledger's rows and, for a VM the ledger lost, the runtime's labels. The
        caller lets every command handed out before ``ask`` finish first."""
        p = ask.partition
        await self.ledger.raise_floor(p, ask.gen)
        keys = {row.fence.key for row in self.ledger.vms()}
        for info in await self.timed(self.driver.list()):
            owner = labels_fence(info.labels)
            if owner is not None:
                keys.add(owner.key)
        mine = sorted(k for k in keys if partition_of(k, self.partitions) == p)
        answer = PartitionVerified(p, ask.gen, self.ledger.floor(p), self.host, mine)
        budget, size = MAX_INPUT_BYTES - 1024, 0
        for i, key in enumerate(mine):
            size += len(key.encode()) + 3
            if size > budget:
                # more than one answer carries: the host stays unverified (every new key of the
                # partition surveys it, as before verification existed)
                return msgspec.structs.replace(answer, keys=mine[:i], truncated=True)
        return answer

    async def give_up(self, cmd: Command, error: str) -> CommandResult:
        """The command cannot be executed (its retries are spent, or its error will not heal): a
        ``failed`` result with the reason, for the reconciler to decide on. Stored by command id when
        the ledger takes it (a redelivery then gets the same answer); published regardless."""
        result = self.result(cmd, "failed", error=error)
        async with self.locks.hold(cmd.vm_id):
            try:
                await self.ledger.record(result)
            except Exception as e:  # the ledger is what failed: the answer still goes out
                log.warning("failed result not stored in the ledger: %r", e, extra=cmd_fields(cmd))
        return result

    def _check_mark(self, cmd: Command) -> None:
        """A newer fence of this key was already seen here (a successor, or a rebuilt log's survey),
        or this epoch under another incarnation (the log lost the entry that gave it out): nothing
        decided under it may make or wake a VM."""
        key = cmd.fence.key
        self._fenced(mark_verdict(cmd.op, cmd.fence, self.ledger.key_mark(key), self.ledger.key_mark_uid(key)))

    @staticmethod
    def _fenced(why: str | None) -> None:
        if why is not None:
            raise Answer("fenced", why)

    # ------------------------------------------------------------------ what steps use: fences, answers
    def check_owner(self, cmd: Command, owner: Fence | None) -> None:
        """Answer ``fenced`` unless ``owner`` (e.g. read from the runtime's labels) lets the command
        touch the VM."""
        self._fenced(fence_verdict(cmd.op, cmd.fence, owner))

    def require(self, cmd: Command, row: VMRow | None) -> VMRow:
        """The ledger's row, or answer ``not_found``."""
        if row is None:
            raise Answer("not_found", f"no VM {cmd.vm_id} on {self.host}")
        return row

    def result(self, cmd: Command, outcome: ResultOutcome, *, error: str | None = None,
               info: VMInfo | None = None, snapshot: str | None = None,
               found: list[Inventoried] | None = None) -> CommandResult:
        """The command's answer, not stored (``record`` stores it): for a step whose redelivery is
        answered afresh (``Step.replay`` False)."""
        vnc_port = None
        if info is not None and info.vnc_display is not None:
            vnc_port = DisplayPool.BASE_PORT + info.vnc_display
        return CommandResult(
            fence=cmd.fence, command_id=cmd.id, op=cmd.op, host=self.host, vm_id=cmd.vm_id,
            outcome=outcome, error=error, ip=info.ip if info else None, vnc_port=vnc_port,
            snapshot=snapshot, found=found or [],
            # the newest epoch of the key this host has seen: above every epoch the key's log
            # knows, it shows the reconciler that the log lost entries (a cut nobody saw)
            key_epoch=self.ledger.key_mark(cmd.fence.key), key_uid=self.ledger.key_mark_uid(cmd.fence.key),
        )

    async def record(self, cmd: Command, outcome: ResultOutcome, *, error: str | None = None,
                     info: VMInfo | None = None, snapshot: str | None = None,
                     found: list[Inventoried] | None = None, put: VMRow | None = None,
                     bury: tuple[str, Fence] | None = None, claim: Iterable[Claim] = (),
                     transfer_to: Fence | None = None) -> CommandResult:
        """Store the command's result by its id together with its ledger change, atomically."""
        result = self.result(cmd, outcome, error=error, info=info, snapshot=snapshot, found=found)
        await self.ledger.record(result, put=put, bury=bury, claim=claim, transfer_to=transfer_to)
        return result

    async def answer(self, cmd: Command, outcome: ResultOutcome, error: str | None = None,
                     info: VMInfo | None = None) -> CommandResult:
        """Record a result that changes nothing in the ledger (fenced, not_found, failed...). A
        fenced answer names the VM's real owner, so the reconciler never mistakes it for gone."""
        row = self.ledger.vm(cmd.vm_id) if outcome == "fenced" else None
        found = [Inventoried(row.fence, self.host, row.vm_id, row.state)] if row is not None else None
        return await self.record(cmd, outcome, error=error, info=info, found=found)

    async def lost(self, cmd: Command, row: VMRow | None, error: str) -> CommandResult:
        """The runtime does not know the VM: ``not_found``, and the ledger's row (if any) buried."""
        return await self.record(cmd, "not_found", error=error, bury=("lost", row.fence) if row else None)

    async def record_up(self, cmd: Command, row: VMRow, info: VMInfo) -> CommandResult:
        """The VM is up as ``info`` says: ``ok``, its row and the reservations the runtime gave it."""
        return await self.record(cmd, "ok", info=info, put=self.row(row, info), claim=self.claims(info))

    # ------------------------------------------------------------------ what steps use: the runtime
    async def timed(self, aw: Awaitable[T]) -> T:
        async with asyncio.timeout(self.op_timeout):
            return await aw

    async def inspect(self, vm_id: str, *, failure: ResultOutcome = "failed") -> VMInfo | None:
        """What the runtime has under ``vm_id`` (None: nothing). A doubt answers the command:
        Inconclusive -> ``inconclusive``, a runtime failure or a timeout -> ``failure``."""
        try:
            return await self.timed(self.driver.inspect(vm_id))
        except Inconclusive as e:
            raise Answer("inconclusive", str(e)) from e
        except (RuntimeFailure, TimeoutError) as e:
            raise Answer(failure, f"inspect: {e or 'timeout'}") from e

    async def peek(self, vm_id: str) -> tuple[bool, VMInfo | None]:
        """``(sure, info)``: an inspect whose doubt is not an answer but "not sure" (``False, None``)."""
        try:
            return True, await self.inspect(vm_id)
        except Answer:
            return False, None

    async def effect(self, what: str, aw: Awaitable[T], *, undo: VMRow | None = None,
                     failure: ResultOutcome = "failed") -> T:
        """One runtime call, bounded by op_timeout. A failure or timeout puts ``undo`` back in the
        ledger and answers ``failure`` with what failed."""
        try:
            return await self.timed(aw)
        except (RuntimeFailure, TimeoutError) as e:
            if undo is not None:
                await self.ledger.put_vm(undo)  # back to what it was; the command may be retried
            raise Answer(failure, f"{what}: {e or 'timeout'}") from e

    async def transition(self, row: VMRow | None, state: str, what: str, call: Callable[[], Awaitable[T]]) -> T:
        """Intent before an effect that takes the VM away: its row is ``state`` first (the exit it
        causes is expected, not news), and back as it was if the runtime fails."""
        if row is not None:
            await self.ledger.set_state(row.vm_id, state)
        return await self.effect(what, call(), undo=row)

    async def bring_up(self, cmd: Command, intent: VMRow, what: str,
                       call: Callable[[], Awaitable[VMInfo]]) -> CommandResult:
        """Intent before an effect that brings a VM up: the ``intent`` row is in the ledger before
        the runtime is called (a crash from here on leaves a row the inventory reports); a failure
        is verified by looking again, so the ledger says what the runtime has."""
        row = await self.ledger.put_vm(intent)
        log.info("%s: intent recorded, calling the runtime", cmd.op, extra=cmd_fields(cmd, event=f"{cmd.op}_intent"))
        try:
            info = await self.timed(call())
        except (RuntimeFailure, TimeoutError) as e:
            return await self._failed_bringup(cmd, row, f"{what}: {e or 'timeout'}")
        return await self.record_up(cmd, row, info)

    async def _failed_bringup(self, cmd: Command, row: VMRow, error: str) -> CommandResult:
        sure, info = await self.peek(cmd.vm_id)
        if not sure:  # keep the intent row (and the address): the inventory reports it
            return await self.record(cmd, "failed", error=error)
        if info is None:
            await self.ledger.forget_vm(cmd.vm_id)
            await self.release_address(cmd.vm_id, cmd.fence)  # no VM has it: the runtime said so
            return await self.record(cmd, "failed", error=error)
        return await self.record(cmd, "failed", error=error, put=self.row(row, info), claim=self.claims(info))

    def vmspec(self, cmd: Command) -> VMSpec:
        """What the runtime is asked to run for the command; labelled with its fence. The image
        name resolves inside the image store only; anything else answers ``failed`` naming the
        field, and nothing under the name is opened."""
        spec = cmd.spec
        image = None
        if spec.image is not None:
            try:
                image = resolve_image(self.image_dir, spec.image)
            except ImageError as e:
                raise Answer("failed", f"invalid spec: {e}") from None
        return VMSpec(
            vm_id=cmd.vm_id, cpus=spec.cpus, memory_mib=spec.memory_mib, image=image, vnc=self.vnc,
            probe_port=spec.probe_port, labels=fence_labels(cmd.fence),
        )

    # ------------------------------------------------------------------ addresses (rule 9)
    async def spec_with_address(self, cmd: Command, *, snapshot: str | None = None) -> VMSpec:
        """``vmspec(cmd)`` with the VM's address on the pod network, reserved for the command's
        fence before the runtime is called (bridge networking; otherwise as ``vmspec``)."""
        spec = self.vmspec(cmd)
        net = await self.address(cmd, snapshot=snapshot)
        return msgspec.structs.replace(spec, net=net) if net is not None else spec

    async def address(self, cmd: Command, *, snapshot: str | None = None) -> NetAttach | None:
        """The address ``cmd.vm_id`` holds, or a new one reserved for ``(vm_id, cmd.fence)``. A wake
        takes over the address of the VM its snapshot came from (the restored guest has it
        configured) when that VM was the same incarnation's. A full pool answers ``failed``."""
        net = self.network
        if net is None or net.pool is None:
            return None
        pool = net.pool
        async with self._alloc:  # one allocation at a time: two VMs never pick the same address
            held = await self.ledger.held(ADDRESS_KIND)
            for ip, (vm_id, uid, epoch) in held.items():
                if vm_id == cmd.vm_id:
                    if (uid, epoch) != (cmd.fence.uid, cmd.fence.epoch):
                        raise Answer("fenced", f"address {ip} of {vm_id} is held by uid {uid} epoch {epoch}")
                    return net.attach(cmd.vm_id, ip)
            if snapshot:
                took = await self._take_snapshot_address(cmd, snapshot, held)
                if took is not None:
                    return net.attach(cmd.vm_id, took)
            picked = pool.pick(held.keys(), after=self._last_ip)
            if picked is None:
                raise Answer("failed", f"address pool {pool.subnet} of {self.host} is full: all {pool.size} "
                                       f"addresses are held by VMs")
            ip = picked
            await self.ledger.reserve(ADDRESS_KIND, ip, cmd.vm_id, cmd.fence)
            self._last_ip = ip
        log.info("address %s reserved", ip, extra=cmd_fields(cmd, event="address_reserved"))
        return net.attach(cmd.vm_id, ip)

    async def _take_snapshot_address(self, cmd: Command, snapshot: str,
                                     held: dict[str, tuple[str, str, int]]) -> str | None:
        owner = await self.ledger.reservation_owner("snapshot", snapshot)
        if owner is None:
            log.warning("wake: the snapshot has no owner here; the restored guest keeps the address it had "
                        "and gets a new one from this host's pool", extra=cmd_fields(cmd))
            return None
        old_vm, uid, epoch = owner
        if uid != cmd.fence.uid:
            return None
        for ip, holder in held.items():
            if holder == (old_vm, uid, epoch):
                frm = (old_vm, Fence(cmd.fence.key, uid, epoch))
                if await self.ledger.move(ADDRESS_KIND, ip, frm, (cmd.vm_id, cmd.fence)):
                    log.info("wake: address %s taken over from hibernated %s", ip, old_vm,
                             extra=cmd_fields(cmd, event="address_moved"))
                    return ip
        return None

    async def reserve_runtime_addresses(self) -> int:
        """At start: the address of every VM the runtime runs that the ledger does not know (a lost
        or replaced ledger) is reserved for the fence its labels name, before any create could be
        given it; an adopt then moves it with the VM, a remove releases it. How many were reserved."""
        net = self.network
        if net is None or net.pool is None:
            return 0
        held = await self.ledger.held(ADDRESS_KIND)
        n = 0
        for info in await self.timed(self.driver.list()):
            owner = labels_fence(info.labels)
            if (info.ip is None or info.ip not in net.pool or info.ip in held or owner is None
                    or self.ledger.vm(info.vm_id) is not None):
                continue
            await self.ledger.reserve(ADDRESS_KIND, info.ip, info.vm_id, owner)
            held[info.ip] = (info.vm_id, owner.uid, owner.epoch)
            n += 1
            log.warning("address %s of %s (not in the ledger) reserved for its labels' fence", info.ip, info.vm_id,
                        extra=fence_fields(owner, info.vm_id, event="address_rediscovered"))
        return n

    async def release_address(self, vm_id: str, owner: Fence) -> None:
        """Free the address ``(vm_id, owner)`` holds (its VM is gone); nobody else's."""
        if self.network is None:
            return
        for ip, holder in (await self.ledger.held(ADDRESS_KIND)).items():
            if holder == (vm_id, owner.uid, owner.epoch):
                await self.ledger.release(ADDRESS_KIND, ip, vm_id, owner)

    async def drop_snapshot(self, snapshot: str, cmd: Command, *, successor_ok: bool = False) -> bool:
        """After a wake from ``snapshot`` took, or the removal of the hibernated VM it holds: its
        reservation released for its owner (the same incarnation, or with ``successor_ok`` a later
        epoch of the key, which the caller checked) and its files deleted."""
        owner = await self.ledger.reservation_owner("snapshot", snapshot)
        if owner is None:
            return False
        if owner[1] != cmd.fence.uid and not (successor_ok and cmd.fence.epoch > owner[2]):
            return False
        vm_id, uid, epoch = owner
        fence = Fence(cmd.fence.key, uid, epoch)
        await self.ledger.release("snapshot", snapshot, vm_id, fence)
        await asyncio.to_thread(delete_snapshot_files, snapshot)
        log.info("snapshot collected", extra=cmd_fields(cmd, event="snapshot_collected"))
        return True

    @staticmethod
    def row(row: VMRow, info: VMInfo, **changes: object) -> VMRow:
        """``row`` as the runtime's ``info`` says the VM is now."""
        return replace(row, state=info.state, pid=info.pid, vnc_display=info.vnc_display,
                       probe_host_port=info.probe_host_port, ip=info.ip, **changes)  # type: ignore[arg-type]

    def claims(self, info: VMInfo) -> list[Claim]:
        """The reservations the runtime gave the VM (rule 9); a VNC display with its password, and
        its address on the pod network (a VM adopted without a ledger row keeps the one it runs with)."""
        out = []
        if info.vnc_display is not None:
            out.append(Claim("vnc", str(info.vnc_display), info.vnc_password))
        if info.probe_host_port is not None:
            out.append(Claim("port", str(info.probe_host_port)))
        net = self.network
        if info.ip is not None and net is not None and net.pool is not None and info.ip in net.pool:
            out.append(Claim(ADDRESS_KIND, info.ip))
        return out

    # ------------------------------------------------------------------ runtime events
    async def on_exited(self, vm_id: str, exit_code: int | None) -> Fence | None:
        """Record an exit; the owner fence to report it under, or None (unknown VM, or one being
        removed/hibernated — such an exit is expected, not news)."""
        async with self.locks.hold(vm_id):
            row = self.ledger.vm(vm_id)
            if row is None or row.state in TRANSIENT_STATES or row.state == "exited":
                return None
            await self.ledger.put_vm(replace(row, state="exited", pid=None))
            return row.fence

    async def on_gone(self, vm_id: str) -> Fence | None:
        """The runtime lost a VM: tombstone it; the owner fence to report VMGone under, or None."""
        async with self.locks.hold(vm_id):
            row = self.ledger.vm(vm_id)
            if row is None or row.state in TRANSIENT_STATES:
                return None
            await self.ledger.bury(vm_id, "lost", row.fence)
            return row.fence

    async def check_gone(self, vm_id: str) -> Fence | None:
        """Inventory's look at a ledger VM the runtime did not list: gone only if inspect says so."""
        if self.locks.busy(vm_id):
            return None  # a command is working on it; its result will tell
        sure, info = await self.peek(vm_id)
        if not sure or info is not None:
            return None
        return await self.on_gone(vm_id)

    async def remove_all(self) -> int:
        """Remove every VM in the ledger (cleanup_on_stop for throw-away stacks)."""
        n = 0
        for row in self.ledger.vms():
            async with self.locks.hold(row.vm_id):
                try:
                    await self.timed(self.driver.remove(row.vm_id))
                except (RuntimeFailure, TimeoutError) as e:
                    log.warning("cleanup: remove failed: %s", e, extra=fence_fields(row.fence, row.vm_id))
                    continue
                await self.ledger.bury(row.vm_id, "removed", row.fence)
                n += 1
        return n


SNAPSHOT_SUFFIXES = ("", ".disk.qcow2", ".part", ".disk.qcow2.part")


def delete_snapshot_files(snapshot: str) -> int:
    """Delete a snapshot and its companions (disk overlay, partial files); the bytes freed."""
    freed = 0
    for suffix in SNAPSHOT_SUFFIXES:
        path = snapshot + suffix
        with contextlib.suppress(FileNotFoundError):
            freed += os.path.getsize(path)
            os.unlink(path)
    return freed
