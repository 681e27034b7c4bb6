"""Reading the decision log: the whole of it for an audit or an export, or a live subscription
with filters. The same async iterator backs ``vmfence decisions``, ``replay`` and ``export``."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import time
from collections.abc import AsyncIterator, Iterable, Iterator
from dataclasses import dataclass

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
    ts: float = 0.0


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


async def read_log(
    js: JetStreamContext, subjects: Subjects, flt: Filter = Filter(), *, start_seq: int = 1
) -> AsyncIterator[Record]:
    """Every stored entry matching the filter, in stream order, up to the end at call time."""
    async for msg in read_stream(js, subjects.stream_log, flt.subject(subjects), start_seq=start_seq):
        entry = decode_entry(msg.data)
        if flt.matches(entry):
            yield Record(msg.seq, entry)


async def follow_log(
    js: JetStreamContext,
    subjects: Subjects,
    flt: Filter = Filter(),
    *,
    since_s: float | None = None,
    start_seq: int | None = None,
) -> AsyncIterator[Record]:
    """Entries as they are appended (after the stored ones selected by since/start), until closed."""
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
    pos = len(EXPORT_MAGIC)
    while pos < len(data):
        n = int.from_bytes(data[pos : pos + 4], "big")
        pos += 4
        if pos + n > len(data):
            raise ValueError(f"export file truncated at byte {pos}")
        yield _rec_decoder.decode(data[pos : pos + n])
        pos += n


def audit_records(records: Iterable[Record], *, final: bool = True) -> AuditReport:
    """The audit of a list of records (``final``: the system has stopped; end checks apply)."""
    auditor = Auditor()
    for rec in records:
        auditor.feed(rec.entry, rec.seq)
    return auditor.report(final=final)
