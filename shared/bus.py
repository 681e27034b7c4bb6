"""Bus helpers: connecting, provisioning streams, fenced appends, reads, dead letters and leases.

Everything here is written against the measured behaviour of nats-py 2.16 / nats-server 2.15 (see
DESIGN.md): fenced appends use one synchronous request each, a ``10071`` is disambiguated by the
subject's last ``Nats-Msg-Id`` before it counts as a lost race, and ``10163``/``10164``/timeouts
during an R3 leader election are retried a bounded number of times.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import time
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Literal

import msgspec
import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext, api
from nats.js.kv import KeyValue

from shared.subjects import DEFAULT_PARTITIONS, Subjects
from shared.tasks import sleep_unless_set

log = logging.getLogger(__name__)

# --- headers and error codes -------------------------------------------------------------------

H_EXPECTED_LAST_SUBJECT_SEQ = "Nats-Expected-Last-Subject-Sequence"
H_MSG_ID = "Nats-Msg-Id"
H_REASON = "Vmfence-Reason"
H_ORIGINAL_SUBJECT = "Vmfence-Original-Subject"
META_PARTITIONS = "vmfence.partitions"

ERR_WRONG_LAST_SEQUENCE = 10071  # Nats-Expected-Last-Subject-Sequence did not match
ERR_IN_FLIGHT_PROPOSAL = (10163, 10164)  # R3: another proposal on the same subject is in flight
ERR_STREAM_NAME_IN_USE = 10058  # add_stream with a different config for an existing name
ERR_NO_SUITABLE_PEERS = 10005  # placement: a peer is offline or not yet caught up (a forming cluster)
RETRIABLE_HTTP_CODES = (503,)  # JetStream temporarily unavailable (no leader yet)

# --- bounds --------------------------------------------------------------------------------------

CONNECT_TIMEOUT_S = 5.0
RECONNECT_WAIT_S = 1.0
PING_INTERVAL_S = 5  # a dead server is noticed after PING_INTERVAL_S * MAX_OUTSTANDING_PINGS
MAX_OUTSTANDING_PINGS = 3
APPEND_TIMEOUT_S = 5.0
# A JetStream leader election answers "no responders"/503 at once for a few seconds, so retries
# are bounded by a time budget as well as a count.
APPEND_MAX_ATTEMPTS = 60  # requests per fenced append / publish before AppendFailed
APPEND_RETRY_BUDGET_S = 20.0  # total time spent retrying one append / publish
BACKOFF_BASE_S = 0.02
BACKOFF_MAX_S = 0.5
READ_TIMEOUT_S = 5.0  # one get / one pull batch
READ_STALL_S = 2 * READ_TIMEOUT_S  # no message nor status: the server or connection is gone
READ_BATCH = 2048  # messages per pull request in read_stream
READ_CONSUMER_IDLE_S = 30.0  # the server deletes an abandoned read consumer after this
LEASE_ACQUIRE_ATTEMPTS = 4  # create/get/update races inside one acquire()

DAY_S = 86_400.0


def backoff_delay(attempt: int) -> float:
    """Exponential backoff with equal jitter, capped at BACKOFF_MAX_S (attempt counts from 0)."""
    cap = min(BACKOFF_MAX_S, BACKOFF_BASE_S * 2.0 ** min(attempt, 32))  # no float overflow
    return cap / 2 + float(random.uniform(0, cap / 2))


class Retry:
    """Bounded retries: at most max_attempts tries and budget_s seconds from creation."""

    def __init__(self, max_attempts: int = APPEND_MAX_ATTEMPTS, budget_s: float = APPEND_RETRY_BUDGET_S):
        self.max_attempts = max_attempts
        self.deadline = time.monotonic() + budget_s
        self.attempt = 0

    async def backoff(self, stop: asyncio.Event | None = None) -> bool:
        """Sleep before the next try; False (without sleeping) once attempts or budget are spent,
        or once ``stop`` is set (it cuts the sleep short)."""
        self.attempt += 1
        remaining = self.deadline - time.monotonic()
        if self.attempt >= self.max_attempts or remaining <= 0:
            return False
        delay = min(remaining, backoff_delay(self.attempt - 1))
        if stop is not None:
            return not await sleep_unless_set(stop, delay)
        await asyncio.sleep(delay)
        return True


_TRANSIENT = (TimeoutError, nats.js.errors.NoStreamResponseError, nats.errors.NoRespondersError)


# --- connecting ----------------------------------------------------------------------------------


async def _on_error(exc: Exception) -> None:
    log.warning("nats error: %r", exc)


async def _on_disconnected() -> None:
    log.info("nats disconnected")  # also on every clean close; a real outage shows up as errors


async def _on_reconnected() -> None:
    log.info("nats reconnected")


async def connect(
    url: str | list[str],
    *,
    name: str,
    user: str | None = None,
    password: str | None = None,
    creds: str | None = None,
    token: str | None = None,
    timeout: float = CONNECT_TIMEOUT_S,  # noqa: ASYNC109 - the connect timeout nats-py takes
    max_reconnect_attempts: int = -1,
    reconnect_time_wait: float = RECONNECT_WAIT_S,
) -> Client:
    """Connect with service-grade reconnects (default: forever, -1) and fast dead-peer detection."""
    servers = [url] if isinstance(url, str) else list(url)
    nc: Client = await nats.connect(
        servers=servers,
        name=name,
        user=user,
        password=password,
        user_credentials=creds,
        token=token,
        connect_timeout=timeout,  # type: ignore[arg-type,unused-ignore]  # annotated int, float works
        allow_reconnect=True,
        max_reconnect_attempts=max_reconnect_attempts,
        reconnect_time_wait=reconnect_time_wait,  # type: ignore[arg-type,unused-ignore]
        ping_interval=PING_INTERVAL_S,
        max_outstanding_pings=MAX_OUTSTANDING_PINGS,
        error_cb=_on_error,
        disconnected_cb=_on_disconnected,
        reconnected_cb=_on_reconnected,
    )
    return nc


@dataclass
class Bus:
    """A connection, its JetStream context and the deployment's subjects, passed around together."""

    nc: Client
    js: JetStreamContext
    subjects: Subjects = field(default_factory=Subjects)

    @classmethod
    async def open(
        cls,
        url: str | list[str],
        *,
        name: str,
        subjects: Subjects | None = None,
        max_reconnect_attempts: int = -1,
        user: str | None = None,
        password: str | None = None,
        creds: str | None = None,
        token: str | None = None,
    ) -> Bus:
        nc = await connect(
            url,
            name=name,
            max_reconnect_attempts=max_reconnect_attempts,
            user=user,
            password=password,
            creds=creds,
            token=token,
        )
        return cls(nc=nc, js=nc.jetstream(), subjects=subjects or Subjects())

    async def close(self) -> None:
        if not self.nc.is_closed:
            await self.nc.close()


