"""Reading streams: a subject's last message, one subject in order, a whole stream with gap detection."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import logging
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from dataclasses import dataclass

import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext, api

from shared.bus.retry import Retry, retry_transient

log = logging.getLogger(__name__)

READ_TIMEOUT_S = 5.0  # one get / one pull batch
READ_STALL_S = 2 * READ_TIMEOUT_S  # no message nor status: the server or connection is gone
READ_BATCH = 2048  # messages per pull request in read_stream
READ_CONSUMER_IDLE_S = 30.0  # the server deletes an abandoned read consumer after this



@dataclass(frozen=True, slots=True)
class StoredMsg:
    """One stored stream message."""

    seq: int
    subject: str
    headers: Mapping[str, str]
    data: bytes
    time_s: float = 0.0  # when the server stored it (seconds since the epoch; 0 = not known)


def _stored(raw: api.RawStreamMsg) -> StoredMsg:
    assert raw.seq is not None and raw.subject is not None
    return StoredMsg(seq=raw.seq, subject=raw.subject, headers=dict(raw.headers or {}), data=raw.data or b"",
                     time_s=_rfc3339_seconds(raw.time))


def _rfc3339_seconds(stamp: object) -> float:
    """The server's RFC 3339 timestamp of a direct/get message (nanosecond digits allowed)."""
    if not isinstance(stamp, str) or not stamp:
        return 0.0
    head, _, frac = stamp.rstrip("Z").partition(".")
    try:
        base = datetime.datetime.fromisoformat(head).replace(tzinfo=datetime.UTC).timestamp()
    except ValueError:
        return 0.0
    digits = "".join(c for c in frac if c.isdigit())
    return base + (int(digits) / 10 ** len(digits) if digits else 0.0)


async def last_on_subject(js: JetStreamContext, stream: str, subject: str) -> StoredMsg | None:
    """The subject's last message, read from the stream leader (a consistent read), or None."""
    try:
        raw = await js.get_last_msg(stream, subject)
    except nats.js.errors.NotFoundError:
        return None
    return _stored(raw)


async def read_subject(
    js: JetStreamContext, stream: str, subject: str, *, after_seq: int = 0
) -> AsyncIterator[StoredMsg]:
    """All messages of one subject after after_seq, in order (leader `next_by_subj` gets).

    One request per message: meant for re-reading one key's log after a lost race.
    """
    seq = after_seq + 1
    while True:
        try:
            raw = await js.get_msg(stream, seq=seq, subject=subject, next=True)
        except nats.js.errors.NotFoundError:
            return
        msg = _stored(raw)
        yield msg
        seq = msg.seq + 1


def _reply_meta(reply: str) -> tuple[int, int, int]:
    """Stream sequence, consumer sequence and stored time (ns) from a JetStream ack subject (v1
    and v2 layouts)."""
    tokens = reply.split(".")
    if len(tokens) == 9:  # $JS.ACK.<stream>.<consumer>.<delivered>.<sseq>.<cseq>.<ts>.<pending>
        return int(tokens[5]), int(tokens[6]), int(tokens[7])
    # v2: $JS.ACK.<domain>.<hash>.<stream>.<consumer>.<delivered>.<sseq>.<cseq>.<ts>.<pending>[.<rand>]
    return int(tokens[7]), int(tokens[8]), int(tokens[9])


def _reply_seqs(reply: str) -> tuple[int, int]:
    """Stream and consumer sequence from a JetStream ack subject."""
    seq, cseq, _ = _reply_meta(reply)
    return seq, cseq


async def _last_matching_seq(js: JetStreamContext, stream: str, filter_subject: str | None) -> int:
    """Sequence of the last stored message matching the filter (0 if none), asked of the leader."""
    if filter_subject is not None:
        filters = [filter_subject]
    else:
        filters = list((await js.stream_info(stream)).config.subjects or [])
    best = 0
    for f in filters:
        try:
            raw = await js.get_last_msg(stream, f)  # wildcards are allowed here
        except nats.js.errors.NotFoundError:
            continue
        best = max(best, int(raw.seq or 0))
    return best


