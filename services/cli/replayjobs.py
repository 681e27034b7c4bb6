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

import heapq
import mmap
import multiprocessing
import os
import time
import zlib
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

import msgspec

from shared.bus.logstream import EXPORT_MAGIC, MAPPED_RELEASE_BYTES, Record
from shared.fence.audit import Auditor, AuditReport, Violation, VMEvent, merge_reports, vm_bound_twice

SHARDED_MIN_BYTES = 8 * 1024 * 1024
MAX_JOBS = 64
DECODE_BATCH = 64  # records decoded before they are audited: the decoder's and the audit's code stay hot


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


def default_jobs() -> int:
    """The CPUs this process may run on (at most 8: past that the shared key scan dominates)."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    return max(1, min(n, 8))


def shard_of(key: str, shards: int) -> int:
    """A key's shard: stable across processes and runs (``hash()`` of a str is salted per process)."""
    return zlib.crc32(key.encode()) % shards


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


def audit_shard(path: str, shard: int, shards: int, final: bool) -> ShardResult:
    """Audit the records of ``path`` whose keys fall in ``shard`` (run in a forked process)."""
    cpu0 = time.process_time()
    auditor = Auditor(shard=True)
    feed = auditor.feed
    events = auditor.vm_events
    assert events is not None
    found = auditor.found
    record_of = msgspec.msgpack.Decoder(Record).decode
    mine: dict[bytes, bool] = {}
    result = ShardResult(AuditReport(), events, [], [])
    event_times, violation_times = result.event_times, result.violation_times
    first_seq, first_t, last_t = 0, 0.0, 0.0
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        view = memoryview(data)
        batch: list[memoryview] = []
        try:
            pos, end, released = len(EXPORT_MAGIC), len(data), 0
            while True:
                while pos + 4 <= end and len(batch) < DECODE_BATCH:
                    size = int.from_bytes(data[pos : pos + 4], "big")
                    if pos + 4 + size > end:
                        raise ValueError(f"export file truncated at byte {pos}")
                    key = key_bytes(data, pos + 4, pos + 4 + size)
                    own = mine.get(key)
                    if own is None:
                        own = mine[key] = zlib.crc32(key) % shards == shard
                    if own:
                        batch.append(view[pos + 4 : pos + 4 + size])
                    pos += 4 + size
                if not batch:
                    break
                for rec in [record_of(b) for b in batch]:
                    entry = rec.entry
                    ne, nv = len(events), len(found)
                    if rec.error:
                        auditor.undecodable(entry.key, rec.seq, rec.error)
                    else:
                        feed(entry, rec.seq)
                    t = entry.at or rec.ts
                    if not first_seq:
                        first_seq, first_t = rec.seq, t
                    if t > last_t:
                        last_t = t
                    result.last_seq = rec.seq
                    if len(events) != ne:
                        event_times.extend([t] * (len(events) - ne))
                    if len(found) != nv:
                        violation_times.extend([t] * (len(found) - nv))
                batch.clear()
                if pos - released >= MAPPED_RELEASE_BYTES:  # hand the pages read back (RSS stays the audit's)
                    upto = pos - pos % mmap.PAGESIZE
                    data.madvise(mmap.MADV_DONTNEED, released, upto - released)
                    released = upto
            if pos < end:
                raise ValueError(f"export file truncated at byte {pos}")
        finally:  # every view of the mapping ends before it is closed
            batch.clear()
            view.release()
    result.report = auditor.report(final=final)
    result.first_seq, result.first_t, result.last_t = first_seq, first_t, last_t
    result.cpu_seconds = time.process_time() - cpu0
    return result


class Merged(msgspec.Struct):
    """The shards' results as one: the report, and the time of each of its violations."""

    report: AuditReport
    violation_times: list[float]
    first_seq: int
    first_t: float
    last_seq: int
    last_t: float
    cpu_seconds: float  # the shards' own


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
    )


def audit_file(path: str, jobs: int, *, final: bool) -> Merged:
    """Audit an export file in ``jobs`` forked processes and merge what they found."""
    ctx = multiprocessing.get_context("fork")  # the workers need nothing but this module's code
    try:
        with ProcessPoolExecutor(max_workers=jobs, mp_context=ctx) as pool:
            futures = [pool.submit(audit_shard, path, i, jobs, final) for i in range(jobs)]
            results = [f.result() for f in futures]
    except BrokenProcessPool as exc:  # a shard was killed (out of memory, a signal)
        raise OSError(f"a replay process died: {exc}") from None
    return merge(results)
