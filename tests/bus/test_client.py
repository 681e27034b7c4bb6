"""BusJetStream.publish keeps nats-py's contract (answers and exceptions) on a real nats-server."""

from __future__ import annotations

import asyncio

import nats
import nats.errors
import nats.js.errors
import pytest
from nats.js import api

from services.testbed.natsserver import NatsServer
from shared.bus.client import BusClient, BusJetStream
from shared.bus.connect import connect
from shared.bus.wire import ERR_WRONG_LAST_SEQUENCE, H_EXPECTED_LAST_SUBJECT_SEQ, H_MSG_ID


@pytest.fixture
async def clients(nats_server: NatsServer):  # type: ignore[no-untyped-def]
    """Ours (as every service connects) and nats-py's plain client, on one server with one stream."""
    ours = await connect(nats_server.url, name="ours", max_reconnect_attempts=2)
    plain = await nats.connect(nats_server.url, name="plain")
    await plain.jetstream().add_stream(api.StreamConfig(name="S", subjects=["s.>"]))
    try:
        yield ours, plain
    finally:
        await ours.close()
        await plain.close()


async def test_the_services_client_takes_the_lean_path(clients) -> None:  # type: ignore[no-untyped-def]
    ours, _ = clients
    js = ours.jetstream()
    assert isinstance(ours, BusClient) and isinstance(js, BusJetStream)
    assert ours.lean, "nats-py lacks what BusClient.request_reply uses: every publish takes nats-py's path"


async def test_same_acks_as_nats_py(clients) -> None:  # type: ignore[no-untyped-def]
    ours, plain = clients
    mine, theirs = ours.jetstream(), plain.jetstream()
    a = await mine.publish("s.a", b"1", stream="S", headers={H_MSG_ID: "m1"})
    b = await theirs.publish("s.a", b"2", stream="S", headers={H_MSG_ID: "m2"})
    assert (a.stream, a.seq, a.duplicate) == ("S", 1, None)
    assert (b.stream, b.seq, b.duplicate) == ("S", 2, None)
    again = await mine.publish("s.a", b"1", stream="S", headers={H_MSG_ID: "m1"})
    assert (again.seq, again.duplicate) == (1, True)  # the stream's dedupe, as nats-py reports it
    expected = await theirs.publish("s.a", b"1", stream="S", headers={H_MSG_ID: "m1"})
    assert (again.stream, again.seq, again.duplicate) == (expected.stream, expected.seq, expected.duplicate)


async def test_same_errors_as_nats_py(clients) -> None:  # type: ignore[no-untyped-def]
    ours, plain = clients
    for js in (ours.jetstream(), plain.jetstream()):
        with pytest.raises(nats.js.errors.APIError) as stale:
            await js.publish("s.b", b"x", headers={H_EXPECTED_LAST_SUBJECT_SEQ: "7"})
        assert stale.value.err_code == ERR_WRONG_LAST_SEQUENCE
        with pytest.raises(nats.js.errors.APIError) as wrong_stream:
            await js.publish("s.b", b"x", stream="OTHER")
        assert wrong_stream.value.err_code == 10060  # expected stream does not match
        with pytest.raises(nats.js.errors.NoStreamResponseError):
            await js.publish("nostream.b", b"x")


async def test_timeout_and_no_leftover_futures(clients) -> None:  # type: ignore[no-untyped-def]
    ours, _ = clients
    silent = await ours.subscribe("quiet.x")  # a responder that never answers
    js = ours.jetstream()
    with pytest.raises(nats.errors.TimeoutError):
        await js.publish("quiet.x", b"x", timeout=0.2)
    await silent.unsubscribe()
    acks = await asyncio.gather(*(js.publish(f"s.c{i % 7}", b"x", stream="S") for i in range(300)))
    assert sorted(a.seq for a in acks) == list(range(1, 301))
    assert ours._resp_map == {}  # every future, answered or timed out, is gone


async def test_plain_requests_keep_their_contract(clients) -> None:  # type: ignore[no-untyped-def]
    """Acks that wait for the server, key-value and API calls are ``request``s too."""
    ours, _ = clients

    async def echo(msg: nats.aio.msg.Msg) -> None:
        await msg.respond(msg.data[::-1])

    await ours.subscribe("echo", cb=echo)
    assert (await ours.request("echo", b"abc", timeout=2)).data == b"cba"
    with pytest.raises(nats.errors.NoRespondersError):
        await ours.request("nobody.home", b"", timeout=2)
    kv = await ours.jetstream().create_key_value(bucket="b")
    await kv.put("k", b"v")
    assert (await kv.get("k")).value == b"v"
    assert ours._resp_map == {}


async def test_a_request_without_a_timeout_waits_for_its_answer(clients) -> None:  # type: ignore[no-untyped-def]
    ours, _ = clients

    async def late(msg: nats.aio.msg.Msg) -> None:
        await asyncio.sleep(0.3)  # a slow responder (its delay, not a synchronisation)
        await msg.respond(b"late")

    await ours.subscribe("late", cb=late)
    assert (await ours.request_reply("late", b"", None, None)).data == b"late"
    assert ours._resp_map == {}