class _DeliveryGap(Exception):
    """A read consumer's delivery went missing (a client-side slow-consumer drop, a reconnect)."""

    def __init__(self, target: int) -> None:
        super().__init__(target)
        self.target = target  # where the read that met the gap would have ended


async def read_stream(
    js: JetStreamContext,
    stream: str,
    filter_subject: str | None = None,
    *,
    start_seq: int = 1,
    until_seq: int | None = None,
    batch: int = READ_BATCH,
) -> AsyncIterator[StoredMsg]:
    """Every stored message (optionally filtered) from start_seq in order, fast, for replay/export.

    Stops at until_seq, or at the last matching message when the call starts (asked of the stream
    leader: an R1 read consumer may sit on a replica that is still catching up, so its "nothing
    pending" is not trusted). An AckNone consumer is never redelivered to, so a delivery lost on
    the way (the client dropped it as a slow consumer, or the connection was reset) would be a
    silent hole: consumer sequences are contiguous, and a gap restarts the read after the last
    message yielded. Wrap it in ``contextlib.aclosing`` when breaking out early so the consumer is
    deleted at once (it would otherwise expire after READ_CONSUMER_IDLE_S).
    """
    position = max(start_seq, 1) - 1
    restarts, restarted_at = Retry(), position
    while True:
        try:
            once = _read_stream_once(js, stream, filter_subject, position + 1, until_seq, batch)
            async with contextlib.aclosing(once) as reader:
                async for m in reader:
                    position = m.seq
                    yield m
            return
        except _DeliveryGap as gap:
            until_seq = gap.target  # the same end as the first read's
            log.info("read_stream %s: a delivery went missing after seq %d; reading on from there", stream, position)
            if position > restarted_at:  # progress since the last gap: a fresh budget
                restarts, restarted_at = Retry(), position
            if not await restarts.backoff():
                raise TimeoutError(f"read_stream {stream}: deliveries keep going missing") from None


