"""Every stream and KV bucket is bounded in bytes and per message (issue 10, finding 11), with the
named defaults of StreamsConfig or configured ones, and each bound does what docs/resources.md
("Stream limits") says: an over-size message is refused, an event stream at its byte bound refuses
the next publish and keeps what it has, and the dead letters of one source are bounded by their
own count, so a flood from agents cannot evict the watcher's."""

from __future__ import annotations

import pytest
from nats.js import JetStreamContext, api
from nats.js.errors import APIError, NotFoundError

from shared.bus import provision as p
from shared.bus.provision import StreamsConfig, provision
from shared.subjects import Subjects

ERR_MESSAGE_TOO_BIG = 10054  # JSStreamMessageExceedsMaximumErr: "message size exceeds maximum allowed"
SMALL = 1024  # a per-message bound a test can step over in one publish


async def test_every_stream_and_bucket_has_its_named_byte_and_message_bounds(js: JetStreamContext) -> None:
    s = Subjects()
    await provision(js, s, StreamsConfig())
    want = {
        s.stream_in: (p.IN_MAX_BYTES, p.IN_MAX_MSG_BYTES, api.DiscardPolicy.NEW),
        s.stream_log: (p.LOG_MAX_BYTES, p.LOG_MAX_MSG_BYTES, api.DiscardPolicy.NEW),
        s.stream_cmd: (p.CMD_MAX_BYTES, p.CMD_MAX_MSG_BYTES, api.DiscardPolicy.NEW),
        s.stream_dlq: (p.DLQ_MAX_BYTES, p.DLQ_MAX_MSG_BYTES, api.DiscardPolicy.OLD),
        f"KV_{s.kv_leases}": (p.LEASES_MAX_BYTES, p.LEASES_MAX_MSG_BYTES, api.DiscardPolicy.NEW),
        f"KV_{s.kv_hosts}": (p.HOSTS_MAX_BYTES, p.HOSTS_MAX_MSG_BYTES, api.DiscardPolicy.NEW),
        s.stream_images: (p.IMAGES_MAX_BYTES, p.IMAGES_MAX_MSG_BYTES, api.DiscardPolicy.OLD),
    }
    for name, (max_bytes, max_msg, discard) in want.items():
        cfg = (await js.stream_info(name)).config
        assert (cfg.max_bytes, cfg.max_msg_size, cfg.discard) == (max_bytes, max_msg, discard), name
        assert 0 < max_msg <= max_bytes
    dlq = (await js.stream_info(s.stream_dlq)).config
    assert dlq.max_msgs_per_subject == p.DLQ_MAX_MSGS_PER_SOURCE
    names = {i.config.name for i in await js.streams_info()}
    assert names == set(want), "a stream provision makes is missing from this test"


async def test_configured_bounds_and_an_over_size_publish_is_refused_everywhere(js: JetStreamContext) -> None:
    s = Subjects()
    cfg = StreamsConfig(in_max_msg_bytes=SMALL, log_max_msg_bytes=SMALL, cmd_max_msg_bytes=SMALL,
                        dlq_max_msg_bytes=SMALL, hosts_max_msg_bytes=SMALL, leases_max_msg_bytes=SMALL,
                        images_max_msg_bytes=SMALL, in_max_bytes=64 * SMALL)
    await provision(js, s, cfg)
    assert (await js.stream_info(s.stream_in)).config.max_bytes == 64 * SMALL
    subjects = {
        s.stream_in: "vmfence.in.0.report.ns.a",
        s.stream_log: "vmfence.log.0.ns.a",
        s.stream_cmd: s.command("host-a"),
        s.stream_dlq: s.dlq("agent"),
        f"KV_{s.kv_hosts}": f"$KV.{s.kv_hosts}.host-a",
        f"KV_{s.kv_leases}": f"$KV.{s.kv_leases}.p0",
        s.stream_images: s.image(0),
    }
    for stream, subject in subjects.items():
        ack = await js.publish(subject, b"x" * (SMALL // 2), timeout=5)
        assert ack.stream == stream
        with pytest.raises(APIError) as refused:
            await js.publish(subject, b"x" * (SMALL + 1), timeout=5)
        assert refused.value.err_code == ERR_MESSAGE_TOO_BIG, (stream, refused.value)
        assert (await js.stream_info(stream)).state.messages == 1, stream


async def test_an_event_stream_at_its_byte_bound_refuses_the_next_publish_and_keeps_the_rest(
    js: JetStreamContext,
) -> None:
    s = Subjects()
    await provision(js, s, StreamsConfig(log_max_bytes=8 * SMALL))
    stored = 0
    with pytest.raises(APIError, match="maximum bytes"):
        for i in range(100):
            await js.publish(f"vmfence.log.0.ns.k{i}", b"e" * (SMALL // 2), timeout=5)
            stored += 1
    assert 0 < stored < 100
    state = (await js.stream_info(s.stream_log)).state
    assert (state.first_seq, state.messages) == (1, stored), "an audit entry was dropped to make room"


async def test_dead_letters_are_bounded_per_source_oldest_first(js: JetStreamContext) -> None:
    s = Subjects()
    await provision(js, s, StreamsConfig(dlq_max_msgs_per_source=3))
    await js.publish(s.dlq("watcher"), b"watcher-0", timeout=5)
    for i in range(10):
        await js.publish(s.dlq("agent"), f"agent-{i}".encode(), timeout=5)
    kept = []
    for seq in range(1, 12):
        try:
            kept.append((await js.get_msg(s.stream_dlq, seq)).data)
        except NotFoundError:
            continue  # discarded: an agent's oldest, past its source's bound
    assert kept == [b"watcher-0", b"agent-7", b"agent-8", b"agent-9"]


async def test_an_unbounded_deployment_is_bounded_in_place_and_keeps_its_data(js: JetStreamContext) -> None:
    s = Subjects()
    old = [sc.evolve(max_bytes=-1, max_msg_size=-1, discard=api.DiscardPolicy.OLD, max_msgs_per_subject=-1)
           for sc in p.stream_configs(s, StreamsConfig())]
    for sc in old:
        await js.add_stream(sc)
    ack = await js.publish("vmfence.log.3.ns.a", b"an old entry", timeout=5)
    await provision(js, s, StreamsConfig())
    log = await js.stream_info(s.stream_log)
    assert log.config.max_bytes == p.LOG_MAX_BYTES and log.config.discard == api.DiscardPolicy.NEW
    assert (log.state.messages, log.state.last_seq) == (1, ack.seq)


def test_a_bound_cannot_be_switched_off() -> None:
    with pytest.raises(ValueError, match="in_max_bytes must be at least 1"):
        StreamsConfig(in_max_bytes=0)
    with pytest.raises(ValueError, match="dlq_max_msgs_per_source must be at least 1"):
        StreamsConfig(dlq_max_msgs_per_source=-1)
