"""Small helpers for reconciler tests: publishing inputs, reading a key's log, waiting on state."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

from services.agent.config import AgentConfig
from services.agent.service import Agent
from shared.bus.append import publish_input
from shared.bus.connect import Bus
from shared.bus.read import read_stream
from shared.fence.heartbeat import HostHeartbeat
from shared.fence.keys import Key
from shared.fence.schema import LogEntry, Observed, decode_entry, encode

WAIT_S = 30.0


def sim_agent(url: str | list[str], host: str, data_dir: Path, partitions: int) -> Agent:
    """A real agent on the sim runtime (async context manager: ready on enter, stopped on exit)."""
    cfg = AgentConfig(
        nats_url=url if isinstance(url, str) else ",".join(url), host=host, runtime="sim",
        data_dir=str(data_dir / host), http_port=0, http_host="127.0.0.1", partitions=partitions,
        cpus=64, memory_mib=65536, heartbeat_interval=1.0, vnc_range=None,
    ).validate()
    return Agent(cfg)


async def heartbeat(bus: Bus, *hosts: str) -> None:
    kv = await bus.js.key_value(bus.subjects.kv_hosts)
    for host in hosts:
        await kv.put(host, encode(HostHeartbeat(host, "sim", 64, 64, 65536, 65536, 0, time.time())))


async def observe(bus: Bus, key: Key, uid: str, rv: int, **kw: object) -> None:
    obs = Observed(str(key), uid, rv, **kw)  # type: ignore[arg-type]
    await publish_input(bus.js, bus.subjects.observation(key), encode(obs), msg_id=f"{uid}:{rv}")


async def log_entries(bus: Bus) -> list[tuple[int, LogEntry]]:
    return [
        (m.seq, decode_entry(m.data))
        async for m in read_stream(bus.js, bus.subjects.stream_log, bus.subjects.log_all)
    ]


async def wait_until(check: Callable[[], bool], what: str, within_s: float = WAIT_S) -> None:
    """Poll a condition on in-process state (no event exists for "all keys bound")."""
    deadline = time.monotonic() + within_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


def per_key(entries: list[tuple[int, LogEntry]]) -> dict[str, list[LogEntry]]:
    out: dict[str, list[LogEntry]] = {}
    for _, e in entries:
        out.setdefault(e.key, []).append(e)
    return out
