"""The watcher publishes a chunk's watch events as one run: side by side, then remembered, then the
resourceVersion advanced. A failed publish leaves nothing of the run remembered, so the resumed
watch publishes it all again; events of one uid in a run are judged against each other."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from kubernetes_asyncio import client

from services.watcher.watch import ResourceLoop
from shared.fence.keys import Key
from shared.fence.schema import Observed
from shared.subjects import Subjects

from .conftest import NS, pod_body


def event(etype: str, name: str, uid: str, rv: int, **kw: Any) -> dict[str, Any]:
    obj = pod_body(name, **kw)
    obj["metadata"].update(namespace=NS, uid=uid, resourceVersion=str(rv))
    return {"type": etype, "object": obj}


class Publishes:
    """Stands in for the bus: records what is published, optionally holding every publish until
    ``hold`` of them are in flight at once, or failing the publish of one uid."""

    def __init__(self, hold: int = 0, fail_uid: str | None = None) -> None:
        self.hold, self.fail_uid = hold, fail_uid
        self.entered = 0
        self.all_in = asyncio.Event()
        self.done: list[tuple[str, int]] = []

    async def __call__(self, key: Key, obs: Observed, msg_id: str) -> None:
        self.entered += 1
        if self.entered >= self.hold:
            self.all_in.set()
        await asyncio.wait_for(self.all_in.wait(), 5)  # one at a time would never get here
        if obs.uid == self.fail_uid:
            raise ConnectionError("the bus went away")
        self.done.append((obs.uid, obs.resource_version))


@pytest.fixture
async def loop() -> AsyncIterator[ResourceLoop]:
    cfg = client.Configuration()
    cfg.host = "http://127.0.0.1:1"  # never asked: the events are fed in directly
    api = client.ApiClient(cfg)
    try:
        yield ResourceLoop("pod", api, None, Subjects(), namespace=NS, stopping=asyncio.Event())  # type: ignore[arg-type]
    finally:
        await api.close()


async def test_a_chunks_events_are_published_side_by_side_and_then_the_version_advances(
    loop: ResourceLoop, monkeypatch: pytest.MonkeyPatch
) -> None:
    pub = Publishes(hold=3)
    monkeypatch.setattr(loop, "_publish", pub)
    loop.rv = "10"
    await loop._events([event("ADDED", f"p{i}", f"u{i}", 11 + i) for i in range(3)])
    assert sorted(pub.done) == [("u0", 11), ("u1", 12), ("u2", 13)]
    assert loop.rv == "13" and sorted(loop.known) == ["u0", "u1", "u2"]


async def test_a_failed_publish_remembers_nothing_of_its_run_and_the_retry_publishes_it_all(
    loop: ResourceLoop, monkeypatch: pytest.MonkeyPatch
) -> None:
    chunk = [event("ADDED", f"p{i}", f"u{i}", 11 + i) for i in range(3)]
    monkeypatch.setattr(loop, "_publish", Publishes(hold=3, fail_uid="u1"))
    loop.rv = "10"
    with pytest.raises(ConnectionError):
        await loop._events(chunk)
    assert loop.rv == "10" and loop.known == {}, "the watch resumes before the run"
    again = Publishes(hold=3)
    monkeypatch.setattr(loop, "_publish", again)
    await loop._events(chunk)  # as the resumed watch delivers it: none is taken for unchanged
    assert sorted(again.done) == [("u0", 11), ("u1", 12), ("u2", 13)] and loop.rv == "13"


async def test_events_of_one_uid_in_a_run_are_judged_against_each_other(
    loop: ResourceLoop, monkeypatch: pytest.MonkeyPatch
) -> None:
    pub = Publishes()
    monkeypatch.setattr(loop, "_publish", pub)
    await loop._events([
        event("ADDED", "p", "u", 5),
        event("MODIFIED", "p", "u", 6),  # only its version differs (a status write): not published
        event("MODIFIED", "p", "u", 7, annotations={"vmfence.io/on-recreate": "keep"}),
        event("DELETED", "p", "u", 8),
        event("BOOKMARK", "", "", 9),
    ])
    assert [rv for _, rv in pub.done] == [5, 7, 8]
    assert "u" not in loop.known and loop.rv == "9"
