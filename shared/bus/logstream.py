"""Reading the decision log: the whole of it for an audit or an export, or a live subscription
with filters. The same async iterator backs ``vmfence decisions``, ``replay`` and ``export``."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import io
import mmap
import os
import stat
import time
from collections.abc import AsyncIterator, Generator, Iterable, Iterator
from dataclasses import dataclass
from typing import BinaryIO

import msgspec
from nats.aio.msg import Msg
from nats.js import JetStreamContext, api

from shared.bus.read import read_stream
from shared.fence.audit import Auditor, AuditReport
from shared.fence.keys import Key
from shared.fence.schema import Commanded, LogEntry, decode_entry
from shared.subjects import Subjects

EXPORT_MAGIC = b"VMFENCE-LOG 1\n"
FOLLOW_IDLE_TIMEOUT_S = 5.0


class Record(msgspec.Struct, frozen=True):
    """One log entry with where it sits in the stream."""

    seq: int
    entry: LogEntry
    ts: float = 0.0  # when the server stored it (0: not known)
    error: str = ""  # the stored bytes did not decode: ``entry`` is an empty stand-in (n = 0)

    def written_at(self) -> float:
        """The writer's wall-clock time where it recorded one, else the server's stored time (both
        informational: no rule depends on them)."""
        return self.entry.at or self.ts


@dataclass(frozen=True)
class Filter:
    key: str | None = None
    namespace: str | None = None
    host: str | None = None

    def subject(self, subjects: Subjects) -> str:
        if self.key is not None:
            return subjects.log(Key.parse(self.key))
        return subjects.log_all

    def matches(self, entry: LogEntry) -> bool:
        if self.key is not None and entry.key != self.key:
            return False
        if self.namespace is not None:
            ns = entry.key.removeprefix("vm:").split("/", 1)[0]
            if ns != self.namespace:
                return False
        if self.host is not None:
            hosts = {getattr(d, "host", None) for d in entry.decisions}
            hosts |= {d.command.host for d in entry.decisions if isinstance(d, Commanded)}
            if self.host not in hosts:
                return False
        return True


@dataclass(frozen=True)
class Since:
    """Where a read of the log starts: a stream sequence, or a moment (the server's stored time)."""

    seq: int | None = None
    time_s: float | None = None

    def __post_init__(self) -> None:
        if (self.seq is None) == (self.time_s is None):
            raise ValueError("Since takes exactly one of seq and time_s")
        if self.seq is not None and self.seq < 1:
            raise ValueError("a stream sequence starts at 1")


_DURATION_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86_400.0}


def parse_since(text: str, now_s: float) -> Since:
    """``123`` (a stream sequence), ``90s``/``10m``/``2h``/``1d`` (that long before ``now_s``) or an
    RFC 3339 stamp (``2026-12-01T20:00:00Z``). ValueError with a message naming the accepted forms."""
    raw = text.strip()
    accepted = "a stream sequence (123), a duration (90s, 10m, 2h, 1d) or an RFC 3339 time (2026-12-01T20:00:00Z)"
    if raw.isascii() and raw.isdigit() and len(raw) <= 18:
        return Since(seq=max(1, int(raw)))
    unit = raw[-1:].lower()
    if unit in _DURATION_UNITS and raw[:-1].replace(".", "", 1).isdigit() and len(raw) <= 18:
        return Since(time_s=now_s - float(raw[:-1]) * _DURATION_UNITS[unit])
    try:
        stamp = datetime.datetime.fromisoformat(raw.replace("Z", "+00:00").replace("z", "+00:00"))
    except ValueError:
        raise ValueError(f"--since {raw[:64]!r}: expected {accepted}") from None
    if stamp.tzinfo is None:
        raise ValueError(f"--since {raw[:64]!r}: an RFC 3339 time needs its offset (Z or +01:00)")
    return Since(time_s=stamp.timestamp())


