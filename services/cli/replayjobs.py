"""Replaying an export file in several processes: ``vmfence replay --file F --jobs N``.

The audit is per key, except one check (a VM is live for one key at a time), so the keys are shared
out by a hash of their name: each of N forked processes maps the whole file, reads every record's
key (a decode that skips the rest), decodes and audits in full only the records of its own keys,
and records each bind and release of a VM. The parent merges the N reports and checks the VM events
of all of them in stream order (``shared.fence.audit.merge_reports`` and ``vm_bound_twice``), so
the merged report is the one-process report. Worth it from a few MiB of file on: below that, the
forks cost more than they save (``SHARDED_MIN_BYTES``).
"""

from __future__ import annotations

import array
import heapq
import mmap
import multiprocessing
import os
import resource
import time
import zlib
from collections.abc import Iterable, Iterator
from multiprocessing.connection import Connection

import msgspec

from shared.bus.logstream import EXPORT_MAGIC, PagesBack, Record
from shared.fence.audit import Auditor, AuditReport, Violation, VMEvent, merge_reports, vm_bound_twice

SHARDED_MIN_BYTES = 8 * 1024 * 1024
MAX_JOBS = 64


class _KeyOnlyEntry(msgspec.Struct):
    key: str


class _KeyOnlyRecord(msgspec.Struct):
    """The part of a record a shard needs to know whether the record is its own."""

    seq: int
    entry: _KeyOnlyEntry


class ShardResult(msgspec.Struct):
    """What one shard found: its report, its VM events, and the span and times the parent reports."""

    report: AuditReport
    vm_events: list[VMEvent]
    event_times: list[float]  # the time of each VM event's entry
    violation_times: list[float]  # the time of the entry at which each violation was found
    first_seq: int = 0
    first_t: float = 0.0
    last_seq: int = 0
    last_t: float = 0.0
    cpu_seconds: float = 0.0
    peak_rss_kib: int = 0