async def _read_stream_once(
    js: JetStreamContext,
    stream: str,
    filter_subject: str | None,
    start_seq: int,
    until_seq: int | None,
    batch: int,
) -> AsyncGenerator[StoredMsg, None]:
    """One ephemeral AckNone pull consumer, with one batch request in flight ahead of the reader."""
    start = max(start_seq, 1)
    target = await _last_matching_seq(js, stream, filter_subject)
    if until_seq is not None:
        target = min(target, until_seq)
    if target < start:
        return
    nc: Client = js._nc
    cfg = api.ConsumerConfig(
        deliver_policy=api.DeliverPolicy.BY_START_SEQUENCE,
        opt_start_seq=start,
        ack_policy=api.AckPolicy.NONE,
        filter_subject=filter_subject,
        inactive_threshold=READ_CONSUMER_IDLE_S,
        mem_storage=True,
        num_replicas=1,
        max_waiting=16,
    )
    # a consumer create can time out while a restarted node rejoins: bounded retry (an orphan from
    # a lost reply expires by inactive_threshold)
    cinfo = await retry_transient(
        lambda: js._jsm.add_consumer(stream, config=cfg, timeout=READ_TIMEOUT_S), lambda err, _: err
    )
    consumer = cinfo.name

    inbox = nc.new_inbox()
    buf: deque[Msg] = deque()
    wake = asyncio.Event()

    async def on_msg(msg: Msg) -> None:
        buf.append(msg)
        wake.set()

    sub = await nc.subscribe(inbox, cb=on_msg, pending_msgs_limit=batch * 4)
    next_subject = f"{js._prefix}.CONSUMER.MSG.NEXT.{stream}.{consumer}"  # honours domains
    expires_ns = int(READ_TIMEOUT_S * 1e9)

    async def request(n: int) -> None:
        await nc.publish(next_subject, json.dumps({"batch": n, "expires": expires_ns}).encode(), reply=inbox)

    try:
        outstanding = 0  # messages requested and not yet received
        no_responders = Retry()
        position = start - 1  # last sequence yielded (or skipped past)
        delivered = 0  # last consumer sequence received: they are contiguous, a gap is a lost delivery
        await request(batch)
        outstanding += batch
        while True:
            quiet = 0.0
            while not buf:
                wake.clear()
                try:
                    await asyncio.wait_for(wake.wait(), READ_TIMEOUT_S)
                except TimeoutError:
                    # nothing came: were our last deliveries sent and lost on the way? (no later
                    # one arrives to show the gap, and this request may not even expire loudly)
                    if await _sent_but_not_received(js, stream, consumer, delivered):
                        raise _DeliveryGap(target) from None
                    quiet += READ_TIMEOUT_S
                    if quiet >= READ_STALL_S:
                        raise TimeoutError(f"read_stream {stream}: nothing within {READ_STALL_S}s") from None
            msg = buf.popleft()
            if not msg.reply:  # a status message, not a stored one
                status = msg.headers.get("Status") if msg.headers else None
                if status in ("404", "408"):  # a pull request ran out: how much of it was unfilled?
                    unfilled = msg.headers.get("Nats-Pending-Messages") if msg.headers else None
                    outstanding = max(0, outstanding - int(unfilled)) if unfilled else 0
                    # Were the remaining messages removed (age, limits, delete) meanwhile?
                    target = min(target, await _last_matching_seq(js, stream, filter_subject))
                    if position >= target:
                        return
                    if await _sent_but_not_received(js, stream, consumer, delivered):
                        raise _DeliveryGap(target)  # the last deliveries were lost: none shows the gap
                    if outstanding <= batch // 2:
                        await request(batch)
                        outstanding += batch
                    continue
                if status == "503":  # no responders: a new R1 consumer not yet live on its node
                    outstanding = max(0, outstanding - batch)
                    log.debug("read_stream %s: pull request had no responders; retrying", stream)
                    if not await no_responders.backoff():
                        raise nats.js.errors.APIError.from_msg(msg)
                    await request(batch)
                    outstanding += batch
                    continue
                if status == "409" and "Max" in (msg.headers or {}).get("Description", ""):
                    continue  # e.g. Exceeded MaxWaiting: an extra request was refused, others stand
                raise nats.js.errors.APIError.from_msg(msg)
            outstanding -= 1
            if outstanding <= batch // 2:
                await request(batch)
                outstanding += batch
            seq, cseq, stored_ns = _reply_meta(msg.reply)
            if cseq != delivered + 1:
                raise _DeliveryGap(target)
            delivered = cseq
            if seq > target:
                return
            position = seq
            yield StoredMsg(seq=seq, subject=msg.subject, headers=dict(msg.headers or {}), data=msg.data,
                            time_s=stored_ns / 1e9)
            if seq >= target:
                return
    finally:
        try:
            await sub.unsubscribe()
        except nats.errors.Error:
            pass
        await _delete_consumer_quietly(js, stream, consumer)


async def _sent_but_not_received(js: JetStreamContext, stream: str, consumer: str, received: int) -> bool:
    """Whether the consumer delivered past consumer sequence ``received`` (so those were lost)."""
    try:
        info = await js._jsm.consumer_info(stream, consumer, timeout=READ_TIMEOUT_S)
    except (nats.errors.Error, TimeoutError):
        return False  # unknown: the caller waits on and asks again
    return info.delivered is not None and info.delivered.consumer_seq > received


async def _delete_consumer_quietly(js: JetStreamContext, stream: str, consumer: str | None) -> None:
    """Best effort: an ephemeral consumer also expires by inactive_threshold."""
    if consumer is None:
        return
    try:
        await asyncio.wait_for(js.delete_consumer(stream, consumer), READ_TIMEOUT_S)
    except (nats.errors.Error, TimeoutError):
        pass