async def read_log(
    js: JetStreamContext, subjects: Subjects, flt: Filter = Filter(), *, start_seq: int = 1,
    since: Since | None = None,
) -> AsyncIterator[Record]:
    """Every stored entry matching the filter, in stream order, up to the end at call time; with
    ``since``, from that sequence or from the first entry stored at or after that moment."""
    if since is not None and since.seq is not None:
        start_seq = max(start_seq, since.seq)
    after = since.time_s if since is not None and since.time_s is not None else None
    async for msg in read_stream(js, subjects.stream_log, flt.subject(subjects), start_seq=start_seq):
        if after is not None and msg.time_s < after:
            continue
        try:
            entry = decode_entry(msg.data)
        except msgspec.DecodeError as exc:  # a corrupt or forged entry: the audit names it, reading goes on
            stand_in = LogEntry(_key_of(subjects, msg.subject), 0, [])
            if flt.key is None or flt.key == stand_in.key:
                yield Record(msg.seq, stand_in, msg.time_s, error=f"undecodable entry: {str(exc)[:200]}")
            continue
        if flt.matches(entry):
            yield Record(msg.seq, entry, msg.time_s)


def _key_of(subjects: Subjects, subject: str) -> str:
    try:
        return str(subjects.key_of_log_subject(subject))
    except ValueError:
        return subject


async def follow_log(
    js: JetStreamContext,
    subjects: Subjects,
    flt: Filter = Filter(),
    *,
    since_s: float | None = None,
    start_seq: int | None = None,
    since: Since | None = None,
) -> AsyncIterator[Record]:
    """Entries as they are appended (after the stored ones selected by since/start), until closed."""
    if since is not None:
        start_seq = since.seq if since.seq is not None else start_seq
        if since.time_s is not None:
            since_s = max(0.0, time.time() - since.time_s)
    cfg = api.ConsumerConfig(
        ack_policy=api.AckPolicy.NONE,
        filter_subject=flt.subject(subjects),
        mem_storage=True,
        inactive_threshold=30.0,
    )
    if start_seq is not None:
        cfg.deliver_policy, cfg.opt_start_seq = api.DeliverPolicy.BY_START_SEQUENCE, start_seq
    elif since_s is not None:
        cfg.deliver_policy = api.DeliverPolicy.BY_START_TIME
        cfg.opt_start_time = datetime.datetime.fromtimestamp(time.time() - since_s, datetime.UTC)
    else:
        cfg.deliver_policy = api.DeliverPolicy.NEW
    queue: asyncio.Queue[Msg] = asyncio.Queue(maxsize=10_000)

    async def on_msg(msg: Msg) -> None:
        await queue.put(msg)

    sub = await js.subscribe(
        flt.subject(subjects), stream=subjects.stream_log, cb=on_msg, ordered_consumer=True, config=cfg
    )
    try:
        while True:
            msg = await queue.get()
            entry = decode_entry(msg.data)
            if flt.matches(entry):
                yield Record(msg.metadata.sequence.stream, entry, msg.metadata.timestamp.timestamp())
    finally:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()


# ------------------------------------------------------------------------ export file format
_rec_encoder = msgspec.msgpack.Encoder()
_rec_decoder = msgspec.msgpack.Decoder(Record)


def encode_record(rec: Record) -> bytes:
    body = _rec_encoder.encode(rec)
    return len(body).to_bytes(4, "big") + body


def iter_export(data: bytes) -> Iterator[Record]:
    """Records of an export file (length-prefixed msgpack after a magic line)."""
    if not data.startswith(EXPORT_MAGIC):
        raise ValueError("not a vmfence export file (bad magic line)")
    rest = yield from _records_in(data, len(EXPORT_MAGIC))
    if rest < len(data):
        raise ValueError(f"export file truncated at byte {rest + 4}")


def _records_in(data: bytes, pos: int) -> Generator[Record, None, int]:
    """The whole records of ``data`` from ``pos``, each decoded from a view (no copy of its bytes);
    returns where the first incomplete one starts."""
    view = memoryview(data)
    decode = _rec_decoder.decode
    end = len(data)
    while pos + 4 <= end:
        n = int.from_bytes(data[pos : pos + 4], "big")
        if pos + 4 + n > end:
            break
        yield decode(view[pos + 4 : pos + 4 + n])
        pos += 4 + n
    return pos


