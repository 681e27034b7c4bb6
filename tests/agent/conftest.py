"""Fixtures for the agent tests: provisioned streams, a report collector, agent factories."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg

from services.agent.config import AgentConfig
from services.agent.network import NETWORK_FILE, remove_network
from services.agent.runtime.sim import SimDriver
from services.testbed.natsserver import NatsServer
from shared.bus.connect import connect
from shared.bus.provision import StreamsConfig, provision
from shared.fence.schema import Command, Fence, Input, Spec, decode_input, encode
from shared.subjects import Subjects

HOST = "h1"
WAIT_S = 10.0


@dataclass
class Reports:
    """Every report an agent published (``<prefix>.in.*.agent.<host>.>``, core subscription), awaitable."""

    items: list[Input] = field(default_factory=list)
    cond: asyncio.Condition = field(default_factory=asyncio.Condition)

    async def on_msg(self, msg: Msg) -> None:
        if msg.subject.endswith(".partition"):
            return  # a PartitionVerified: no input of a key (tests/agent/test_partition_floor.py)
        async with self.cond:
            self.items.append(decode_input(msg.data))
            self.cond.notify_all()

    async def wait(self, pred: Callable[[Input], bool], timeout: float = WAIT_S) -> Input:  # noqa: ASYNC109
        """The first report (already seen or arriving) that matches, or TimeoutError."""
        async with asyncio.timeout(timeout):
            async with self.cond:
                while True:
                    for it in self.items:
                        if pred(it):
                            return it
                    await self.cond.wait()

    def of(self, cls: type[Any], **attrs: Any) -> list[Any]:
        return [
            i for i in self.items if isinstance(i, cls) and all(getattr(i, k) == v for k, v in attrs.items())
        ]


@pytest.fixture(autouse=True)
async def _no_interfaces_left(tmp_path: Path) -> AsyncIterator[None]:
    """Bridges and taps an agent of this test made (bridge networking, qemu runtime) are deleted
    afterwards: found by the network.json files under the test's own directory, deleted only when
    they carry that agent's alias."""
    yield
    for saved in list(tmp_path.rglob(NETWORK_FILE)):  # noqa: ASYNC240 - a test's small directory
        await remove_network(str(saved.parent))


@pytest.fixture
async def nc(nats_server: NatsServer) -> AsyncIterator[Client]:
    client = await connect(nats_server.url, name="pytest-agent", max_reconnect_attempts=2)
    await provision(client.jetstream(), Subjects(), StreamsConfig(hosts_ttl_s=5.0))
    try:
        yield client
    finally:
        await client.close()


@pytest.fixture
async def reports(nc: Client) -> Reports:
    r = Reports()
    await nc.subscribe("vmfence.in.*.agent.>", cb=r.on_msg)
    await nc.flush()
    return r


@pytest.fixture
def make_config(tmp_path: Path, nats_server: NatsServer) -> Callable[..., AgentConfig]:
    def make(**over: Any) -> AgentConfig:
        base: dict[str, Any] = dict(
            nats_url=nats_server.url, host=HOST, runtime="sim", data_dir=str(tmp_path / "agent"),
            http_host="127.0.0.1", http_port=0, inventory_interval=30.0, heartbeat_interval=0.5,
            probe_interval=0.1, probe_timeout=2.0, ack_wait=5.0, fetch_timeout=0.2,
            shutdown_timeout=5.0, cpus=8, memory_mib=8192,
        )
        base.update(over)
        return AgentConfig(**base).validate()

    return make


def sim_driver(config: AgentConfig) -> SimDriver:
    return SimDriver(state_dir=config.runtime_dir, vnc_displays=range(10, 20))


def fence(epoch: int = 1, uid: str | None = None, key: str = "default/web") -> Fence:
    return Fence(key, uid or f"uid-{epoch}", epoch)


def command(op: str, vm_id: str, f: Fence, *, cid: str | None = None, snapshot: str | None = None,
            spec: Spec | None = None, host: str = HOST) -> Command:
    return Command(id=cid or f"{f.uid}:{f.epoch}:{op}:{vm_id}", op=op, fence=f, host=host,  # type: ignore[arg-type]
                   vm_id=vm_id, spec=spec or Spec(cpus=1, memory_mib=64), snapshot=snapshot)


async def send(nc: Client, cmd: Command | bytes, *, msg_id: str | None = None, host: str = HOST) -> None:
    """Publish a command to the CMD stream (a new Msg-Id makes a redelivery look like a resend)."""
    data = cmd if isinstance(cmd, bytes) else encode(cmd)
    mid = msg_id or (cmd.id if isinstance(cmd, Command) else None)
    headers = {"Nats-Msg-Id": mid} if mid else None
    await nc.jetstream().publish(Subjects().command(host), data, headers=headers, timeout=5.0)


def decode(data: bytes) -> Any:
    return msgspec.json.decode(data)
