"""Creating and checking the vmfence streams and KV buckets (idempotent, retried while a cluster forms).

Every stream and bucket is bounded in bytes and per message (:class:`StreamsConfig`, defaults named
below; docs/resources.md, "Stream limits", says what happens at each bound). The event streams
(inputs, log, commands) refuse a publish at their byte bound (``discard: new``) rather than drop
what is stored: nothing acknowledged is ever lost to make room, the publisher gets an error and
retries (back-pressure). Dead letters are diagnostics: there the oldest go first, and each source
(``<prefix>.dlq.<source>``) keeps at most a bounded number, so one flooding publisher cannot evict
every other's.
"""

from __future__ import annotations

import logging
from typing import Literal

import msgspec
import nats
import nats.errors
import nats.js.errors
from nats.js import JetStreamContext, api

from shared.bus.retry import retry_transient
from shared.bus.wire import ERR_STREAM_NAME_IN_USE, META_PARTITIONS
from shared.fence.keys import DEFAULT_PARTITIONS
from shared.subjects import Subjects

log = logging.getLogger(__name__)

DAY_S = 86_400.0
KIB = 1024
MIB = 1024 * KIB
GIB = 1024 * MIB

# Byte bounds of each stream and bucket (one replica's store; R3 stores each on three servers).
# Together 14.3 GiB: within the 20 GB max_file_store of deploy/nats (the server reserves them).
IN_MAX_BYTES = 4 * GIB  # a week of inputs at the default max age
LOG_MAX_BYTES = 8 * GIB  # the audit log: at the bound appends are refused, never an entry dropped
CMD_MAX_BYTES = 1 * GIB  # a work queue: only unacknowledged commands are stored
DLQ_MAX_BYTES = 1 * GIB
LEASES_MAX_BYTES = 16 * MIB  # one small value per partition (and the fleet lease)
HOSTS_MAX_BYTES = 64 * MIB  # one heartbeat per host
IMAGES_MAX_BYTES = 256 * MIB  # the latest image of each partition (compressed; at most its message bound)
# Per-message bounds: none below what its writers may legitimately send (an over-size publish is
# refused at every attempt). 1 MiB is deploy/nats's max_payload; the schema's own bounds
# (shared/fence/schema.py MAX_*_BYTES) sit below these and are checked before a publish.
IN_MAX_MSG_BYTES = 1 * MIB
LOG_MAX_MSG_BYTES = 1 * MIB
CMD_MAX_MSG_BYTES = 256 * KIB
DLQ_MAX_MSG_BYTES = 1 * MIB
LEASES_MAX_MSG_BYTES = 4 * KIB
HOSTS_MAX_MSG_BYTES = 64 * KIB
IMAGES_MAX_MSG_BYTES = 1 * MIB  # a larger image is not put: the next owner reads the log instead
DLQ_MAX_MSGS_PER_SOURCE = 100_000  # dead letters kept per <prefix>.dlq.<source> (oldest go first)


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
    in_max_bytes: int = IN_MAX_BYTES
    log_max_bytes: int = LOG_MAX_BYTES
    cmd_max_bytes: int = CMD_MAX_BYTES
    dlq_max_bytes: int = DLQ_MAX_BYTES
    leases_max_bytes: int = LEASES_MAX_BYTES
    hosts_max_bytes: int = HOSTS_MAX_BYTES
    in_max_msg_bytes: int = IN_MAX_MSG_BYTES
    log_max_msg_bytes: int = LOG_MAX_MSG_BYTES
    cmd_max_msg_bytes: int = CMD_MAX_MSG_BYTES
    dlq_max_msg_bytes: int = DLQ_MAX_MSG_BYTES
    leases_max_msg_bytes: int = LEASES_MAX_MSG_BYTES
    hosts_max_msg_bytes: int = HOSTS_MAX_MSG_BYTES
    images_max_bytes: int = IMAGES_MAX_BYTES
    images_max_msg_bytes: int = IMAGES_MAX_MSG_BYTES
    dlq_max_msgs_per_source: int = DLQ_MAX_MSGS_PER_SOURCE

    def __post_init__(self) -> None:
        for name in self.__struct_fields__:
            if name.endswith(("_max_bytes", "_max_msg_bytes", "_per_source")) and getattr(self, name) < 1:
                raise ValueError(f"StreamsConfig.{name} must be at least 1 (every stream is bounded)")


def _storage(cfg: StreamsConfig) -> api.StorageType:
    return api.StorageType.FILE if cfg.storage == "file" else api.StorageType.MEMORY