# --- provisioning --------------------------------------------------------------------------------


class ProvisionFailed(Exception):
    """Streams could not be created/updated within the bounded retries (cluster busy or down)."""


class PartitionMismatch(Exception):
    """An existing stream was provisioned with a different partition count (a migration)."""


class StreamsConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Retention and replication of the vmfence streams and buckets for one deployment."""

    replicas: Literal[1, 3] = 1
    storage: Literal["file", "memory"] = "file"
    partitions: int = DEFAULT_PARTITIONS
    in_max_age_s: float = 7 * DAY_S
    log_max_age_s: float = 0.0  # 0 = keep forever (audit)
    dlq_max_age_s: float = 30 * DAY_S
    cmd_max_age_s: float = 7 * DAY_S
    duplicate_window_s: float = 120.0
    lease_ttl_s: float = 10.0
    hosts_ttl_s: float = 15.0


def _storage(cfg: StreamsConfig) -> api.StorageType:
    return api.StorageType.FILE if cfg.storage == "file" else api.StorageType.MEMORY


def stream_configs(subjects: Subjects, cfg: StreamsConfig) -> list[api.StreamConfig]:
    """The four vmfence streams as nats-py configs (exposed for tests and `vmfence status`)."""
    meta = {META_PARTITIONS: str(cfg.partitions)}
    common = {
        "storage": _storage(cfg),
        "num_replicas": cfg.replicas,
        "duplicate_window": cfg.duplicate_window_s,
        "discard": api.DiscardPolicy.OLD,
    }
    return [
        api.StreamConfig(
            name=subjects.stream_in,
            subjects=[subjects.in_all],
            retention=api.RetentionPolicy.LIMITS,
            max_age=cfg.in_max_age_s,
            allow_direct=True,
            metadata=dict(meta),
            **common,  # type: ignore[arg-type]
        ),
        api.StreamConfig(
            name=subjects.stream_log,
            subjects=[subjects.log_all],
            retention=api.RetentionPolicy.LIMITS,
            max_age=cfg.log_max_age_s,
            allow_direct=True,
            metadata=dict(meta),
            **common,  # type: ignore[arg-type]
        ),
        api.StreamConfig(
            name=subjects.stream_cmd,
            subjects=[subjects.cmd_all],
            retention=api.RetentionPolicy.WORK_QUEUE,
            max_age=cfg.cmd_max_age_s,
            **common,  # type: ignore[arg-type]
        ),
        api.StreamConfig(
            name=subjects.stream_dlq,
            subjects=[subjects.dlq_all],
            retention=api.RetentionPolicy.LIMITS,
            max_age=cfg.dlq_max_age_s,
            **common,  # type: ignore[arg-type]
        ),
    ]


def kv_stream_config(bucket: str, ttl_s: float, cfg: StreamsConfig) -> api.StreamConfig:
    """A KV bucket's backing stream, as nats-py's create_key_value builds it (history 1, TTL)."""
    return api.StreamConfig(
        name=f"KV_{bucket}",
        subjects=[f"$KV.{bucket}.>"],
        allow_direct=True,
        allow_rollup_hdrs=True,
        allow_msg_ttl=True,
        deny_delete=True,
        discard=api.DiscardPolicy.NEW,
        duplicate_window=min(120.0, ttl_s),
        max_age=ttl_s,
        max_consumers=-1,
        max_msgs=-1,
        max_msgs_per_subject=1,
        num_replicas=cfg.replicas,
        storage=_storage(cfg),
    )


def _check_partitions(info: api.StreamInfo, want: int) -> None:
    recorded = (info.config.metadata or {}).get(META_PARTITIONS)
    if recorded is not None and recorded != str(want):
        raise PartitionMismatch(
            f"stream {info.config.name} was provisioned with {recorded} partitions, this deployment "
            f"uses {want}; changing the partition count is a migration (see docs), not a restart"
        )


async def _ensure_stream(js: JetStreamContext, want: api.StreamConfig, partitions: int | None) -> None:
    """Create the stream, or check and update it; safe when several processes race."""
    assert want.name is not None
    try:
        info: api.StreamInfo | None = await js.stream_info(want.name)
    except nats.js.errors.NotFoundError:
        info = None
    if info is None:
        try:
            await js.add_stream(want)
            return
        except nats.js.errors.APIError as exc:
            if exc.err_code != ERR_STREAM_NAME_IN_USE:
                raise
        # Another process created it first (with some config): fall through to check/update.
        info = await js.stream_info(want.name)
    if partitions is not None:
        _check_partitions(info, partitions)
    # Keep server-added metadata (e.g. _nats.*) and add ours.
    merged_meta = {**(info.config.metadata or {}), **(want.metadata or {})}
    update = want.evolve(metadata=merged_meta or None)
    await js.update_stream(update)


async def _ensure_stream_retrying(js: JetStreamContext, want: api.StreamConfig, partitions: int | None) -> None:
    """_ensure_stream is idempotent, so a timeout or a busy/leaderless cluster is simply retried."""
    retry = Retry()
    while True:
        try:
            await _ensure_stream(js, want, partitions)
            return
        except nats.js.errors.APIError as exc:
            if not _retriable_api_error(exc):
                raise
            last_error: BaseException = exc
        except _TRANSIENT as exc:
            last_error = exc
        log.debug("provision %s: retry after %r", want.name, last_error)
        if not await retry.backoff():
            raise ProvisionFailed(f"provisioning {want.name} failed: {last_error!r}") from last_error


async def provision(js: JetStreamContext, subjects: Subjects, cfg: StreamsConfig) -> None:
    """Idempotently create/update the vmfence streams and KV buckets for this deployment."""
    if cfg.partitions != subjects.partitions:
        raise ValueError(f"StreamsConfig.partitions={cfg.partitions} but Subjects.partitions={subjects.partitions}")
    if cfg.replicas not in (1, 3):
        raise ValueError("replicas must be 1 or 3")
    for sc in stream_configs(subjects, cfg):
        check = cfg.partitions if sc.name in (subjects.stream_in, subjects.stream_log) else None
        await _ensure_stream_retrying(js, sc, check)
    await _ensure_stream_retrying(js, kv_stream_config(subjects.kv_leases, cfg.lease_ttl_s, cfg), None)
    await _ensure_stream_retrying(js, kv_stream_config(subjects.kv_hosts, cfg.hosts_ttl_s, cfg), None)


# --- reading -------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StoredMsg:
    """One stored stream message."""

    seq: int
    subject: str
    headers: Mapping[str, str]
    data: bytes


def _stored(raw: api.RawStreamMsg) -> StoredMsg:
    assert raw.seq is not None and raw.subject is not None
    return StoredMsg(seq=raw.seq, subject=raw.subject, headers=dict(raw.headers or {}), data=raw.data or b"")


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


def _reply_seqs(reply: str) -> tuple[int, int]:
    """Stream and consumer sequence from a JetStream ack subject (v1 and v2 layouts)."""
    tokens = reply.split(".")
    if len(tokens) == 9:  # $JS.ACK.<stream>.<consumer>.<delivered>.<sseq>.<cseq>.<ts>.<pending>
        return int(tokens[5]), int(tokens[6])
    # v2: $JS.ACK.<domain>.<hash>.<stream>.<consumer>.<delivered>.<sseq>.<cseq>.<ts>.<pending>[.<rand>]
    return int(tokens[7]), int(tokens[8])


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
    retry = Retry()
    while True:  # a consumer create can time out while a restarted node rejoins: bounded retry
        try:
            cinfo = await js._jsm.add_consumer(stream, config=cfg, timeout=READ_TIMEOUT_S)
            break
        except nats.js.errors.APIError as exc:
            if not _retriable_api_error(exc):
                raise
            last_error: BaseException = exc
        except _TRANSIENT as exc:
            last_error = exc  # an orphan from a lost reply expires by inactive_threshold
        if not await retry.backoff():
            raise last_error
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
            seq, cseq = _reply_seqs(msg.reply)
            if cseq != delivered + 1:
                raise _DeliveryGap(target)
            delivered = cseq
            if seq > target:
                return
            position = seq
            yield StoredMsg(seq=seq, subject=msg.subject, headers=dict(msg.headers or {}), data=msg.data)
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


# --- fenced append -------------------------------------------------------------------------------


class LostRace(Exception):
    """Someone else appended to the subject since the writer's expected sequence."""

    def __init__(self, subject: str, expected: int, actual_last_seq: int | None) -> None:
        super().__init__(f"lost race on {subject}: expected last seq {expected}, actual {actual_last_seq}")
        self.subject = subject
        self.expected = expected
        self.actual_last_seq = actual_last_seq


