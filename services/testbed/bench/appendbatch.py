"""`vmfence bench append`: the log's fenced appends as the reconciler makes them (one request/reply
each, concurrent across keys, through ``shared.bus.client``) beside the same appends through nats-py's
own ``JetStreamContext.publish``, and in JetStream atomic batches (ADR-50, the ``Nats-Batch-*``
headers that nats-py does not wrap), on a file-backed stream (as ``VMFENCE_LOG``) and on a
memory-backed one: client and server CPU per append, measured in the same run.

It first checks the batch semantics a batched writer would rest on, against the same server: each
message of a batch keeps its own ``Nats-Expected-Last-Subject-Sequence`` and ``Nats-Msg-Id``; one
stale expectation rejects the whole batch (and does not say which message); so does a ``Msg-Id``
already stored (a benign retry); two appends to one subject in one batch are refused.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from dataclasses import dataclass
from typing import Any

import nats
from nats.js import api

from services.testbed.bench.fleet import cpu_seconds
from services.testbed.natsserver import start_nats
from shared.bus.connect import connect
from shared.bus.wire import H_EXPECTED_LAST_SUBJECT_SEQ, H_MSG_ID

H_BATCH_ID = "Nats-Batch-Id"
H_BATCH_SEQ = "Nats-Batch-Sequence"
H_BATCH_COMMIT = "Nats-Batch-Commit"
REQUEST_TIMEOUT_S = 10.0
PAYLOAD = b"x" * 400  # about a log entry of a pod's bring-up


@dataclass(frozen=True, slots=True)
class Append:
    subject: str
    expected: int
    msg_id: str


async def publish_batch(nc: Any, appends: list[Append], batch_id: str) -> dict[str, Any]:
    """One atomic batch: every append but the last is a plain publish, the last commits and is
    answered with the batch's ack (or its error)."""
    last = len(appends)
    for i, a in enumerate(appends, 1):
        headers = {H_EXPECTED_LAST_SUBJECT_SEQ: str(a.expected), H_MSG_ID: a.msg_id,
                   H_BATCH_ID: batch_id, H_BATCH_SEQ: str(i)}
        if i < last:
            await nc.publish(a.subject, PAYLOAD, headers=headers)
        else:
            headers[H_BATCH_COMMIT] = "1"
            reply = await nc.request(a.subject, PAYLOAD, headers=headers, timeout=REQUEST_TIMEOUT_S)
            out: dict[str, Any] = json.loads(reply.data)
            return out
    raise ValueError("an empty batch")


def _err(ack: dict[str, Any]) -> int | None:
    return ack.get("error", {}).get("err_code") if "error" in ack else None


async def batch_semantics(nc: Any, js: Any, stream: str, prefix: str) -> dict[str, Any]:
    """What the server does with fenced appends in one batch (see the module docstring)."""
    a, b = f"{prefix}.sem.a", f"{prefix}.sem.b"
    first = await publish_batch(nc, [Append(a, 0, "a1"), Append(b, 0, "b1")], "sem-1")
    stale = await publish_batch(nc, [Append(a, 1, "a2"), Append(b, 99, "b2")], "sem-2")
    after_stale = (await js.stream_info(stream)).state.last_seq
    retry = await publish_batch(nc, [Append(a, 0, "a1"), Append(b, 0, "b1")], "sem-3")
    same_subject = await publish_batch(nc, [Append(a, 1, "a3"), Append(a, 99, "a4")], "sem-4")
    return {
        "per_message_expectations_land": _err(first) is None and first.get("count") == 2,
        "one_stale_rejects_batch_err": _err(stale),
        "one_stale_stored_nothing": after_stale == first.get("seq"),
        "stored_msg_id_rejects_batch_err": _err(retry),
        "two_on_one_subject_err": _err(same_subject),
    }


class _Keys:
    """Per-key last sequence, as a writer tracks it."""

    def __init__(self, prefix: str, n: int) -> None:
        self.subjects = [f"{prefix}.k{i}" for i in range(n)]
        self.last = dict.fromkeys(self.subjects, 0)