class _Batches:
    """Batches of the whole records of ``data`` from ``pos`` (``end``: where the first incomplete one
    starts, once exhausted). Each is decoded from a view of ``data`` (no copy of its bytes), a batch
    at a time: decoding a few dozen records, then auditing them, keeps the decoder's code and the
    audit's hot (about a tenth faster than one by one). Of a mapped file, the pages read are handed
    back every ``MAPPED_RELEASE_BYTES``, so the replay's resident memory stays the audit's, not the
    file's."""

    def __init__(self, data: bytes | mmap.mmap, pos: int) -> None:
        self.data, self.end = data, pos

    def __iter__(self) -> Iterator[list[Record]]:
        data = self.data
        view = memoryview(data)
        decode = _rec_decoder.decode
        end = len(data)
        back = PagesBack(data)
        pos = self.end
        try:
            while True:
                batch: list[Record] = []
                while pos + 4 <= end and len(batch) < EXPORT_BATCH:
                    n = int.from_bytes(data[pos : pos + 4], "big")
                    if pos + 4 + n > end:
                        break
                    batch.append(decode(view[pos + 4 : pos + 4 + n]))
                    pos += 4 + n
                self.end = pos
                if not batch:
                    return
                yield batch
                back.upto(pos)
        finally:
            view.release()


EXPORT_BATCH = 64
MAPPED_RELEASE_BYTES = 16 * 1024 * 1024


class PagesBack:
    """Hands the pages of a mapped file read so far back to the kernel every
    ``MAPPED_RELEASE_BYTES``: they stay in the page cache, and the process's resident memory stays
    its audit's, not the file's."""

    def __init__(self, data: bytes | mmap.mmap) -> None:
        self.mapped = data if isinstance(data, mmap.mmap) else None
        self.released = 0

    def upto(self, pos: int) -> None:
        if self.mapped is not None and pos - self.released >= MAPPED_RELEASE_BYTES:
            end = pos - pos % mmap.PAGESIZE
            self.mapped.madvise(mmap.MADV_DONTNEED, self.released, end - self.released)
            self.released = end
EXPORT_CHUNK_BYTES = 4 * 1024 * 1024  # read at a time from an export stream


def _mapped(f: BinaryIO) -> mmap.mmap | None:
    """The file mapped read-only, when it is a regular file (not a pipe or a terminal)."""
    try:
        fd = f.fileno()
        if not stat.S_ISREG(os.fstat(fd).st_mode) or os.fstat(fd).st_size == 0:
            return None
        return mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
    except (OSError, ValueError, io.UnsupportedOperation):
        return None


def iter_export_stream(f: BinaryIO) -> Iterator[Record]:
    """Records of an export read from a file or pipe a chunk at a time: a replay holds one chunk,
    never the whole file (its memory is the audit's, bounded by the keys, not by the log's length)."""
    for batch in iter_export_batches(f):
        yield from batch


def iter_export_batches(f: BinaryIO) -> Iterator[list[Record]]:
    """``iter_export_stream`` a batch of records at a time (what a replay feeds its audit)."""
    head = f.read(len(EXPORT_MAGIC))
    if head != EXPORT_MAGIC:
        raise ValueError("not a vmfence export file (bad magic line)")
    mapped = _mapped(f)
    if mapped is not None:  # a regular file: decoded where the page cache holds it, never copied
        with mapped:
            batches = _Batches(mapped, len(EXPORT_MAGIC))
            yield from batches
            if batches.end < len(mapped):
                raise ValueError(f"export file truncated at byte {batches.end}")
        return
    data = b""
    offset = len(EXPORT_MAGIC)  # of ``data`` in the stream
    while True:
        more = f.read(EXPORT_CHUNK_BYTES)
        if not more:
            if data:
                raise ValueError(f"export file truncated at byte {offset}")
            return
        data = data + more if data else more
        batches = _Batches(data, 0)
        yield from batches
        data, offset = data[batches.end :], offset + batches.end


def audit_records(records: Iterable[Record], *, final: bool = True) -> AuditReport:
    """The audit of a list of records (``final``: the system has stopped; end checks apply)."""
    auditor = Auditor()
    for rec in records:
        if rec.error:
            auditor.undecodable(rec.entry.key, rec.seq, rec.error)
        else:
            auditor.feed(rec.entry, rec.seq)
    return auditor.report(final=final)