class AppendFailed(Exception):
    """An append could not be confirmed within its bounded retries (outcome unknown)."""


def _retriable_api_error(exc: nats.js.errors.APIError) -> bool:
    """Transient: another proposal in flight, no leader yet, or a placement a forming cluster (or
    one restarting a node) refuses until every peer has reported in, even after its meta leader
    saw them all."""
    return exc.err_code in (*ERR_IN_FLIGHT_PROPOSAL, ERR_NO_SUITABLE_PEERS) or exc.code in RETRIABLE_HTTP_CODES


async def fenced_append(
    js: JetStreamContext,
    subject: str,
    payload: bytes,
    *,
    expected_last_subject_seq: int,
    msg_id: str,
    stream: str,
    timeout: float = APPEND_TIMEOUT_S,  # noqa: ASYNC109 - per request, not overall
    headers: dict[str, str] | None = None,
) -> int:
    """Append iff the subject's last sequence is expected_last_subject_seq (0 = empty subject).

    Returns the new stream sequence. Raises LostRace when another writer got there first and
    AppendFailed when retries run out. msg_id must identify *this writer's* entry (e.g. include the
    writer id or a content hash): a retry with the same msg_id that finds its own entry on top is
    reported as success, so two competing writers must never share a msg_id.
    """
    hdrs = dict(headers or {})
    hdrs[H_EXPECTED_LAST_SUBJECT_SEQ] = str(expected_last_subject_seq)
    hdrs[H_MSG_ID] = msg_id
    retry = Retry()
    while True:
        try:
            ack = await js.publish(subject, payload, timeout=timeout, stream=stream, headers=dict(hdrs))
            return int(ack.seq)  # duplicate=True (R3 retry) carries the original sequence
        except nats.js.errors.APIError as exc:
            if exc.err_code == ERR_WRONG_LAST_SEQUENCE:
                return await _resolve_wrong_last(js, stream, subject, msg_id, expected_last_subject_seq)
            if not _retriable_api_error(exc):
                raise
            last_error: BaseException = exc
        except _TRANSIENT as exc:
            last_error = exc  # maybe landed: the retry's Msg-Id/expected-seq resolves it
        log.debug("append to %s: retry %d after %r", subject, retry.attempt + 1, last_error)
        if not await retry.backoff():
            raise AppendFailed(
                f"append to {subject} unconfirmed after {retry.attempt} attempts: {last_error!r}"
            ) from last_error


