"""The host's half of partition verification (docs/architecture.md): a partition's writer asks,
on this host's command stream, for the partition's floor to rise to its generation and for the
keys the host has a VM of. The floor rises in memory before anything handed out after the ask is
checked; the commands handed out before it finish first, so the keys named include what they made."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import msgspec
from nats.aio.msg import Msg

from services.agent.executor import Executor
from services.agent.metrics import AgentMetrics
from shared.fence.schema import MAX_GEN, PartitionVerify, decode_verify, encode
from shared.subjects import Subjects

log = logging.getLogger("vmfence.agent.verify")


def parse_verify(data: bytes, host: str, partitions: int) -> PartitionVerify:
    """The PartitionVerify in ``data`` for ``host``; ValueError (with why) for anything no retry fixes."""
    ask = decode_verify(data)
    if ask.host != host:
        raise ValueError(f"partition verify for host {ask.host!r} delivered to {host!r}")
    if not 0 <= ask.partition < partitions:
        raise ValueError(f"partition {ask.partition} out of range 0..{partitions - 1}")
    if not 0 < ask.gen <= MAX_GEN:
        raise ValueError(f"generation {ask.gen} out of range 1..{MAX_GEN}")
    return ask


@dataclass
class Verifier:
    """Answers PartitionVerify messages; the agent's delivery (ack, nak, keepalive, dead letters)
    and publishing are handed in, so this module holds only the verification's own steps."""

    executor: Executor
    subjects: Subjects
    metrics: AgentMetrics
    publish: Callable[[str, bytes, str], Awaitable[None]]  # subject, payload, Msg-Id
    keepalive: Callable[[Msg], Coroutine[Any, Any, None]]
    ack: Callable[[Msg], Awaitable[None]]
    nak: Callable[[Msg], Awaitable[None]]
    dead_letter: Callable[[Msg, str], Awaitable[None]]
    msg_id: Callable[[PartitionVerify], str]

    async def handle(self, msg: Msg, *, before: set[asyncio.Task[None]]) -> None:
        """Verify the partition ``msg`` asks for, after the commands in ``before`` finish."""
        host = self.executor.host
        try:
            ask = parse_verify(msg.data, host, self.executor.partitions)
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as e:
            await self.dead_letter(msg, f"malformed partition verify: {e}")
            return
        self.executor.ledger.lift_floor(ask.partition, ask.gen)
        keepalive = asyncio.create_task(self.keepalive(msg))  # owned: cancelled in finally
        try:
            if before:
                await asyncio.wait(before)
            answer = await self.executor.verify(ask)
            await self.publish(self.subjects.host_partition_report(ask.partition, host), encode(answer),
                               self.msg_id(ask))
        except Exception as e:  # the ledger or the bus: the writer asks again, and so does a redelivery
            log.warning("partition %d not verified (%r); redelivering", ask.partition, e,
                        extra={"host": host, "partition": ask.partition})
            self.metrics.commands.labels(op="verify", result="failed").inc()
            await self.nak(msg)
            return
        finally:
            keepalive.cancel()
        self.metrics.commands.labels(op="verify", result="ok").inc()
        log.info("partition %d verified for its writer of generation %d: %d keys with a VM here%s",
                 ask.partition, ask.gen, len(answer.keys), " (truncated)" if answer.truncated else "",
                 extra={"host": host, "partition": ask.partition, "writer": ask.writer})
        await self.ack(msg)
