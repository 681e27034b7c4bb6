"""End-to-end fixtures: a whole local stack (dev API server, watcher, two reconciler processes,
agents host-a and host-b on a real nats-server), driven only through kubernetes-asyncio and kubectl,
with a runtime oracle sampling the agents' own VM records many times a second."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from services.testbed.stack import LocalStack
from shared.bus.logstream import Record, audit_records, read_log
from shared.fence.audit import AuditReport
from shared.tasks import cancel_and_wait

NS = "default"
WAIT_S = 45.0


class Env:
    """The stack plus what scenarios need: API clients, waits, the oracle, the audit."""

    def __init__(self, stack: LocalStack) -> None:
        assert stack.api is not None
        self.stack = stack
        self.core = client.CoreV1Api(stack.api)
        self.custom = client.CustomObjectsApi(stack.api)
        self.max_vms_per_key = 0
        self.worst: tuple[str, list[str]] | None = None

    # ---------------------------------------------------------------- pods via the API
    @staticmethod
    def pod(name: str, annotations: dict[str, str] | None = None) -> dict[str, Any]:
        return {
            "metadata": {"name": name, "labels": {"vmfence.io/managed": "true"}, "annotations": annotations or {}},
            "spec": {"containers": [{"name": "main", "image": "vm"}]},
        }

    async def create(self, name: str, annotations: dict[str, str] | None = None) -> str:
        p = await self.core.create_namespaced_pod(NS, self.pod(name, annotations))
        return str(p.metadata.uid)

    async def get(self, name: str) -> Any | None:
        try:
            return await self.core.read_namespaced_pod(name, NS)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    async def force_delete(self, name: str) -> None:
        with contextlib.suppress(ApiException):
            await self.core.delete_namespaced_pod(name, NS, grace_period_seconds=0)

    async def annotate(self, name: str, key: str, value: str) -> None:
        await self.core.patch_namespaced_pod(name, NS, {"metadata": {"annotations": {key: value}}})

    @staticmethod
    def conditions(p: Any) -> dict[str, str]:
        return {c.type: c.status for c in (p.status.conditions or [])} if p is not None and p.status else {}

    def is_running_ready(self, p: Any, uid: str | None = None) -> bool:
        return (
            p is not None and (uid is None or p.metadata.uid == uid) and p.status is not None
            and p.status.phase == "Running" and self.conditions(p).get("Ready") == "True"
            and (p.metadata.annotations or {}).get("vmfence.io/vm-id") is not None
        )

    async def wait_for(self, what: str, check: Callable[[], Awaitable[bool]], within_s: float = WAIT_S) -> None:
        deadline = time.monotonic() + within_s
        while not await check():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}")
            await asyncio.sleep(0.1)

    async def wait_running(self, name: str, uid: str | None = None) -> Any:
        async def ok() -> bool:
            return self.is_running_ready(await self.get(name), uid)

        await self.wait_for(f"{name} Running and Ready", ok)
        return await self.get(name)

    async def wait_gone(self, name: str) -> None:
        async def gone() -> bool:
            return await self.get(name) is None

        await self.wait_for(f"{name} deleted", gone)

    # -------------------------------------------------------------------- the runtime
    async def vms(self, name: str | None = None) -> list[Any]:
        out = []
        for agent in self.stack.agents.values():
            for info in await agent.driver.list():
                key = info.labels.get("vmfence.io/key", "")
                if info.state in ("running", "paused", "creating") and (name is None or key == f"{NS}/{name}"):
                    out.append(info)
        return out

    async def oracle(self) -> None:
        while True:
            with contextlib.suppress(Exception):
                by_key: dict[str, list[str]] = {}
                for info in await self.vms():
                    by_key.setdefault(info.labels.get("vmfence.io/key", "?"), []).append(info.vm_id)
                for key, ids in by_key.items():
                    if len(ids) > self.max_vms_per_key:
                        self.max_vms_per_key, self.worst = len(ids), (key, ids)
            await asyncio.sleep(0.02)

    # ---------------------------------------------------------------------- the log
    async def records(self) -> list[Record]:
        assert self.stack.bus is not None
        return [r async for r in read_log(self.stack.bus.js, self.stack.bus.subjects)]

    async def settle(self) -> None:
        """No consumer lag and no new log entry for a second."""
        assert self.stack.bus is not None
        js, subjects = self.stack.bus.js, self.stack.bus.subjects
        last, quiet = -1, time.monotonic()
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            lag = 0
            for p in range(subjects.partitions):
                with contextlib.suppress(Exception):
                    ci = await js.consumer_info(subjects.stream_in, f"reconciler-p{p}")
                    lag += (ci.num_pending or 0) + (ci.num_ack_pending or 0)
            seq = (await js.stream_info(subjects.stream_log)).state.last_seq
            if seq != last or lag:
                last, quiet = seq, time.monotonic()
            elif time.monotonic() - quiet > 1.0:
                return
            await asyncio.sleep(0.1)
        raise AssertionError("the log never settled")

    async def audit(self) -> AuditReport:
        await self.settle()
        report = audit_records(await self.records())
        assert report.clean, "\n".join(f"{v.rule} {v.key}#{v.n}: {v.message}" for v in report.violations)
        assert self.max_vms_per_key <= 1, f"two VMs for one key at once: {self.worst}"
        return report


@contextlib.asynccontextmanager
async def running_env(root: Path, **kw: Any) -> AsyncIterator[Env]:
    stack = LocalStack(root, **kw)
    await stack.start()
    env = Env(stack)
    oracle = asyncio.create_task(env.oracle())
    try:
        yield env
    finally:
        await cancel_and_wait([oracle], what="oracle")
        await stack.stop()


@pytest.fixture
async def env(tmp_path: Path) -> AsyncIterator[Env]:
    async with running_env(
        tmp_path / "stack", runtime="sim", partitions=4, restart_backoff_s=0.2, host_stale_s=3.0, watch_window=200
    ) as e:
        yield e
