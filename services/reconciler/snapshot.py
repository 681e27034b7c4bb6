"""A local aiosqlite snapshot of per-key state, so a restart catches up instead of replaying all.

Rows hold each key's folded state and the stream sequence of its last folded entry; a partition's
watermark says every log entry of that partition at or below it is reflected in the rows. The log
stays the truth: a snapshot that is behind (or missing) only costs catch-up time.
"""

from __future__ import annotations

import os

import aiosqlite

from shared.fence.state import KeyState, decode_state

SCHEMA = """
CREATE TABLE IF NOT EXISTS keys (
  key TEXT PRIMARY KEY, partition INTEGER NOT NULL, last_seq INTEGER NOT NULL, state BLOB NOT NULL
);
CREATE INDEX IF NOT EXISTS keys_partition ON keys(partition);
CREATE TABLE IF NOT EXISTS partitions (partition INTEGER PRIMARY KEY, watermark INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value TEXT NOT NULL);
"""


class SnapshotStore:
    def __init__(self, path: str) -> None:
        self.path = path
        self._db: aiosqlite.Connection | None = None

    async def open(self, *, stream_identity: str) -> None:
        """Open (creating) the file. A snapshot of a different stream (recreated bus) is discarded."""
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        self._db = await aiosqlite.connect(self.path)
        await self._db.execute("PRAGMA journal_mode=WAL")
        await self._db.execute("PRAGMA synchronous=NORMAL")
        await self._db.executescript(SCHEMA)
        cur = await self._db.execute("SELECT value FROM meta WHERE name='stream'")
        row = await cur.fetchone()
        if row is None or row[0] != stream_identity:
            await self._db.executescript("DELETE FROM keys; DELETE FROM partitions;")
            await self._db.execute(
                "INSERT OR REPLACE INTO meta(name, value) VALUES('stream', ?)", (stream_identity,)
            )
        await self._db.commit()

    @property
    def db(self) -> aiosqlite.Connection:
        if self._db is None:
            raise RuntimeError("snapshot store is not open")
        return self._db

    async def load_partition(self, partition: int) -> tuple[int, dict[str, tuple[KeyState, int]]]:
        cur = await self.db.execute("SELECT watermark FROM partitions WHERE partition=?", (partition,))
        row = await cur.fetchone()
        watermark = int(row[0]) if row else 0
        keys: dict[str, tuple[KeyState, int]] = {}
        async with self.db.execute(
            "SELECT key, last_seq, state FROM keys WHERE partition=?", (partition,)
        ) as rows:
            async for key, last_seq, blob in rows:
                keys[key] = (decode_state(blob), int(last_seq))
        return watermark, keys

    async def save(self, partition: int, rows: list[tuple[str, int, bytes]], watermark: int) -> None:
        """Rows carry encoded states (shared.fence.state.encode_state), taken at one instant with
        ``watermark``."""
        await self.db.executemany(
            "INSERT OR REPLACE INTO keys(key, partition, last_seq, state) VALUES(?, ?, ?, ?)",
            [(key, partition, seq, state) for key, seq, state in rows],
        )
        await self.db.execute(
            "INSERT OR REPLACE INTO partitions(partition, watermark) VALUES(?, ?)", (partition, watermark)
        )
        await self.db.commit()

    async def replace(self, partition: int, rows: list[tuple[str, int, bytes]], watermark: int) -> None:
        """The partition's rows are exactly ``rows`` from now on (a load from another writer's image:
        rows this file kept from an earlier tenure must not outlive it)."""
        await self.db.execute("DELETE FROM keys WHERE partition=?", (partition,))
        await self.save(partition, rows, watermark)

    async def forget(self, key: str) -> None:
        """Drop one key's row: the next load reads that key from its log alone."""
        await self.db.execute("DELETE FROM keys WHERE key=?", (key,))
        await self.db.commit()

    async def close(self) -> None:
        if self._db is not None:
            await self._db.close()
            self._db = None