async def _resolve_wrong_last(js: JetStreamContext, stream: str, subject: str, msg_id: str, expected: int) -> int:
    """10071: a benign retry if the subject's last message is ours, else a lost race."""
    retry = Retry()
    while True:
        try:
            last = await last_on_subject(js, stream, subject)
            break
        except nats.js.errors.APIError as exc:
            if not _retriable_api_error(exc):
                raise
            last_error: BaseException = exc
        except _TRANSIENT as exc:
            last_error = exc
        if not await retry.backoff():
            raise AppendFailed(
                f"append to {subject}: wrong last sequence and its last message is unreadable: {last_error!r}"
            ) from last_error
    if last is not None and last.headers.get(H_MSG_ID) == msg_id:
        return last.seq
    raise LostRace(subject, expected, None if last is None else last.seq)


# --- plain publishes -----------------------------------------------------------------------------


async def _publish_retrying(
    js: JetStreamContext, subject: str, payload: bytes, headers: dict[str, str], request_timeout_s: float
) -> api.PubAck:
    """Synchronous publish with bounded retries on transient errors (leader election, timeouts)."""
    retry = Retry()
    while True:
        try:
            return await js.publish(subject, payload, timeout=request_timeout_s, headers=dict(headers))
        except nats.js.errors.APIError as exc:
            if not _retriable_api_error(exc):
                raise
            last_error: BaseException = exc
        except _TRANSIENT as exc:
            last_error = exc
        if not await retry.backoff():
            raise AppendFailed(
                f"publish to {subject} unconfirmed after {retry.attempt} attempts: {last_error!r}"
            ) from last_error


