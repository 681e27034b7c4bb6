"""The agent's durable ledger: one SQLite file (WAL) in the data dir.

It is the agent's memory across restarts and SIGKILLs: which VMs it has and which fence owns each
(rule 4), the stored result of every command id (rule 11: a redelivery is answered from here, never
executed twice), tombstones of removed/lost/hibernated vm ids (a late ``create`` must not resurrect a
VM), and reservations (VNC display, forwarded port, snapshot file) owned by ``(vm_id, uid, epoch)``
and released only by that owner (rule 9).

Intent is written *before* a side effect (a ``creating`` row), so a crash mid-create leaves a trace
the inventory reports. Reads come from an in-memory mirror of the ``vms`` table that every write goes
through, so probes and event handlers can check ownership cheaply right before they publish.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import sqlite3
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple, TypeVar

import msgspec

from shared.fence.schema import CommandResult, Fence, Spec, decode_input, encode

log = logging.getLogger("vmfence.agent.ledger")
T = TypeVar("T")

LEDGER_FILE = "ledger.sqlite3"
LEDGER_MODE = 0o600  # it holds VNC passwords; SQLite gives its -wal and -shm files the same mode
BUSY_TIMEOUT_MS = 5000
ADDRESS_KIND = "ip"  # a VM's address on the host's pod network (services/agent/network.py)

# VM row states. "creating"/"waking"/"removing"/"hibernating" are intents recorded before the
# side effect; "running"/"paused"/"exited" mirror what the runtime last said.
TRANSIENT_STATES = ("creating", "waking", "removing", "hibernating")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS vms (
    vm_id TEXT PRIMARY KEY,
    key TEXT NOT NULL,
    uid TEXT NOT NULL,
    epoch INTEGER NOT NULL,
    state TEXT NOT NULL,
    spec BLOB NOT NULL,
    command_id TEXT NOT NULL DEFAULT '',
    pid INTEGER,
    vnc_display INTEGER,
    probe_host_port INTEGER,
    ip TEXT,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS results (
    command_id TEXT PRIMARY KEY,
    vm_id TEXT NOT NULL,
    op TEXT NOT NULL,
    outcome TEXT NOT NULL,
    data BLOB NOT NULL,
    at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS removed (
    vm_id TEXT PRIMARY KEY,
    reason TEXT NOT NULL,
    key TEXT NOT NULL,
    uid TEXT NOT NULL,
    epoch INTEGER NOT NULL,
    at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS key_marks (
    key TEXT PRIMARY KEY,
    epoch INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS partition_floors (
    partition INTEGER PRIMARY KEY,
    gen INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS health (
    probe TEXT PRIMARY KEY,
    at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS reservations (
    kind TEXT NOT NULL,
    resource TEXT NOT NULL,
    vm_id TEXT NOT NULL,
    uid TEXT NOT NULL,
    epoch INTEGER NOT NULL,
    at REAL NOT NULL,
    secret TEXT,
    PRIMARY KEY (kind, resource)
);
"""




def is_write_failure(e: BaseException) -> bool:
    """The ledger file cannot take a write (disk full, read-only, I/O error, locked beyond the busy
    timeout, a corrupt file): the agent is unhealthy, not the command. Constraint and programming
    errors (IntegrityError, ProgrammingError, an int too large...) are the command's own."""
    if isinstance(e, sqlite3.OperationalError | OSError):
        return True
    return type(e) is sqlite3.DatabaseError  # "database disk image is malformed"


class ReservationConflict(Exception):
    """A reservation was claimed or released by someone who does not own it."""


@dataclass(frozen=True, slots=True)
class VMRow:
    """One VM the agent knows, with the fence that owns it."""

    vm_id: str
    fence: Fence
    state: str
    spec: Spec
    command_id: str = ""
    pid: int | None = None
    vnc_display: int | None = None
    probe_host_port: int | None = None
    ip: str | None = None
    created_at: float = 0.0
    updated_at: float = 0.0


@dataclass(frozen=True, slots=True)
class Tombstone:
    vm_id: str
    reason: str
    fence: Fence
    at: float = 0.0  # wall clock of the burial


