"""PullFeed: a durable consumer's messages in order, for a pull request per half window, not per take;
requests lost with a server or a closed feed do not keep messages from the next one."""

from __future__ import annotations

import asyncio

import pytest
from nats.aio.msg import Msg
from nats.js import JetStreamContext, api

from services.testbed.natsserver import NatsServer
from shared.bus.connect import connect
from shared.bus.pull import PullFeed, PullFeedError, ensure_durable

STREAM = "PULLT"
SUBJECT = "pullt.x"
DURABLE = "worker"
WAIT_S = 5.0


def consumer_config(ack_wait_s: float = 30.0) -> api.ConsumerConfig:
    return api.ConsumerConfig(durable_name=DURABLE, name=DURABLE, ack_policy=api.AckPolicy.EXPLICIT,
                              ack_wait=ack_wait_s, deliver_policy=api.DeliverPolicy.ALL, max_deliver=-1)


@pytest.fixture
async def stream(js: JetStreamContext) -> JetStreamContext:
    await js.add_stream(name=STREAM, subjects=["pullt.>"])
    await ensure_durable(js, STREAM, consumer_config())
    return js


async def take_one(feed: PullFeed) -> Msg:
    msgs = await feed.take(1, wait_s=WAIT_S)
    assert len(msgs) == 1
    await msgs[0].ack()
    return msgs[0]


async def test_messages_come_in_order_and_at_most_limit_per_take(stream: JetStreamContext) -> None:
    js = stream
    for i in range(10):
        await js.publish(SUBJECT, str(i).encode())
    async with PullFeed(js, STREAM, DURABLE, window=8) as feed:
        got: list[bytes] = []
        while len(got) < 10:
            msgs = await feed.take(3, wait_s=WAIT_S)
            assert 1 <= len(msgs) <= 3
            for m in msgs:
                await m.ack()
            got += [m.data for m in msgs]
    assert got == [str(i).encode() for i in range(10)]


async def test_one_pull_request_per_half_window_not_one_per_take(stream: JetStreamContext) -> None:
    """nats-py's fetch sends a request per call (and the server a 404 back): at one message per take
    that is a request per message. The feed asks again only when half its window has arrived."""
    js = stream
    nc = js._nc
    seen: list[bytes] = []

    async def count(msg: Msg) -> None:
        seen.append(msg.data)

    spy = await nc.subscribe(f"$JS.API.CONSUMER.MSG.NEXT.{STREAM}.{DURABLE}", cb=count)
    async with PullFeed(js, STREAM, DURABLE, window=64) as feed:
        for i in range(100):
            await js.publish(SUBJECT, str(i).encode())
            assert (await take_one(feed)).data == str(i).encode()
        await nc.flush()
        requests = feed.requests
    await spy.unsubscribe()
    assert requests == len(seen)
    assert 2 <= requests <= 100 // 32 + 1  # one at the start, then one per 32 messages


async def test_an_idle_feed_takes_nothing_and_times_out(stream: JetStreamContext) -> None:
    async with PullFeed(stream, STREAM, DURABLE, window=4, expires_s=2.5, heartbeat_s=0.5) as feed:
        with pytest.raises(TimeoutError):
            await feed.take(4, wait_s=3.0)  # past one request's expiry: the 408 is replaced, not raised
        await stream.publish(SUBJECT, b"late")
        assert (await take_one(feed)).data == b"late"


async def test_a_closed_feed_leaves_no_request_that_swallows_the_next_owners_message(
    stream: JetStreamContext,
) -> None:
    """A standing request of a closed feed lost its reply interest: the server must not deliver into
    it (the message would wait out ack_wait, 30 s here, before anyone else saw it)."""
    js = stream
    first = await PullFeed(js, STREAM, DURABLE, window=16).start()
    await first.close()
    await js._nc.flush()
    await js.publish(SUBJECT, b"for the next owner")
    async with PullFeed(js, STREAM, DURABLE, window=16) as second:
        assert (await take_one(second)).data == b"for the next owner"


async def test_a_server_restart_is_survived_by_asking_again(nats_server: NatsServer) -> None:
    nc = await connect(nats_server.url, name="pull-restart", max_reconnect_attempts=-1, reconnect_time_wait=0.1)
    try:
        js = nc.jetstream()
        await js.add_stream(name=STREAM, subjects=["pullt.>"])
        await ensure_durable(js, STREAM, consumer_config())
        async with PullFeed(js, STREAM, DURABLE, window=16, expires_s=30.0, heartbeat_s=0.5) as feed:
            await js.publish(SUBJECT, b"before")
            assert (await take_one(feed)).data == b"before"
            nats_server.kill()
            await nats_server.restart()
            # the standing request died with the server; its heartbeats stop, and the feed asks again
            for _ in range(40):
                try:
                    await asyncio.wait_for(js.publish(SUBJECT, b"after"), 1.0)
                    break
                except Exception:  # reconnecting
                    await asyncio.sleep(0.1)
            else:
                pytest.fail("could not publish after the restart")
            msgs = await feed.take(1, wait_s=10.0)
            assert [m.data for m in msgs] == [b"after"]
    finally:
        await nc.close()


async def test_a_deleted_consumer_is_an_error_not_a_silent_stall(stream: JetStreamContext) -> None:
    js = stream
    async with PullFeed(js, STREAM, DURABLE, window=4, heartbeat_s=0.5) as feed:
        await js.delete_consumer(STREAM, DURABLE)
        with pytest.raises((PullFeedError, TimeoutError)) as raised:
            for _ in range(3):
                await feed.take(1, wait_s=2.0)
        assert raised.type is PullFeedError, "a deleted consumer's 409 must surface"


def test_a_window_below_one_or_a_short_expiry_is_refused(js: JetStreamContext) -> None:
    with pytest.raises(ValueError):
        PullFeed(js, STREAM, DURABLE, window=0)
    with pytest.raises(ValueError):
        PullFeed(js, STREAM, DURABLE, expires_s=1.0, heartbeat_s=1.0)