async def publish_input(
    js: JetStreamContext,
    subject: str,
    payload: bytes,
    *,
    msg_id: str,
    headers: dict[str, str] | None = None,
    timeout: float = APPEND_TIMEOUT_S,  # noqa: ASYNC109 - per request, not overall
) -> int:
    """Publish with Nats-Msg-Id (retries are deduplicated by the stream) and return its sequence."""
    hdrs = dict(headers or {})
    hdrs[H_MSG_ID] = msg_id
    ack = await _publish_retrying(js, subject, payload, hdrs, timeout)
    return int(ack.seq)


async def dead_letter(
    js: JetStreamContext,
    subjects: Subjects,
    *,
    source: str,
    reason: str,
    subject: str,
    data: bytes,
    headers: Mapping[str, str] | None = None,
) -> None:
    """Park an unprocessable message on ``<prefix>.dlq.<source>`` with why and where it came from.

    The original's Nats-* headers are dropped (a Msg-Id would dedupe unrelated dead letters).
    """
    hdrs = {k: v for k, v in (headers or {}).items() if not k.startswith("Nats-")}
    hdrs[H_REASON] = reason.replace("\r", " ").replace("\n", " ")
    hdrs[H_ORIGINAL_SUBJECT] = subject
    await _publish_retrying(js, subjects.dlq(source), data, hdrs, APPEND_TIMEOUT_S)