@dataclass(frozen=True, slots=True)
class Reservation:
    kind: str  # "vnc" | "port" | "snapshot"
    resource: str
    vm_id: str
    fence: Fence
    secret: str | None = None  # a VNC display's password: owned, moved and released with it


class Claim(NamedTuple):
    """A reservation the runtime gave a VM: ``(kind, resource)`` and, for a VNC display, its password."""

    kind: str
    resource: str
    secret: str | None = None


@dataclass
class Ledger:
    """Async facade over the SQLite file; one instance per agent process (see ``open``).

    The connection lives on one thread of its own, and each transaction (or read) runs there whole,
    as one function: one thread hop per write instead of one per statement (aiosqlite's shape, which
    made the hops a fifth of the agent's CPU). Writes asked for while the thread is busy are
    committed together (group commit: one fsync for all of them, each still all-or-nothing and
    answered only once it is durable). A write, once asked for, is not cancelled: the thread
    finishes it and the mirror follows what it committed."""

    path: str
    _conn: sqlite3.Connection | None = field(default=None, init=False, repr=False)
    _pool: ThreadPoolExecutor | None = field(default=None, init=False, repr=False)
    _queued: collections.deque[_Queued] = field(default_factory=collections.deque, init=False, repr=False)
    # a drain is submitted to the thread and has not started taking the queue: a write queued now
    # is in its batch, so it submits none of its own (one thread hop per batch, not per write)
    _drain_pending: bool = field(default=False, init=False, repr=False)
    commits: int = field(default=0, init=False)  # COMMITs that took (fewer than writes under load)
    _vms: dict[str, VMRow] = field(default_factory=dict, init=False, repr=False)
    _by_key: dict[str, set[str]] = field(default_factory=dict, init=False, repr=False)  # key -> its vm ids
    _marks: dict[str, int] = field(default_factory=dict, init=False, repr=False)
    _mark_uids: dict[str, str] = field(default_factory=dict, init=False, repr=False)
    _removed: dict[str, Tombstone] = field(default_factory=dict, init=False, repr=False)
    _floors: dict[int, int] = field(default_factory=dict, init=False, repr=False)  # partition -> gen
    # the addresses held (resource -> (vm_id, uid, epoch)): a mirror of the ``ip`` reservations every
    # write below keeps, so an allocation never reads thousands of rows
    _ips: dict[str, tuple[str, str, int]] = field(default_factory=dict, init=False, repr=False)
    # why the last write failed (None: the last write took). Set and cleared by every write, and by
    # probe_write(), which the heartbeat calls so a healed disk is noticed without a command.
    write_error: str | None = field(default=None, init=False)

    # ------------------------------------------------------------------ lifecycle
    async def open(self) -> None:
        """Open (creating if needed) with WAL + synchronous=FULL, then load the VM mirror."""
        _private(self.path)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ledger")
        self._drain_pending = False
        loop = asyncio.get_running_loop()
        self._conn = await loop.run_in_executor(self._pool, _connect, self.path)
        await self.run(self._load)

    def _load(self, db: sqlite3.Connection) -> None:
        db.executescript(_SCHEMA)
        cur = db.execute("SELECT * FROM vms")
        cols = [d[0] for d in cur.description]
        for raw in cur:
            row = _row_from_db(dict(zip(cols, raw, strict=True)))
            self._mirror_put(row)
        for vm_id, reason, key, uid, epoch, at in db.execute("SELECT vm_id, reason, key, uid, epoch, at FROM removed"):
            self._removed[vm_id] = Tombstone(vm_id, reason, Fence(key, uid, epoch), at)
        if "uid" not in _columns(db, "key_marks"):  # a ledger from before marks named their incarnation
            db.execute("ALTER TABLE key_marks ADD COLUMN uid TEXT NOT NULL DEFAULT ''")
        if "secret" not in _columns(db, "reservations"):  # a ledger from before VNC displays had passwords
            db.execute("ALTER TABLE reservations ADD COLUMN secret TEXT")
        for resource, vid, uid, epoch in db.execute(
                "SELECT resource, vm_id, uid, epoch FROM reservations WHERE kind = ?", (ADDRESS_KIND,)):
            self._ips[str(resource)] = (str(vid), str(uid), int(epoch))
        for key, epoch, uid in db.execute("SELECT key, epoch, uid FROM key_marks"):
            self._marks[key] = int(epoch)
            self._mark_uids[key] = str(uid)
        for partition, gen in db.execute("SELECT partition, gen FROM partition_floors"):
            self._floors[int(partition)] = int(gen)

    def floor(self, partition: int) -> int:
        """The newest generation of the partition's writer that verified this host (0: none)."""
        return self._floors.get(partition, 0)

    def lift_floor(self, partition: int, gen: int) -> None:
        """Raise the partition's floor at once, in memory only (``raise_floor`` makes it durable):
        a command checked after this call is held to it, whether or not the write has landed."""
        if gen > self._floors.get(partition, 0):
            self._floors[partition] = gen

    async def raise_floor(self, partition: int, gen: int) -> None:
        """Raise the partition's floor to ``gen`` (it only rises), durably."""
        self.lift_floor(partition, gen)

        def body(db: sqlite3.Connection) -> None:
            db.execute(
                "INSERT INTO partition_floors(partition, gen) VALUES(?, ?) ON CONFLICT(partition) DO UPDATE "
                "SET gen=excluded.gen WHERE excluded.gen > partition_floors.gen",
                (partition, gen),
            )

        await self._write(body, lambda _: None)

    def key_mark(self, key: str) -> int:
        """The newest epoch any command for this key carried here (0: none yet)."""
        return self._marks.get(key, 0)

    def key_mark_uid(self, key: str) -> str:
        """The incarnation the key's mark epoch belongs to ("": not known)."""
        return self._mark_uids.get(key, "")

    async def raise_key_mark(self, key: str, epoch: int, uid: str = "") -> None:
        """Raise the key's mark to ``epoch`` of ``uid``; at the same epoch only fill in an unknown uid."""
        if not _mark_rises(self._marks.get(key, 0), self._mark_uids.get(key, ""), epoch, uid):
            return

        def body(db: sqlite3.Connection) -> None:
            db.execute(
                "INSERT INTO key_marks(key, epoch, uid) VALUES(?, ?, ?) ON CONFLICT(key) DO UPDATE SET "
                "epoch=excluded.epoch, uid=excluded.uid WHERE excluded.epoch > key_marks.epoch "
                "OR (excluded.epoch = key_marks.epoch AND key_marks.uid = '')",
                (key, epoch, uid),
            )

        def mirror(_: None) -> None:  # what the statement's WHERE kept, should two raises cross
            if _mark_rises(self._marks.get(key, 0), self._mark_uids.get(key, ""), epoch, uid):
                self._marks[key], self._mark_uids[key] = epoch, uid

        await self._write(body, mirror)

    async def close(self) -> None:
        if self._conn is not None:
            conn, self._conn = self._conn, None
            assert self._pool is not None
            await asyncio.get_running_loop().run_in_executor(self._pool, conn.close)
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None

    @property
    def writable(self) -> bool:
        """False while the ledger's last write failed: the agent must take no new VM."""
        return self.write_error is None

    async def probe_write(self) -> bool:
        """One tiny write transaction: is the ledger writable now? (sets/clears ``write_error``)"""
        now = time.time()
        try:
            await self._write(lambda db: db.execute("INSERT OR REPLACE INTO health (probe, at) VALUES ('write', ?)",
                                                    (now,)))
        except Exception as e:
            if is_write_failure(e):
                return False
            raise
        return True

    async def run(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        """``fn(connection)`` on the ledger's thread: a read, or (tests) a pragma. Writes go through
        ``_write``, which makes them one transaction."""
        return await self._submit(fn)

    def _submit(self, fn: Callable[[sqlite3.Connection], T]) -> asyncio.Future[T]:
        if self._conn is None or self._pool is None:
            raise RuntimeError("ledger is not open")
        return asyncio.get_running_loop().run_in_executor(self._pool, fn, self._conn)

    def _submit_write(self, body: Callable[[sqlite3.Connection], T]) -> asyncio.Future[T]:
        """Queue ``body`` for the next group commit; its future settles once it is durable (or failed)."""
        if self._conn is None or self._pool is None:
            raise RuntimeError("ledger is not open")
        loop = asyncio.get_running_loop()
        done: asyncio.Future[T] = loop.create_future()
        self._queued.append(_Queued(body, done, loop))
        if not self._drain_pending:
            self._drain_pending = True
            self._pool.submit(self._drain, self._conn)
        return done

    def _drain(self, db: sqlite3.Connection) -> None:
        """On the ledger's thread: every write queued so far, in one transaction when they all go
        through, else each in its own (so one write's error never takes another's work with it)."""
        # cleared before the queue is taken: a write queued after this line submits a drain of its
        # own (at worst one that finds nothing), so none is left waiting
        self._drain_pending = False
        batch: list[_Queued] = []
        while self._queued:
            batch.append(self._queued.popleft())
        if not batch:
            return
        if len(batch) > 1:
            settled = _group(db, [q.body for q in batch])
            if settled is not None:
                self.commits += 1
                for q, (out, error) in zip(batch, settled, strict=True):
                    q.settle(out, error)
                return
        for q in batch:
            try:
                out = _transaction(q.body, db)
            except Exception as e:
                q.settle(None, e)
            else:
                self.commits += 1
                q.settle(out, None)

    async def _write(self, body: Callable[[sqlite3.Connection], T],
                     mirror: Callable[[T], None] | None = None) -> T:
        """``body`` as one atomic write transaction on the ledger's thread, then ``mirror`` of what
        it returned. Transactions never interleave (one thread runs them in turn, in the order they
        were asked for). A cancelled caller still waits for its write, so the mirror never misses a
        commit."""
        work = self._submit_write(body)
        try:
            out = await asyncio.shield(work)
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                self._took(await work, mirror)
            raise
        except Exception as e:
            if not is_write_failure(e):
                raise
            if self.write_error is None:
                log.error("ledger %s cannot be written: %s", self.path, e, extra={"event": "ledger_unwritable"})
            self.write_error = f"{type(e).__name__}: {e}"
            raise
        self._took(out, mirror)
        return out

    def _took(self, out: T, mirror: Callable[[T], None] | None) -> None:
        if mirror is not None:
            mirror(out)
        if self.write_error is not None:
            log.warning("ledger %s is writable again", self.path, extra={"event": "ledger_writable"})
            self.write_error = None

    # ------------------------------------------------------------------ reads (memory mirror)
    def holds_addresses(self) -> bool:
        """Any VM of this host still holds a pod address (a reservation of its fence)."""
        return bool(self._ips)

    def vm(self, vm_id: str) -> VMRow | None:
        return self._vms.get(vm_id)

    def vms(self) -> list[VMRow]:
        return sorted(self._vms.values(), key=lambda r: r.vm_id)

    def vms_of(self, key: str) -> list[VMRow]:
        """The rows of one key's VMs, by vm id: a survey's cost is that key's VMs, not the host's."""
        return sorted((self._vms[v] for v in self._by_key.get(key, ())), key=lambda r: r.vm_id)

    def _mirror_put(self, row: VMRow) -> None:
        old = self._vms.get(row.vm_id)
        if old is not None and old.fence.key != row.fence.key:
            self._mirror_drop(row.vm_id)
        self._vms[row.vm_id] = row
        self._by_key.setdefault(row.fence.key, set()).add(row.vm_id)

    def _mirror_drop(self, vm_id: str) -> None:
        row = self._vms.pop(vm_id, None)
        if row is None:
            return
        ids = self._by_key.get(row.fence.key)
        if ids is not None:
            ids.discard(vm_id)
            if not ids:
                del self._by_key[row.fence.key]

    def owner(self, vm_id: str) -> Fence | None:
        row = self._vms.get(vm_id)
        return row.fence if row is not None else None

    def tombstone(self, vm_id: str) -> Tombstone | None:
        return self._removed.get(vm_id)

    def lost(self, since: float) -> list[Tombstone]:
        """VMs the runtime lost since ``since`` (wall clock) that no remove has acknowledged."""
        return sorted((t for t in self._removed.values() if t.reason == "lost" and t.at >= since),
                      key=lambda t: t.vm_id)

    async def result(self, command_id: str) -> CommandResult | None:
        raw = await self.run(lambda db: db.execute("SELECT data FROM results WHERE command_id = ?",
                                                   (command_id,)).fetchone())
        if raw is None:
            return None
        decoded = decode_input(bytes(raw[0]))
        assert isinstance(decoded, CommandResult)
        return decoded

    async def vnc_password(self, vm_id: str) -> str | None:
        """The password of the VNC display ``vm_id``'s owner holds (None: no display)."""
        raw = await self.run(lambda db: db.execute(
            "SELECT secret FROM reservations WHERE kind = 'vnc' AND vm_id = ?", (vm_id,)).fetchone())
        return str(raw[0]) if raw is not None and raw[0] is not None else None

    async def reservations(self, vm_id: str | None = None) -> list[Reservation]:
        sql = "SELECT kind, resource, vm_id, r.uid, r.epoch, v.key, r.secret FROM reservations r "
        sql += "LEFT JOIN vms v USING (vm_id)"
        args: tuple[str, ...] = ()
        if vm_id is not None:
            sql += " WHERE vm_id = ?"
            args = (vm_id,)
        rows = await self.run(lambda db: db.execute(sql, args).fetchall())
        return [Reservation(kind, resource, vid, Fence(key or "", uid, epoch), secret)
                for kind, resource, vid, uid, epoch, key, secret in rows]

    async def reservation_owner(self, kind: str, resource: str) -> tuple[str, str, int] | None:
        """``(vm_id, uid, epoch)`` holding the resource, or None when free."""
        raw = await self.run(lambda db: _holder(db, kind, resource))
        return (raw[0], raw[1], int(raw[2])) if raw else None

    async def reserved_since(self, kind: str) -> list[tuple[str, str, str, int, float]]:
        """Every ``kind`` reservation with the time it was taken: ``(resource, vm_id, uid, epoch, at)``."""
        rows = await self.run(lambda db: db.execute(
            "SELECT resource, vm_id, uid, epoch, at FROM reservations WHERE kind = ?", (kind,)).fetchall())
        return [(str(r), str(v), str(u), int(e), float(a)) for r, v, u, e, a in rows]

    # ------------------------------------------------------------------ writes
    async def put_vm(self, row: VMRow) -> VMRow:
        """Insert or replace a VM row (intent before an effect, or what the runtime said after)."""
        now = time.time()
        row = replace(row, created_at=row.created_at or now, updated_at=now)

        def mirror(_: None) -> None:
            self._mirror_put(row)

        await self._write(lambda db: _upsert(db, row), mirror)
        return row

    async def set_state(self, vm_id: str, state: str) -> VMRow | None:
        row = self._vms.get(vm_id)
        if row is None:
            return None
        return await self.put_vm(replace(row, state=state))

    async def forget_vm(self, vm_id: str) -> None:
        """Drop a row without a tombstone: a create that failed before any effect."""
        def body(db: sqlite3.Connection) -> None:
            db.execute("DELETE FROM vms WHERE vm_id = ?", (vm_id,))

        def mirror(_: None) -> None:
            self._mirror_drop(vm_id)

        await self._write(body, mirror)

    async def record(
        self,
        result: CommandResult,
        *,
        put: VMRow | None = None,
        bury: tuple[str, Fence] | None = None,
        claim: Iterable[Claim | tuple[str, str]] = (),
        transfer_to: Fence | None = None,
    ) -> None:
        """Store a command's result together with its ledger effect, atomically.

        ``put``: the VM's new row. ``bury``: ``(reason, owner fence)`` tombstones the vm_id, drops its
        row and releases the reservations that owner holds on it. ``claim``: ``(kind, resource[,
        secret])`` reservations for ``put``'s owner. ``transfer_to``: move the VM's reservations to a new
        owner (adopt).
        """
        now = time.time()
        if put is not None:
            put = replace(put, created_at=put.created_at or now, updated_at=now)
        claims = [Claim(*c) for c in claim]
        data = encode(result)

        def body(db: sqlite3.Connection) -> None:
            if put is not None:
                _upsert(db, put)
                for kind, resource, secret in claims:
                    try:
                        _claim(db, kind, resource, put.vm_id, put.fence, now, secret)
                    except ReservationConflict as e:
                        # the runtime just assigned it to this VM, so the holder's VM no longer has
                        # it; never take it over silently, never wedge the command on it either
                        log.warning("reservation not recorded: %s", e, extra={"vm_id": put.vm_id})
            if transfer_to is not None:
                db.execute(
                    "UPDATE reservations SET uid = ?, epoch = ? WHERE vm_id = ? AND kind != 'snapshot'",
                    (transfer_to.uid, transfer_to.epoch, result.vm_id),
                )
            if bury is not None:
                reason, owner = bury
                _bury(db, result.vm_id, reason, owner, now)
            db.execute(
                "INSERT OR IGNORE INTO results (command_id, vm_id, op, outcome, data, at) "
                "VALUES (?, ?, ?, ?, ?, ?)",
                (result.command_id, result.vm_id, result.op, result.outcome, data, now),
            )

        def mirror(_done: None) -> None:
            if put is not None:
                self._mirror_put(put)
                for kind, resource, _secret in claims:
                    if kind == ADDRESS_KIND and resource not in self._ips:
                        self._ips[resource] = (put.vm_id, put.fence.uid, put.fence.epoch)
            if transfer_to is not None:
                for ip, (vid, _, _) in list(self._ips.items()):
                    if vid == result.vm_id:
                        self._ips[ip] = (vid, transfer_to.uid, transfer_to.epoch)
            if bury is not None:
                self._mirror_drop(result.vm_id)
                self._removed[result.vm_id] = Tombstone(result.vm_id, bury[0], bury[1], now)
                self._forget_ips(result.vm_id, bury[0], bury[1])

        await self._write(body, mirror)

    async def bury(self, vm_id: str, reason: str, owner: Fence) -> None:
        """Tombstone a vm_id outside a command (the runtime lost it, cleanup on stop)."""
        now = time.time()

        def mirror(_: None) -> None:
            self._mirror_drop(vm_id)
            self._removed[vm_id] = Tombstone(vm_id, reason, owner, now)
            self._forget_ips(vm_id, reason, owner)

        await self._write(lambda db: _bury(db, vm_id, reason, owner, now), mirror)

    def _forget_ips(self, vm_id: str, reason: str, owner: Fence) -> None:
        """The mirror of what _bury released: the owner's addresses, unless the VM hibernated."""
        if reason == "hibernated":
            return
        for ip, holder in list(self._ips.items()):
            if holder == (vm_id, owner.uid, owner.epoch):
                del self._ips[ip]

    async def reserve(self, kind: str, resource: str, vm_id: str, owner: Fence) -> None:
        """Claim a resource for ``(vm_id, owner)``; idempotent for that owner, else a conflict."""
        now = time.time()

        def mirror(_: None) -> None:
            if kind == ADDRESS_KIND:
                self._ips[resource] = (vm_id, owner.uid, owner.epoch)

        await self._write(lambda db: _claim(db, kind, resource, vm_id, owner, now), mirror)

    async def held(self, kind: str) -> dict[str, tuple[str, str, int]]:
        """Every ``kind`` reservation: resource -> ``(vm_id, uid, epoch)``."""
        if kind == ADDRESS_KIND:
            return dict(self._ips)
        return {r: (v, u, e) for r, v, u, e, _ in await self.reserved_since(kind)}

    async def move(self, kind: str, resource: str, frm: tuple[str, Fence], to: tuple[str, Fence]) -> bool:
        """Hand ``resource`` from its owner ``frm = (vm_id, fence)`` to ``to`` (a wake taking over the
        hibernated VM's address); False, changing nothing, when ``frm`` does not hold it."""
        (fvm, ff), (tvm, tf) = frm, to
        now = time.time()

        def body(db: sqlite3.Connection) -> bool:
            cur = db.execute(
                "UPDATE reservations SET vm_id = ?, uid = ?, epoch = ?, at = ? "
                "WHERE kind = ? AND resource = ? AND vm_id = ? AND uid = ? AND epoch = ?",
                (tvm, tf.uid, tf.epoch, now, kind, resource, fvm, ff.uid, ff.epoch),
            )
            return (cur.rowcount or 0) > 0

        def mirror(moved: bool) -> None:
            if moved and kind == ADDRESS_KIND:
                self._ips[resource] = (tvm, tf.uid, tf.epoch)

        return await self._write(body, mirror)

    async def release(self, kind: str, resource: str, vm_id: str, owner: Fence) -> bool:
        """Free a resource; only its owner ``(vm_id, uid, epoch)`` may. False if already free."""

        def body(db: sqlite3.Connection) -> bool:
            raw = _holder(db, kind, resource)
            if raw is None:
                return False
            if (raw[0], raw[1], int(raw[2])) != (vm_id, owner.uid, owner.epoch):
                raise ReservationConflict(
                    f"{kind} {resource} is held by {raw[0]}/{raw[1]}/{raw[2]}; "
                    f"{vm_id}/{owner.uid}/{owner.epoch} may not release it"
                )
            db.execute("DELETE FROM reservations WHERE kind = ? AND resource = ?", (kind, resource))
            return True

        def mirror(released: bool) -> None:
            if released and kind == ADDRESS_KIND:
                self._ips.pop(resource, None)

        return await self._write(body, mirror)


# ---------------------------------------------------------------------------------- helpers


def _private(path: str) -> None:
    """The ledger file (created if missing) and its -wal/-shm files are the agent user's alone."""
    os.close(os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, LEDGER_MODE))
    for p in (path, f"{path}-wal", f"{path}-shm"):
        with contextlib.suppress(FileNotFoundError):
            os.chmod(p, LEDGER_MODE)


