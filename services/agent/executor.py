"""Command execution: the only code that calls the runtime driver's effects.

Every op has the same shape — *look* (the stored result, the ledger's owner fence, the runtime),
*act* only on the difference, *record* the result by command id together with the ledger change —
so a crash anywhere is recovered by running the same command again (rule 11), and intent is in the
ledger before the side effect (a SIGKILL mid-create leaves a ``creating`` row the inventory reports).

Fences (rule 4): a command older than the VM's owner is ``fenced``; a ``remove`` with exactly the
owner's fence is cleanup and allowed; ``adopt`` carries a newer fence by design and moves ownership
only after the runtime confirms the VM exists (rule 8). A removed, hibernated or lost vm_id is
tombstoned and never brought back by a late ``create``/``start``/``wake``.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from typing import TypeVar

from services.agent.ledger import TRANSIENT_STATES, Ledger, VMRow
from services.agent.logs import cmd_fields, fence_fields
from services.agent.runtime import (
    DisplayPool,
    Inconclusive,
    RuntimeDriver,
    RuntimeFailure,
    VMInfo,
    VMSpec,
)
from shared.fence.agentfence import fence_verdict, mark_verdict, raises_mark, refusal
from shared.fence.schema import NO_INCARNATION, Command, CommandResult, Fence, Inventoried, Spec

log = logging.getLogger("vmfence.agent.executor")

T = TypeVar("T")

LABEL_KEY = "vmfence.io/key"
LABEL_UID = "vmfence.io/uid"
LABEL_EPOCH = "vmfence.io/epoch"
UP_STATES = ("running", "paused")
Outcome = str


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


def labels_fence(labels: dict[str, str]) -> Fence | None:
    """The fence a VM was created under, from its runtime labels (when the ledger lost it)."""
    try:
        return Fence(labels[LABEL_KEY], labels[LABEL_UID], int(labels[LABEL_EPOCH]))
    except (KeyError, ValueError):
        return None


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

    # ------------------------------------------------------------------ entry point
    async def execute(self, cmd: Command) -> tuple[CommandResult, bool]:
        """The command's result and whether it was replayed from the ledger (a redelivery)."""
        async with self.locks.hold(cmd.vm_id):
            # a survey is a question about now: a redelivered one is answered afresh (it changes no
            # VM), never from the ledger — a stored answer may predate a VM a lost log tail made
            stored = None if cmd.op == "survey" else await self.ledger.result(cmd.id)
            if stored is not None:
                log.info("redelivered command answered from the ledger", extra=cmd_fields(cmd))
                return stored, True
            fence = cmd.fence
            why = mark_verdict(cmd.op, fence, self.ledger.key_mark(fence.key), self.ledger.key_mark_uid(fence.key))
            if why is not None:
                # a newer fence of this key was already seen here (a successor, or a rebuilt log's
                # survey), or this epoch under another incarnation (the log lost the entry that gave
                # it out): nothing decided under it may make or wake a VM
                result: CommandResult = await self._answer(cmd, "fenced", why)
            else:
                if raises_mark(cmd.op):
                    await self.ledger.raise_key_mark(fence.key, fence.epoch, fence.uid or NO_INCARNATION)
                handler = getattr(self, f"_op_{cmd.op}")
                result = await handler(cmd)
            level = logging.INFO if result.outcome in ("ok", "not_found") else logging.WARNING
            log.log(level, "command %s: %s%s", cmd.op, result.outcome,
                    f" ({result.error})" if result.error else "",
                    extra=cmd_fields(cmd, outcome=result.outcome))
            return result, False

    # ------------------------------------------------------------------ helpers
    def _result(self, cmd: Command, outcome: Outcome, *, error: str | None = None,
                info: VMInfo | None = None, snapshot: str | None = None,
                found: list[Inventoried] | None = None) -> CommandResult:
        vnc_port = None
        if info is not None and info.vnc_display is not None:
            vnc_port = DisplayPool.BASE_PORT + info.vnc_display
        return CommandResult(
            fence=cmd.fence, command_id=cmd.id, op=cmd.op, host=self.host, vm_id=cmd.vm_id,
            outcome=outcome,  # type: ignore[arg-type]
            error=error, ip=info.ip if info else None, vnc_port=vnc_port, snapshot=snapshot,
            found=found or [],
            # the newest epoch of the key this host has seen: above every epoch the key's log
            # knows, it shows the reconciler that the log lost entries (a cut nobody saw)
            key_epoch=self.ledger.key_mark(cmd.fence.key), key_uid=self.ledger.key_mark_uid(cmd.fence.key),
        )

    async def _answer(self, cmd: Command, outcome: Outcome, error: str | None = None,
                      info: VMInfo | None = None) -> CommandResult:
        """Record a result that changes nothing in the ledger (fenced, not_found, failed...). A
        fenced answer names the VM's real owner, so the reconciler never mistakes it for gone."""
        row = self.ledger.vm(cmd.vm_id) if outcome == "fenced" else None
        found = [Inventoried(row.fence, self.host, row.vm_id, row.state)] if row is not None else None
        result = self._result(cmd, outcome, error=error, info=info, found=found)
        await self.ledger.record(result)
        return result

    async def _timed(self, aw: Awaitable[T]) -> T:
        async with asyncio.timeout(self.op_timeout):
            return await aw

    def _vmspec(self, vm_id: str, spec: Spec, fence: Fence) -> VMSpec:
        image = spec.image
        if image and not os.path.isabs(image) and self.image_dir:
            image = os.path.join(self.image_dir, image)
        return VMSpec(
            vm_id=vm_id, cpus=spec.cpus, memory_mib=spec.memory_mib, image=image, vnc=self.vnc,
            probe_port=spec.probe_port,
            labels={LABEL_KEY: fence.key, LABEL_UID: fence.uid, LABEL_EPOCH: str(fence.epoch)},
        )

    @staticmethod
    def _row(row: VMRow, info: VMInfo, **changes: object) -> VMRow:
        return replace(row, state=info.state, pid=info.pid, vnc_display=info.vnc_display,
                       probe_host_port=info.probe_host_port, ip=info.ip, **changes)  # type: ignore[arg-type]

    @staticmethod
    def _claims(info: VMInfo) -> list[tuple[str, str]]:
        out = []
        if info.vnc_display is not None:
            out.append(("vnc", str(info.vnc_display)))
        if info.probe_host_port is not None:
            out.append(("port", str(info.probe_host_port)))
        return out

    async def _inspect(self, vm_id: str) -> VMInfo | None:
        """Raises Inconclusive (the caller answers ``inconclusive``) or RuntimeFailure."""
        return await self._timed(self.driver.inspect(vm_id))

    def _refusal(self, cmd: Command) -> str | None:
        """Why the ledger forbids this command: a tombstone or the owner fence (the kernel's tables)."""
        tomb = self.ledger.tombstone(cmd.vm_id)
        return refusal(cmd.op, cmd.fence, cmd.vm_id, self.ledger.owner(cmd.vm_id),
                       tomb.reason if tomb is not None else None)

    # ------------------------------------------------------------------ ops
    async def _op_create(self, cmd: Command) -> CommandResult:
        if (why := self._refusal(cmd)) is not None:
            return await self._answer(cmd, "fenced", why)
        row = self.ledger.vm(cmd.vm_id)
        if row is None:
            # look: the runtime may have it although the ledger does not (ledger lost/replaced)
            try:
                info = await self._inspect(cmd.vm_id)
            except Inconclusive as e:
                return await self._answer(cmd, "inconclusive", str(e))
            except (RuntimeFailure, TimeoutError) as e:
                return await self._answer(cmd, "failed", f"inspect: {e or 'timeout'}")
            if info is not None and (why := fence_verdict("create", cmd.fence, labels_fence(info.labels))):
                return await self._answer(cmd, "fenced", why)
            row = VMRow(vm_id=cmd.vm_id, fence=cmd.fence, state="creating", spec=cmd.spec,
                        command_id=cmd.id)
        elif row.state not in (*UP_STATES, "exited"):
            row = replace(row, state="creating", command_id=cmd.id)
        # intent before effect: a crash from here on leaves a "creating" row the inventory reports
        row = await self.ledger.put_vm(row)
        log.info("create: intent recorded, calling the runtime", extra=cmd_fields(cmd, event="create_intent"))
        try:
            info = await self._timed(self.driver.create(self._vmspec(cmd.vm_id, cmd.spec, cmd.fence)))
        except (RuntimeFailure, TimeoutError) as e:
            return await self._failed_bringup(cmd, row, f"create: {e or 'timeout'}")
        result = self._result(cmd, "ok", info=info)
        await self.ledger.record(result, put=self._row(row, info), claim=self._claims(info))
        return result

    async def _failed_bringup(self, cmd: Command, row: VMRow, error: str) -> CommandResult:
        """A create/wake failed: look again so the ledger says what the runtime has."""
        result = self._result(cmd, "failed", error=error)
        try:
            info = await self._inspect(cmd.vm_id)
        except (Inconclusive, RuntimeFailure, TimeoutError):
            # unsure: keep the intent row, the inventory reports it
            await self.ledger.record(result)
            return result
        if info is None:
            await self.ledger.forget_vm(cmd.vm_id)
            await self.ledger.record(result)
        else:
            await self.ledger.record(result, put=self._row(row, info), claim=self._claims(info))
        return result

    async def _op_start(self, cmd: Command) -> CommandResult:
        if (why := self._refusal(cmd)) is not None:
            return await self._answer(cmd, "fenced", why)
        row = self.ledger.vm(cmd.vm_id)
        if row is None:
            return await self._answer(cmd, "not_found", f"no VM {cmd.vm_id} on {self.host}")
        try:
            info = await self._inspect(cmd.vm_id)
        except Inconclusive as e:
            return await self._answer(cmd, "inconclusive", str(e))
        except (RuntimeFailure, TimeoutError) as e:
            return await self._answer(cmd, "failed", f"inspect: {e or 'timeout'}")
        if info is None:
            result = self._result(cmd, "not_found", error="the runtime no longer knows this VM")
            await self.ledger.record(result, bury=("lost", row.fence))
            return result
        if info.state not in UP_STATES:
            try:
                info = await self._timed(self.driver.start(cmd.vm_id))
            except (RuntimeFailure, TimeoutError) as e:
                return await self._answer(cmd, "failed", f"start: {e or 'timeout'}")
        result = self._result(cmd, "ok", info=info)
        put = self._row(row, info, command_id=cmd.id)
        await self.ledger.record(result, put=put, claim=self._claims(info))
        return result

    async def _op_remove(self, cmd: Command) -> CommandResult:
        row = self.ledger.vm(cmd.vm_id)
        owner = row.fence if row is not None else None
        if (why := fence_verdict("remove", cmd.fence, owner)) is not None:
            return await self._answer(cmd, "fenced", why)
        info: VMInfo | None = None
        if row is None:
            try:
                info = await self._inspect(cmd.vm_id)
            except Inconclusive as e:
                return await self._answer(cmd, "inconclusive", str(e))
            except (RuntimeFailure, TimeoutError) as e:
                return await self._answer(cmd, "failed", f"inspect: {e or 'timeout'}")
            if info is None:
                # unknown (or already removed): tombstone anyway so a late create is refused
                result = self._result(cmd, "ok" if self.ledger.tombstone(cmd.vm_id) else "not_found")
                await self.ledger.record(result, bury=("removed", cmd.fence))
                return result
            owner = labels_fence(info.labels)
            if (why := fence_verdict("remove", cmd.fence, owner)) is not None:
                return await self._answer(cmd, "fenced", why)
        else:
            await self.ledger.set_state(cmd.vm_id, "removing")  # intent: its exit is not reported
        try:
            await self._timed(self.driver.remove(cmd.vm_id))
        except (RuntimeFailure, TimeoutError) as e:
            if row is not None:
                await self.ledger.put_vm(row)  # back to what it was; the remove may be retried
            return await self._answer(cmd, "failed", f"remove: {e or 'timeout'}")
        result = self._result(cmd, "ok")
        await self.ledger.record(result, bury=("removed", owner or cmd.fence))
        return result

    async def _op_hibernate(self, cmd: Command) -> CommandResult:
        if (why := self._refusal(cmd)) is not None:
            return await self._answer(cmd, "fenced", why)
        row = self.ledger.vm(cmd.vm_id)
        if row is None:
            return await self._answer(cmd, "not_found", f"no VM {cmd.vm_id} on {self.host}")
        dest = os.path.join(self.snapshot_dir, f"{cmd.vm_id}.snap")
        try:
            info = await self._inspect(cmd.vm_id)
        except Inconclusive as e:
            return await self._answer(cmd, "inconclusive", str(e))
        except (RuntimeFailure, TimeoutError) as e:
            return await self._answer(cmd, "failed", f"inspect: {e or 'timeout'}")
        if info is None and row.state == "hibernating" and await asyncio.to_thread(os.path.exists, dest):
            # look: a previous attempt finished the snapshot and died before recording it
            result = self._result(cmd, "ok", snapshot=dest)
            await self.ledger.record(result, bury=("hibernated", row.fence))
            return result
        if info is None:
            result = self._result(cmd, "not_found", error="the runtime no longer knows this VM")
            await self.ledger.record(result, bury=("lost", row.fence))
            return result
        await self.ledger.reserve("snapshot", dest, cmd.vm_id, row.fence)
        await self.ledger.set_state(cmd.vm_id, "hibernating")
        try:
            snap = await self._timed(self.driver.snapshot(cmd.vm_id, dest))
        except (RuntimeFailure, TimeoutError) as e:
            await self.ledger.put_vm(row)
            return await self._answer(cmd, "failed", f"snapshot: {e or 'timeout'}")
        result = self._result(cmd, "ok", snapshot=snap.path)
        await self.ledger.record(result, bury=("hibernated", row.fence))
        return result

    async def _op_wake(self, cmd: Command) -> CommandResult:
        if (why := self._refusal(cmd)) is not None:
            return await self._answer(cmd, "fenced", why)
        if not cmd.snapshot:
            return await self._answer(cmd, "failed", "wake without a snapshot (never a blank VM)")
        row = self.ledger.vm(cmd.vm_id)
        if row is not None and row.state in UP_STATES:
            try:
                info = await self._inspect(cmd.vm_id)
            except (Inconclusive, RuntimeFailure, TimeoutError):
                info = None
            if info is not None and info.state in UP_STATES:
                result = self._result(cmd, "ok", info=info)
                await self.ledger.record(result, put=self._row(row, info))
                return result
        row = await self.ledger.put_vm(
            VMRow(vm_id=cmd.vm_id, fence=cmd.fence, state="waking", spec=cmd.spec, command_id=cmd.id)
        )
        try:
            info = await self._timed(
                self.driver.restore(self._vmspec(cmd.vm_id, cmd.spec, cmd.fence), cmd.snapshot)
            )
        except (RuntimeFailure, TimeoutError) as e:
            return await self._failed_bringup(cmd, row, f"restore: {e or 'timeout'}")
        result = self._result(cmd, "ok", info=info)
        await self.ledger.record(result, put=self._row(row, info), claim=self._claims(info))
        return result

    async def _op_adopt(self, cmd: Command) -> CommandResult:
        row = self.ledger.vm(cmd.vm_id)
        if (why := fence_verdict("adopt", cmd.fence, row.fence if row else None)) is not None:
            return await self._answer(cmd, "fenced", why)
        # never trust a ledger row alone: ask the runtime (rule 8)
        try:
            info = await self._inspect(cmd.vm_id)
        except Inconclusive as e:
            return await self._answer(cmd, "inconclusive", str(e))
        except (RuntimeFailure, TimeoutError) as e:
            return await self._answer(cmd, "inconclusive", f"inspect: {e or 'timeout'}")
        if info is None:
            result = self._result(cmd, "not_found", error="the runtime does not know this VM")
            bury = ("lost", row.fence) if row is not None else None
            await self.ledger.record(result, bury=bury)
            return result
        tomb = self.ledger.tombstone(cmd.vm_id)
        if tomb is not None:
            return await self._answer(cmd, "fenced", f"vm {cmd.vm_id} was {tomb.reason}")
        if row is None and (why := fence_verdict("adopt", cmd.fence, labels_fence(info.labels))):
            return await self._answer(cmd, "fenced", why)
        base = row or VMRow(vm_id=cmd.vm_id, fence=cmd.fence, state=info.state, spec=cmd.spec)
        new = self._row(base, info, fence=cmd.fence, command_id=cmd.id)
        # the adopter learns the VM's run state: an exited VM needs its restart policy applied
        result = self._result(cmd, "ok", info=info, found=[Inventoried(cmd.fence, self.host, cmd.vm_id, info.state)])
        await self.ledger.record(result, put=new, transfer_to=cmd.fence,
                                 claim=self._claims(info) if row is None else ())
        log.info("adopted: ownership moved", extra=fence_fields(
            cmd.fence, cmd.vm_id, command_id=cmd.id, event="adopted",
            outcome=f"from epoch {row.fence.epoch if row else '?'}"))
        return result

    async def _op_survey(self, cmd: Command) -> CommandResult:
        """Every VM of the command's key on this host (ledger and runtime), with its owner fence:
        what a reconciler rebuilding a lost log tail needs before it makes any VM."""
        key = cmd.fence.key
        found: dict[str, Inventoried] = {}
        for row in self.ledger.vms():
            if row.fence.key == key:
                found[row.vm_id] = Inventoried(row.fence, self.host, row.vm_id, row.state)
        try:
            listed = await self._timed(self.driver.list())
        except (RuntimeFailure, TimeoutError) as e:
            return await self._answer(cmd, "inconclusive", f"list: {e or 'timeout'}")
        for info in listed:
            owner = labels_fence(info.labels)
            if info.vm_id not in found and owner is not None and owner.key == key:
                found[info.vm_id] = Inventoried(owner, self.host, info.vm_id, info.state)
        result = self._result(cmd, "ok", found=sorted(found.values(), key=lambda i: i.vm_id))
        await self.ledger.record(result)
        return result

    async def _op_inspect(self, cmd: Command) -> CommandResult:
        if (why := fence_verdict("inspect", cmd.fence, self.ledger.owner(cmd.vm_id))) is not None:
            return await self._answer(cmd, "fenced", why)
        try:
            info = await self._inspect(cmd.vm_id)
        except Inconclusive as e:
            return await self._answer(cmd, "inconclusive", str(e))
        except (RuntimeFailure, TimeoutError) as e:
            return await self._answer(cmd, "inconclusive", f"inspect: {e or 'timeout'}")
        if info is None:
            return await self._answer(cmd, "not_found", "the runtime does not know this VM")
        return await self._answer(cmd, "ok", info=info)

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
        try:
            info = await self._inspect(vm_id)
        except (Inconclusive, RuntimeFailure, TimeoutError):
            return None
        if info is not None:
            return None
        return await self.on_gone(vm_id)

    async def remove_all(self) -> int:
        """Remove every VM in the ledger (cleanup_on_stop for throw-away stacks)."""
        n = 0
        for row in self.ledger.vms():
            async with self.locks.hold(row.vm_id):
                try:
                    await self._timed(self.driver.remove(row.vm_id))
                except (RuntimeFailure, TimeoutError) as e:
                    log.warning("cleanup: remove failed: %s", e, extra=fence_fields(row.fence, row.vm_id))
                    continue
                await self.ledger.bury(row.vm_id, "removed", row.fence)
                n += 1
        return n