# --- partition leases ----------------------------------------------------------------------------


class LeaseLost(Exception):
    """The lease's revision CAS failed: someone else holds it, or it expired."""


class LeaseValue(msgspec.Struct, frozen=True):
    """What a lease entry holds. expires_hint is informational only: the KV revision is the fence."""

    owner: str
    expires_hint: float


_lease_encoder = msgspec.json.Encoder()
_lease_decoder = msgspec.json.Decoder(LeaseValue)


class PartitionLease:
    """One partition's lease in the leases bucket: KV create / CAS-update / CAS-delete.

    The bucket's TTL (max_age) expires a lease that is not renewed; each renew writes a new message
    and so restarts its age. Owner ids must be unique per process incarnation: acquire() lets an
    owner re-take an entry that carries its own id.
    """

    def __init__(self, kv: KeyValue, partition: int | str, owner: str, *, ttl_hint_s: float = 10.0) -> None:
        self.kv = kv
        self.key = str(partition)
        self.owner = owner
        self.ttl_hint_s = ttl_hint_s
        self.revision: int | None = None

    def _value(self) -> bytes:
        return _lease_encoder.encode(LeaseValue(owner=self.owner, expires_hint=time.time() + self.ttl_hint_s))

    async def holder(self) -> tuple[LeaseValue, int] | None:
        """Current holder and revision, or None when free (never written, deleted or expired)."""
        try:
            entry = await self.kv.get(self.key)
        except nats.js.errors.KeyNotFoundError:
            return None
        if entry.value is None or entry.revision is None:
            return None
        return _lease_decoder.decode(entry.value), entry.revision

    async def acquire(self) -> int | None:
        """Take the lease if free (or already ours); the new revision, or None if held by another."""
        for _ in range(LEASE_ACQUIRE_ATTEMPTS):
            try:
                rev = int(await self.kv.create(self.key, self._value()))
                self.revision = rev
                return rev
            except nats.js.errors.KeyWrongLastSequenceError:
                pass
            current = await self.holder()
            if current is None:
                continue  # expired or deleted between create and get: try create again
            value, rev = current
            if value.owner != self.owner:
                self.revision = None
                return None
            try:
                new_rev = int(await self.kv.update(self.key, self._value(), last=rev))
            except nats.js.errors.KeyWrongLastSequenceError:
                continue
            self.revision = new_rev
            return new_rev
        self.revision = None
        return None

    async def renew(self, revision: int | None = None) -> int:
        """CAS-update from revision (default: the last one this object saw); LeaseLost if stale."""
        last = self.revision if revision is None else revision
        if not last:
            raise LeaseLost(f"lease {self.key}: not held")
        try:
            rev = int(await self.kv.update(self.key, self._value(), last=last))
        except nats.js.errors.KeyWrongLastSequenceError as exc:
            self.revision = None
            raise LeaseLost(f"lease {self.key} lost (revision {last} is no longer current)") from exc
        self.revision = rev
        return rev

    async def release(self, revision: int | None = None) -> bool:
        """CAS-delete; False if the lease was already lost (then nothing is touched)."""
        last = self.revision if revision is None else revision
        if not last:
            return False
        try:
            await self.kv.delete(self.key, last=last)
        except nats.js.errors.APIError as exc:
            if exc.err_code in (ERR_WRONG_LAST_SEQUENCE, *ERR_IN_FLIGHT_PROPOSAL):
                self.revision = None
                return False
            raise
        self.revision = None
        return True