@dataclass(frozen=True, slots=True)
class _Queued:
    """A write waiting for the ledger's thread, and how to answer its caller's loop."""

    body: Callable[[sqlite3.Connection], Any]
    done: asyncio.Future[Any]
    loop: asyncio.AbstractEventLoop

    def settle(self, out: object, error: BaseException | None) -> None:
        self.loop.call_soon_threadsafe(_settle, self.done, out, error)


def _settle(done: asyncio.Future[Any], out: object, error: BaseException | None) -> None:
    if done.done():
        return
    if error is not None:
        done.set_exception(error)
    else:
        done.set_result(out)


def _mark_rises(old: int, old_uid: str, epoch: int, uid: str) -> bool:
    """A key's mark only rises; at its own epoch it only fills in an unknown uid (the statement in
    ``raise_key_mark`` says the same to the file)."""
    return epoch > old or (epoch == old and not old_uid and bool(uid))


def _connect(path: str) -> sqlite3.Connection:
    """The connection, made on the ledger's thread (autocommit: ``_transaction`` says BEGIN/COMMIT)."""
    db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    db.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=FULL")
    return db


def _transaction(body: Callable[[sqlite3.Connection], T], db: sqlite3.Connection) -> T:
    """``body`` between BEGIN IMMEDIATE and COMMIT; rolled back on any error. A failed COMMIT (disk
    full) leaves the transaction open: it is rolled back too, never reused."""
    db.execute("BEGIN IMMEDIATE")
    try:
        out = body(db)
        db.execute("COMMIT")
    except BaseException:
        if db.in_transaction:
            with contextlib.suppress(Exception):
                db.execute("ROLLBACK")
        raise
    return out


