"""An agent that starts before its hosts bucket exists (a compose stack whose reconciler provisions
it a moment later) waits for it within its startup bound instead of exiting."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import nats.js.errors
import pytest
from nats.aio.client import Client

from services.agent.config import AgentConfig
from services.agent.service import Agent
from shared.bus.provision import StreamsConfig, provision
from shared.subjects import Subjects

from .conftest import sim_driver


async def test_the_agent_waits_for_the_hosts_bucket(nc: Client, make_config: Callable[..., AgentConfig]) -> None:
    js = nc.jetstream()
    bucket = Subjects().kv_hosts
    await js.delete_key_value(bucket)
    cfg = make_config(connect_timeout=20.0)
    agent = Agent(cfg, driver=sim_driver(cfg))
    ready = asyncio.Event()
    task = asyncio.create_task(agent.run(ready=ready))
    try:
        await asyncio.sleep(1.0)  # the agent is retrying meanwhile (nothing to wait on: it is the bucket's absence)
        assert not ready.is_set() and not task.done()
        await provision(js, Subjects(), StreamsConfig(hosts_ttl_s=5.0))
        await asyncio.wait_for(ready.wait(), 15)
        assert (await (await js.key_value(bucket)).get(cfg.host)).value
    finally:
        agent.stop()
        await asyncio.wait_for(task, 30)


async def test_the_agent_waits_for_a_hosts_bucket_without_a_leader(
        nc: Client, make_config: Callable[..., AgentConfig], monkeypatch: pytest.MonkeyPatch) -> None:
    """The bucket exists but its stream has no leader yet (an R3 stream just created, an election
    after a node loss: no responders, then 503s): the first heartbeat waits, as for a missing bucket."""
    cfg = make_config(connect_timeout=20.0)
    agent = Agent(cfg, driver=sim_driver(cfg))
    real = Agent.heartbeat
    refusals = [nats.js.errors.NoStreamResponseError(), nats.js.errors.ServiceUnavailableError()]

    async def electing(self: Agent) -> None:
        if refusals:
            raise refusals.pop(0)
        await real(self)

    monkeypatch.setattr(Agent, "heartbeat", electing)
    ready = asyncio.Event()
    task = asyncio.create_task(agent.run(ready=ready))
    try:
        await asyncio.wait_for(ready.wait(), 15)
        assert not refusals and not task.done()
        assert (await (await nc.jetstream().key_value(Subjects().kv_hosts)).get(cfg.host)).value
    finally:
        agent.stop()
        await asyncio.wait_for(task, 30)
