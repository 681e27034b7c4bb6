"""provision(): idempotent, records the partition count, refuses a different one, race-safe, and
waits out a cluster that cannot place a stream yet."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest
from nats.js import JetStreamContext, api
from nats.js.errors import BadRequestError

from shared.bus.connect import connect
from shared.bus.provision import PartitionMismatch, StreamsConfig, provision
from shared.bus.wire import META_PARTITIONS
from shared.subjects import Subjects


async def test_creates_streams_and_buckets(js: JetStreamContext) -> None:
    s = Subjects()
    await provision(js, s, StreamsConfig())
    log = await js.stream_info(s.stream_log)
    assert log.config.subjects == ["vmfence.log.>"]
    assert log.config.allow_direct is True
    assert not log.config.max_age  # audit log: no age limit by default
    assert log.config.metadata is not None and log.config.metadata[META_PARTITIONS] == "16"
    inp = await js.stream_info(s.stream_in)
    assert inp.config.max_age == pytest.approx(7 * 86400)
    assert inp.config.metadata is not None and inp.config.metadata[META_PARTITIONS] == "16"
    assert inp.config.duplicate_window == pytest.approx(120)
    cmd = await js.stream_info(s.stream_cmd)
    assert cmd.config.retention == api.RetentionPolicy.WORK_QUEUE
    dlq = await js.stream_info(s.stream_dlq)
    assert dlq.config.subjects == ["vmfence.dlq.>"]
    leases = await js.key_value(s.kv_leases)
    status = await leases.status()
    assert status.ttl == pytest.approx(10) and status.history == 1
    hosts = await js.key_value(s.kv_hosts)
    assert (await hosts.status()).ttl == pytest.approx(15)
    images = await js.stream_info(s.stream_images)
    assert images.config.subjects == ["vmfence.image.>"] and images.config.max_msgs_per_subject == 1


async def test_idempotent_and_updates(js: JetStreamContext) -> None:
    s = Subjects()
    await provision(js, s, StreamsConfig())
    ack = await js.publish("vmfence.log.1.ns.a", b"x", timeout=5)
    await provision(js, s, StreamsConfig())
    # A second run changes what may change and keeps the data.
    await provision(js, s, StreamsConfig(in_max_age_s=3600, lease_ttl_s=5))
    inp = await js.stream_info(s.stream_in)
    assert inp.config.max_age == pytest.approx(3600)
    assert (await (await js.key_value(s.kv_leases)).status()).ttl == pytest.approx(5)
    log = await js.stream_info(s.stream_log)
    assert log.state.last_seq == ack.seq and log.state.messages == 1


async def test_partition_mismatch(js: JetStreamContext) -> None:
    await provision(js, Subjects(), StreamsConfig())
    with pytest.raises(PartitionMismatch, match=r"16 partitions.*uses 8"):
        await provision(js, Subjects(partitions=8), StreamsConfig(partitions=8))
    # The stream is untouched.
    info = await js.stream_info("VMFENCE_LOG")
    assert info.config.metadata is not None and info.config.metadata[META_PARTITIONS] == "16"


async def test_config_and_subjects_must_agree(js: JetStreamContext) -> None:
    with pytest.raises(ValueError):
        await provision(js, Subjects(partitions=4), StreamsConfig(partitions=16))


async def test_concurrent_provision_from_separate_clients(nats_url: str) -> None:
    clients = [await connect(nats_url, name=f"p{i}", max_reconnect_attempts=2) for i in range(4)]
    try:
        s = Subjects()
        for _ in range(3):
            await asyncio.gather(*(provision(nc.jetstream(), s, StreamsConfig()) for nc in clients))
        names = await clients[0].jetstream().streams_info()
        assert {i.config.name for i in names} >= {
            s.stream_in,
            s.stream_log,
            s.stream_cmd,
            s.stream_dlq,
            f"KV_{s.kv_leases}",
            f"KV_{s.kv_hosts}",
        }
    finally:
        for nc in clients:
            await nc.close()


async def test_custom_prefix(js: JetStreamContext) -> None:
    s = Subjects(prefix="other", partitions=4)
    await provision(js, s, StreamsConfig(partitions=4, storage="memory"))
    info = await js.stream_info("OTHER_LOG")
    assert info.config.subjects == ["other.log.>"]
    assert info.config.storage == api.StorageType.MEMORY


PROVISION_SCRIPT = """
import asyncio, sys
from shared.bus.connect import connect
from shared.bus.provision import StreamsConfig, provision
from shared.subjects import Subjects

async def main() -> None:
    nc = await connect(sys.argv[1], name="proc", max_reconnect_attempts=2)
    try:
        for _ in range(3):
            await provision(nc.jetstream(), Subjects(), StreamsConfig())
    finally:
        await nc.close()

asyncio.run(main())
"""
SUBPROCESS_TIMEOUT_S = 60.0
REPO = Path(__file__).resolve().parents[2]


async def test_concurrent_provision_from_two_processes(nats_url: str) -> None:
    procs = [
        await asyncio.create_subprocess_exec(
            sys.executable, "-c", PROVISION_SCRIPT, nats_url, stderr=asyncio.subprocess.PIPE, cwd=REPO
        )
        for _ in range(2)
    ]
    for p in procs:
        _, err = await asyncio.wait_for(p.communicate(), SUBPROCESS_TIMEOUT_S)
        assert p.returncode == 0, err.decode()
    nc = await connect(nats_url, name="check", max_reconnect_attempts=2)
    try:
        info = await nc.jetstream().stream_info("VMFENCE_LOG")
        assert info.config.metadata is not None and info.config.metadata[META_PARTITIONS] == "16"
    finally:
        await nc.close()


class PlacementFailsFirst:
    """The real JetStream context, except that its first add_stream calls answer as a cluster whose
    last peer has not reported in yet does (seen in CI right after a 3-node cluster was ready)."""

    def __init__(self, js: JetStreamContext, failures: int) -> None:
        self.js, self.failures = js, failures

    def __getattr__(self, name: str) -> object:
        return getattr(self.js, name)

    async def add_stream(self, config: api.StreamConfig | None = None, **params: object) -> api.StreamInfo:
        if self.failures:
            self.failures -= 1
            raise BadRequestError(code=400, err_code=10005, description="no suitable peers for placement, peer offline")
        return await self.js.add_stream(config, **params)


async def test_a_stream_the_cluster_cannot_place_yet_is_retried(js: JetStreamContext) -> None:
    s = Subjects()
    await provision(PlacementFailsFirst(js, failures=2), s, StreamsConfig())  # type: ignore[arg-type]
    assert (await js.stream_info(s.stream_log)).config.subjects == ["vmfence.log.>"]