def _group(db: sqlite3.Connection, bodies: list[Callable[[sqlite3.Connection], Any]],
           ) -> list[tuple[Any, BaseException | None]] | None:
    """Several writes in one transaction, each inside its own savepoint: one that raises is rolled
    back alone and answered with its error. None when the transaction itself failed (a write
    failure, which SQLite may answer by rolling everything back, or a failed COMMIT): nothing of it
    stays, and the caller runs each write alone."""
    out: list[tuple[Any, BaseException | None]] = []
    db.execute("BEGIN IMMEDIATE")
    try:
        for body in bodies:
            db.execute("SAVEPOINT one_write")
            try:
                out.append((body(db), None))
            except Exception as e:
                if is_write_failure(e) or not db.in_transaction:
                    raise
                db.execute("ROLLBACK TO one_write")
                out.append((None, e))
            db.execute("RELEASE one_write")
        db.execute("COMMIT")
    except Exception:
        if db.in_transaction:
            with contextlib.suppress(Exception):
                db.execute("ROLLBACK")
        return None
    return out


def _columns(db: sqlite3.Connection, table: str) -> list[str]:
    return [row[1] for row in db.execute(f"PRAGMA table_info({table})")]


def _holder(db: sqlite3.Connection, kind: str, resource: str) -> tuple[str, str, int] | None:
    raw = db.execute("SELECT vm_id, uid, epoch FROM reservations WHERE kind = ? AND resource = ?",
                     (kind, resource)).fetchone()
    return (str(raw[0]), str(raw[1]), int(raw[2])) if raw is not None else None