async def _singles(js: Any, keys: _Keys, rounds: int, tag: str) -> None:
    """Every key appends once per round, all keys concurrently, each append its own request."""
    for r in range(rounds):
        acks = await asyncio.gather(*(
            js.publish(s, PAYLOAD, timeout=REQUEST_TIMEOUT_S,
                       headers={H_EXPECTED_LAST_SUBJECT_SEQ: str(keys.last[s]), H_MSG_ID: f"{s}:{tag}{r}"})
            for s in keys.subjects
        ))  # fmt: skip
        for s, ack in zip(keys.subjects, acks, strict=True):
            keys.last[s] = ack.seq


async def _batched(nc: Any, keys: _Keys, rounds: int, batch: int, tag: str) -> None:
    """The same appends, ``batch`` keys to an atomic batch, the batches concurrent."""
    groups = [keys.subjects[i : i + batch] for i in range(0, len(keys.subjects), batch)]

    async def one(group: list[str], bid: str) -> None:
        ack = await publish_batch(nc, [Append(s, keys.last[s], f"{s}:{bid}") for s in group], bid)
        if _err(ack) is not None:
            raise RuntimeError(f"batch {bid} refused: {ack}")
        for i, s in enumerate(group):  # a batch is stored contiguously, in its order
            keys.last[s] = ack["seq"] - len(group) + 1 + i

    for r in range(rounds):
        await asyncio.gather(*(one(g, f"{tag}{r}-{gi}") for gi, g in enumerate(groups)))


async def _measure(server_pid: int, n: int, run: Any) -> dict[str, float]:
    c0, s0, t0 = time.process_time(), cpu_seconds(server_pid), time.perf_counter()
    await run
    client, server = (time.process_time() - c0) / n, (cpu_seconds(server_pid) - s0) / n
    return {
        "wall_us_per_append": round(1e6 * (time.perf_counter() - t0) / n, 1),
        "client_cpu_us_per_append": round(1e6 * client, 1),
        "server_cpu_us_per_append": round(1e6 * server, 1),
        "total_cpu_us_per_append": round(1e6 * (client + server), 1),
    }


async def run_append_bench(keys: int, batch: int, rounds: int) -> dict[str, Any]:
    server = await start_nats()
    try:
        nc = await connect(server.url, name="vmfence-bench-append")  # as the services connect
        plain = await nats.connect(server.url, name="vmfence-bench-append-nats-py")
        js = nc.jetstream()
        out: dict[str, Any] = {"bench": "append", "keys": keys, "batch": batch, "rounds": rounds,
                               "payload_bytes": len(PAYLOAD)}
        for storage in (api.StorageType.FILE, api.StorageType.MEMORY):
            name, prefix = f"BENCH_APPEND_{storage.value.upper()}", f"bench-append-{storage.value}"
            await js.add_stream(api.StreamConfig(name=name, subjects=[f"{prefix}.>"], storage=storage,
                                                 allow_atomic=True))
            if storage is api.StorageType.FILE:
                out["semantics"] = await batch_semantics(nc, js, name, prefix)
            ks, n = _Keys(prefix, keys), keys * rounds
            nats_py = await _measure(server.pid, n, _singles(plain.jetstream(), ks, rounds, "p"))
            single = await _measure(server.pid, n, _singles(js, ks, rounds, "s"))
            batched = await _measure(server.pid, n, _batched(nc, ks, rounds, batch, "b"))
            out[storage.value] = {
                "single": single, "single_nats_py_publish": nats_py, "batched": batched,
                "single_over_nats_py_client_cpu": round(
                    single["client_cpu_us_per_append"] / max(0.1, nats_py["client_cpu_us_per_append"]), 3),
                "batched_over_single_total_cpu": round(
                    batched["total_cpu_us_per_append"] / max(0.1, single["total_cpu_us_per_append"]), 3),
            }
            await js.delete_stream(name)
        await nc.close()
        await plain.close()
    finally:
        await server.stop()
    out["machine_loadavg"] = os.getloadavg()[0]
    return out
