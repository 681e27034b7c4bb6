"""Two stacks on one directory (issue 10, finding 13): the second is refused with one clear line
while the first runs on untouched — none of its files removed, its services still serving — and
also while processes a killed stack left behind (its nats-server, its reconcilers) still run."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.testbed.stack import LOCK_FILE, LocalStack, StackBusy
from tests.e2e.conftest import running_env


def _files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


async def test_a_second_stack_in_a_live_stacks_directory_is_refused_and_touches_nothing(tmp_path: Path) -> None:
    root = tmp_path / "stack"
    async with running_env(root, runtime="sim", partitions=4, reconcilers=1, hosts=("host-a",)) as env:
        await env.create("before")
        await env.wait_running("before")
        assert env.stack.nats is not None
        before = _files(root)
        assert {LOCK_FILE, "nats", "kubeconfig"} <= before

        second = LocalStack(root, runtime="sim", partitions=4, reconcilers=1, hosts=("host-a",))
        busy = r"^another stack is running in .*stack \(pid \d+, or processes it started\); stop it first"
        with pytest.raises(StackBusy, match=busy) as exc:
            await second.start()
        assert "\n" not in str(exc.value)
        await second.stop()  # a refused stack's stop stops nothing of the first

        assert before <= _files(root), sorted(before - _files(root))
        assert env.stack.nats.running and all(r.proc is not None and r.proc.poll() is None
                                               for r in env.stack.recs.values())
        await env.create("after")
        await env.wait_running("after")  # the first stack still works end to end
        await env.wait_running("before")

    # once the first stack has stopped, the directory is free again
    third = LocalStack(root, runtime="sim", partitions=4, reconcilers=1, hosts=("host-a",))
    third.lock()
    await third.stop()


async def test_processes_a_dead_stack_left_behind_keep_its_directory(tmp_path: Path) -> None:
    root = tmp_path / "stack"
    first = LocalStack(root, runtime="sim", partitions=4, reconcilers=1, hosts=("host-a",))
    await first.start()
    try:
        assert first.nats is not None
        first._lock.release()  # the stack's own process is gone (SIGKILL); its children live on
        second = LocalStack(root, runtime="sim", partitions=4, reconcilers=1, hosts=("host-a",))
        with pytest.raises(StackBusy, match="or processes it started"):
            await second.start()
        assert first.nats.running and (root / "nats" / "nats-server.conf").exists()
    finally:
        await first.stop()
    third = LocalStack(root, runtime="sim", partitions=4, reconcilers=1, hosts=("host-a",))
    third.lock()  # every process of the first is gone: the directory is free
    await third.stop()