def stream_configs(subjects: Subjects, cfg: StreamsConfig) -> list[api.StreamConfig]:
    """The four vmfence streams as nats-py configs (exposed for tests and `vmfence status`)."""
    meta = {META_PARTITIONS: str(cfg.partitions)}
    common = {
        "storage": _storage(cfg),
        "num_replicas": cfg.replicas,
        "duplicate_window": cfg.duplicate_window_s,
    }
    keep = api.DiscardPolicy.NEW  # at the byte bound refuse the publish, never drop what is stored
    return [
        api.StreamConfig(
            name=subjects.stream_in,
            subjects=[subjects.in_all],
            retention=api.RetentionPolicy.LIMITS,
            max_age=cfg.in_max_age_s,
            max_bytes=cfg.in_max_bytes,
            max_msg_size=cfg.in_max_msg_bytes,
            discard=keep,
            allow_direct=True,
            metadata=dict(meta),
            **common,  # type: ignore[arg-type]
        ),
        api.StreamConfig(
            name=subjects.stream_log,
            subjects=[subjects.log_all],
            retention=api.RetentionPolicy.LIMITS,
            max_age=cfg.log_max_age_s,
            max_bytes=cfg.log_max_bytes,
            max_msg_size=cfg.log_max_msg_bytes,
            discard=keep,
            allow_direct=True,
            metadata=dict(meta),
            **common,  # type: ignore[arg-type]
        ),
        api.StreamConfig(
            name=subjects.stream_cmd,
            subjects=[subjects.cmd_all],
            retention=api.RetentionPolicy.WORK_QUEUE,
            max_age=cfg.cmd_max_age_s,
            max_bytes=cfg.cmd_max_bytes,
            max_msg_size=cfg.cmd_max_msg_bytes,
            discard=keep,
            **common,  # type: ignore[arg-type]
        ),
        api.StreamConfig(
            name=subjects.stream_dlq,
            subjects=[subjects.dlq_all],
            retention=api.RetentionPolicy.LIMITS,
            max_age=cfg.dlq_max_age_s,
            max_bytes=cfg.dlq_max_bytes,
            max_msg_size=cfg.dlq_max_msg_bytes,
            max_msgs_per_subject=cfg.dlq_max_msgs_per_source,  # per source: one flood evicts only its own
            discard=api.DiscardPolicy.OLD,  # diagnostics: the oldest dead letters go first
            **common,  # type: ignore[arg-type]
        ),
    ]


def images_stream_config(subjects: Subjects, cfg: StreamsConfig) -> api.StreamConfig:
    """Partition images: the latest per partition (one message per subject, the older one dropped
    when a newer is stored), bounded per image; losing one only costs its next owner catch-up time."""
    return api.StreamConfig(
        name=subjects.stream_images,
        subjects=[subjects.images_all],
        retention=api.RetentionPolicy.LIMITS,
        max_msgs_per_subject=1,
        max_bytes=cfg.images_max_bytes,
        max_msg_size=cfg.images_max_msg_bytes,
        discard=api.DiscardPolicy.OLD,
        allow_direct=True,
        storage=_storage(cfg),
        num_replicas=cfg.replicas,
    )


def kv_stream_config(
    bucket: str, ttl_s: float, cfg: StreamsConfig, *, max_bytes: int, max_msg_bytes: int
) -> api.StreamConfig:
    """A KV bucket's backing stream, as nats-py's create_key_value builds it (history 1, TTL),
    bounded in bytes (a put past the bound is refused: discard new) and per value."""
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
        max_bytes=max_bytes,
        max_msg_size=max_msg_bytes,
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
    await retry_transient(
        lambda: _ensure_stream(js, want, partitions),
        lambda err, _: ProvisionFailed(f"provisioning {want.name} failed: {err!r}"),
        on_retry=lambda err: log.debug("provision %s: retry after %r", want.name, err),
    )


async def provision(js: JetStreamContext, subjects: Subjects, cfg: StreamsConfig) -> None:
    """Idempotently create/update the vmfence streams and KV buckets for this deployment."""
    if cfg.partitions != subjects.partitions:
        raise ValueError(f"StreamsConfig.partitions={cfg.partitions} but Subjects.partitions={subjects.partitions}")
    if cfg.replicas not in (1, 3):
        raise ValueError("replicas must be 1 or 3")
    for sc in stream_configs(subjects, cfg):
        check = cfg.partitions if sc.name in (subjects.stream_in, subjects.stream_log) else None
        await _ensure_stream_retrying(js, sc, check)
    leases = kv_stream_config(subjects.kv_leases, cfg.lease_ttl_s, cfg, max_bytes=cfg.leases_max_bytes,
                              max_msg_bytes=cfg.leases_max_msg_bytes)
    hosts = kv_stream_config(subjects.kv_hosts, cfg.hosts_ttl_s, cfg, max_bytes=cfg.hosts_max_bytes,
                             max_msg_bytes=cfg.hosts_max_msg_bytes)
    await _ensure_stream_retrying(js, leases, None)
    await _ensure_stream_retrying(js, hosts, None)
    await _ensure_stream_retrying(js, images_stream_config(subjects, cfg), None)