def _row_from_db(d: dict[str, object]) -> VMRow:
    return VMRow(
        vm_id=str(d["vm_id"]),
        fence=Fence(str(d["key"]), str(d["uid"]), int(d["epoch"])),  # type: ignore[call-overload]
        state=str(d["state"]),
        spec=msgspec.json.decode(d["spec"], type=Spec),  # type: ignore[call-overload]
        command_id=str(d["command_id"] or ""),
        pid=d["pid"],  # type: ignore[arg-type]
        vnc_display=d["vnc_display"],  # type: ignore[arg-type]
        probe_host_port=d["probe_host_port"],  # type: ignore[arg-type]
        ip=d["ip"],  # type: ignore[arg-type]
        created_at=float(d["created_at"]),  # type: ignore[arg-type]
        updated_at=float(d["updated_at"]),  # type: ignore[arg-type]
    )


def _upsert(db: sqlite3.Connection, row: VMRow) -> None:
    db.execute(
        "INSERT OR REPLACE INTO vms (vm_id, key, uid, epoch, state, spec, command_id, pid, vnc_display, "
        "probe_host_port, ip, created_at, updated_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        (
            row.vm_id,
            row.fence.key,
            row.fence.uid,
            row.fence.epoch,
            row.state,
            encode(row.spec),
            row.command_id,
            row.pid,
            row.vnc_display,
            row.probe_host_port,
            row.ip,
            row.created_at,
            row.updated_at,
        ),
    )