def peak_rss_kib() -> int:
    """This process's own peak resident memory (VmHWM). Not getrusage's ru_maxrss: Linux carries
    that across exec, so a replay started by a process holding a large file would report its
    parent's memory."""
    try:
        with open("/proc/self/status", "rb") as f:
            for line in f:
                if line.startswith(b"VmHWM:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def default_jobs() -> int:
    """The CPUs this process may run on (at most 8: past that the shared key scan dominates)."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    return max(1, min(n, 8))


# What reading every record's key costs the parent, as a share of what auditing the whole log
# costs one process (measured: ~1 us of ~4 us per entry). The parent, which also audits shard 0,
# takes that much less of the keys, so that it and the other shards finish together.
SCAN_SHARE = 0.25


def parent_share(shards: int) -> float:
    """The share of the keys the parent audits: equal work, its key scan counted."""
    return max(0.0, (1.0 - SCAN_SHARE * (shards - 1)) / shards) if shards > 1 else 1.0


def _shard_of_hash(h: int, shards: int, parent_permille: int) -> int:
    if shards == 1 or h % 1000 < parent_permille:
        return 0
    return 1 + (h // 1000) % (shards - 1)


def shard_of(key: str, shards: int) -> int:
    """A key's shard: stable across processes and runs (``hash()`` of a str is salted per process)."""
    return _shard_of_hash(zlib.crc32(key.encode()), shards, round(1000 * parent_share(shards)))


# A record's body begins {"seq": <int>, "entry": {"key": <str>, ...: msgspec writes a struct's fields
# in their order, and Record and LogEntry both begin so. The key is read from those bytes where they
# have that shape (a check of a few bytes), and by a decode that skips the rest where they do not.
_RECORD_HEAD = b"\x84\xa3seq"
_INT_BYTES = {**{b: 1 for b in range(0x80)}, 0xCC: 2, 0xCD: 3, 0xCE: 5, 0xCF: 9}
_ENTRY_HEAD = b"\xa5entry"
_KEY_FIELD = b"\xa3key"


def key_bytes(data: bytes | mmap.mmap, start: int, end: int) -> bytes:
    """The UTF-8 bytes of the key of the record whose body is ``data[start:end]``."""
    if data[start : start + 5] == _RECORD_HEAD:
        p = start + 5 + _INT_BYTES.get(data[start + 5], 0)
        if (data[p : p + 6] == _ENTRY_HEAD and 0x80 <= data[p + 6] <= 0x8F
                and data[p + 7 : p + 11] == _KEY_FIELD):
            h = data[p + 11]
            if 0xA0 <= h <= 0xBF:
                q = p + 12 + (h & 0x1F)
                if q <= end:
                    return data[p + 12 : q]
            elif h == 0xD9 and p + 13 + data[p + 12] <= end:
                return data[p + 13 : p + 13 + data[p + 12]]
    return _key_only(memoryview(data)[start:end]).entry.key.encode()


_key_only = msgspec.msgpack.Decoder(_KeyOnlyRecord).decode


OFFSETS_BATCH = 2048  # record offsets sent to a shard at a time (16 KiB: well under a pipe's 64 KiB)


def _scan(data: bytes | mmap.mmap, shards: int, send: list[int]) -> Iterator[array.array[int]]:
    """The parent's part: walk the records and read each one's key; send each other shard the
    offsets of its records (a batch at a time) while it audits what it was sent before, and yield
    the batches of shard 0, which the parent audits itself between sends. ``send[i]``: shard i's
    pipe (``send[0]`` unused)."""
    pending = [array.array("Q") for _ in range(shards)]
    shard_of_key: dict[bytes, int] = {}
    permille = round(1000 * parent_share(shards))
    back = PagesBack(data)
    pos, end = len(EXPORT_MAGIC), len(data)
    while pos + 4 <= end:
        size = int.from_bytes(data[pos : pos + 4], "big")
        if pos + 4 + size > end:
            break
        key = key_bytes(data, pos + 4, pos + 4 + size)
        i = shard_of_key.get(key)
        if i is None:
            i = shard_of_key[key] = _shard_of_hash(zlib.crc32(key), shards, permille)
        out = pending[i]
        out.append(pos)
        if len(out) >= OFFSETS_BATCH:
            if i:
                _send_all(send[i], out.tobytes())
                del out[:]
            else:
                yield out
                out = pending[0] = array.array("Q")
            back.upto(pos)
        pos += 4 + size
    for i, out in enumerate(pending):
        if out and i:
            _send_all(send[i], out.tobytes())
    for i in range(1, shards):  # the other shards may finish while the parent audits its last batch
        os.close(send[i])
        send[i] = -1
    if pending[0]:
        yield pending[0]
    if pos < end:
        raise ValueError(f"export file truncated at byte {pos}")


def _send_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _offsets(fd: int) -> Iterator[array.array[int]]:
    """The batches of record offsets the parent sends, until it closes the pipe."""
    buf = b""
    while True:
        more = os.read(fd, 1 << 16)
        if not more:
            return
        buf += more
        whole = len(buf) - len(buf) % 8
        if whole:
            batch = array.array("Q")
            batch.frombytes(buf[:whole])
            buf = buf[whole:]
            yield batch


class AuditFeed:
    """Feeds an auditor records in log order and notes what a report says besides the audit: the
    span (first and last sequence, first and latest time) and the time of the entry at which each
    violation (and, for a shard, each VM event) was found; keeps the records only when asked (an
    HTML report needs them; otherwise memory is the audit's, bounded by the keys)."""

    def __init__(self, auditor: Auditor, keep: list[Record] | None = None) -> None:
        self.auditor = auditor
        self.keep = keep
        self.first_seq, self.first_t, self.last_seq, self.last_t = 0, 0.0, 0, 0.0
        self.violation_times: list[float] = []
        self.event_times: list[float] = []

    def feed_all(self, records: Iterable[Record]) -> None:
        """One loop with its lookups hoisted: a replay runs it per entry."""
        auditor = self.auditor
        feed = auditor.feed
        keep = self.keep
        found = auditor.found
        events = auditor.vm_events if auditor.vm_events is not None else []
        violation_times, event_times = self.violation_times, self.event_times
        first_seq, last_t = self.first_seq, self.last_t
        rec: Record | None = None
        for rec in records:
            entry = rec.entry
            ne, nv = len(events), len(found)
            if rec.error:
                auditor.undecodable(entry.key, rec.seq, rec.error)
            else:
                feed(entry, rec.seq)
            t = entry.at or rec.ts  # Record.written_at()
            if not first_seq:
                first_seq, self.first_t = rec.seq, t
            if t > last_t:
                last_t = t
            if len(events) != ne:
                event_times.extend([t] * (len(events) - ne))
            if len(found) != nv:
                violation_times.extend([t] * (len(found) - nv))
            if keep is not None:
                keep.append(rec)
        if rec is not None:
            self.last_seq = rec.seq
        self.first_seq, self.last_t = first_seq, last_t


def audit_shard(data: bytes | mmap.mmap, offsets: Iterable[array.array[int]], final: bool) -> ShardResult:
    """Audit the records at ``offsets`` (a shard's, in stream order), recording VM events."""
    cpu0 = time.process_time()
    auditor = Auditor(shard=True)
    run = AuditFeed(auditor)
    record_of = msgspec.msgpack.Decoder(Record).decode
    view = memoryview(data)
    back = PagesBack(data)
    try:
        for batch in offsets:
            # decoded a batch at a time, then audited: the decoder's and the audit's code stay hot
            run.feed_all([record_of(view[p + 4 : p + 4 + int.from_bytes(data[p : p + 4], "big")]) for p in batch])
            back.upto(batch[-1])
    finally:
        view.release()
    assert auditor.vm_events is not None
    return ShardResult(
        auditor.report(final=final), auditor.vm_events, run.event_times, run.violation_times,
        first_seq=run.first_seq, first_t=run.first_t, last_seq=run.last_seq, last_t=run.last_t,
        cpu_seconds=time.process_time() - cpu0, peak_rss_kib=peak_rss_kib(),
    )


def _shard_main(path: str, recv: int, close: list[int], conn: Connection, final: bool) -> None:
    """A shard process: audit what the parent sends, answer with the result (or the error)."""
    for fd in close:  # the write ends of every shard's pipe, inherited by the fork: the parent's alone
        os.close(fd)
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            result = audit_shard(data, _offsets(recv), final)
        conn.send_bytes(b"ok" + msgspec.msgpack.encode(result))
    except Exception as exc:  # reported to the parent, which fails the replay with it
        conn.send_bytes(b"er" + f"{type(exc).__name__}: {exc}".encode())
    finally:
        conn.close()


class Merged(msgspec.Struct):
    """The shards' results as one: the report, and the time of each of its violations."""

    report: AuditReport
    violation_times: list[float]
    first_seq: int
    first_t: float
    last_seq: int
    last_t: float
    cpu_seconds: float  # the shards' own
    peak_rss_kib: int  # the largest of the shards'


def merge(results: list[ShardResult]) -> Merged:
    """One report of the shards' (pure: the parent's share of a sharded replay)."""
    # each shard's VM events are in its stream order; merged by sequence they are the log's order
    timed = list(heapq.merge(*[zip(r.vm_events, r.event_times, strict=True) for r in results],
                             key=lambda et: et[0].seq))
    cross = vm_bound_twice(e for e, _t in timed)
    cross_key: list[Violation] = [v for _i, v in cross]
    report = merge_reports([r.report for r in results], cross_key)
    time_of: dict[int, float] = {}
    for r in results:
        for v, t in zip(r.report.violations, r.violation_times, strict=False):
            time_of[id(v)] = t
    for i, v in cross:
        time_of[id(v)] = timed[i][1]
    spans = [r for r in results if r.first_seq]
    return Merged(
        report=report,
        violation_times=[time_of.get(id(v), 0.0) for v in report.violations],
        first_seq=min((r.first_seq for r in spans), default=0),
        first_t=min(spans, key=lambda r: r.first_seq).first_t if spans else 0.0,
        last_seq=max((r.last_seq for r in spans), default=0),
        last_t=max((r.last_t for r in spans), default=0.0),
        cpu_seconds=sum(r.cpu_seconds for r in results),
        peak_rss_kib=max((r.peak_rss_kib for r in results), default=0),
    )


def audit_file(path: str, jobs: int, *, final: bool) -> Merged:
    """Audit an export file as ``jobs`` shards: this process reads every key and audits shard 0,
    ``jobs - 1`` forked processes the others; then merge what they found."""
    ctx = multiprocessing.get_context("fork")  # the shards need nothing but this module's code
    pipes = [os.pipe() for _ in range(1, jobs)]
    writers = [-1] + [w for _r, w in pipes]
    conns = [ctx.Pipe(duplex=False) for _ in range(1, jobs)]
    procs = [ctx.Process(target=_shard_main, args=(path, r, writers[1:], send, final), daemon=True)
             for (r, _w), (_recv, send) in zip(pipes, conns, strict=True)]
    try:
        for proc in procs:
            proc.start()
        for (r, _w), (_recv, send) in zip(pipes, conns, strict=True):
            os.close(r)
            send.close()
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            if data[: len(EXPORT_MAGIC)] != EXPORT_MAGIC:
                raise ValueError("not a vmfence export file (bad magic line)")
            broken = False
            results: list[ShardResult] = []
            try:
                results.append(audit_shard(data, _scan(data, jobs, writers), final))
            except BrokenPipeError:
                broken = True  # a shard stopped before it was sent all its records: its answer says why
        for recv, _send in conns:
            try:
                answer = recv.recv_bytes()
            except EOFError:
                raise OSError("a replay process died before it answered") from None
            if answer[:2] != b"ok":
                raise ValueError(answer[2:].decode(errors="replace"))
            results.append(msgspec.msgpack.decode(answer[2:], type=ShardResult))
        if broken:
            raise OSError("a replay process stopped before it was sent all its records")
    finally:
        for w in writers:
            if w >= 0:
                os.close(w)
        for proc in procs:
            if proc.is_alive():
                proc.terminate()
            proc.join(timeout=10)
    return merge(results)