def _claim(
    db: sqlite3.Connection, kind: str, resource: str, vm_id: str, owner: Fence, now: float,
    secret: str | None = None,
) -> None:
    """Claim for ``(vm_id, owner)``; its owner may set the secret (what the runtime says is true),
    nobody else touches the row (rule 9)."""
    raw = _holder(db, kind, resource)
    if raw is not None:
        if raw == (vm_id, owner.uid, owner.epoch):
            if secret is not None:
                db.execute("UPDATE reservations SET secret = ? WHERE kind = ? AND resource = ?",
                           (secret, kind, resource))
            return
        raise ReservationConflict(f"{kind} {resource} is held by {raw[0]}/{raw[1]}/{raw[2]}")
    db.execute(
        "INSERT INTO reservations (kind, resource, vm_id, uid, epoch, at, secret) VALUES (?, ?, ?, ?, ?, ?, ?)",
        (kind, resource, vm_id, owner.uid, owner.epoch, now, secret),
    )


def _bury(db: sqlite3.Connection, vm_id: str, reason: str, owner: Fence, now: float) -> None:
    """Tombstone + drop row + release what ``owner`` holds on it. Snapshots outlive the VM, and so
    does a hibernated VM's address: its guest's RAM, in the snapshot, has it configured (the wake
    that restores it takes it over)."""
    db.execute(
        "INSERT OR REPLACE INTO removed (vm_id, reason, key, uid, epoch, at) VALUES (?, ?, ?, ?, ?, ?)",
        (vm_id, reason, owner.key, owner.uid, owner.epoch, now),
    )
    db.execute("DELETE FROM vms WHERE vm_id = ?", (vm_id,))
    kept = ("snapshot", ADDRESS_KIND) if reason == "hibernated" else ("snapshot",)
    db.execute(
        f"DELETE FROM reservations WHERE vm_id = ? AND uid = ? AND epoch = ? "
        f"AND kind NOT IN ({', '.join('?' for _ in kept)})",
        (vm_id, owner.uid, owner.epoch, *kept),
    )
