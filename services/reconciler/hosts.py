"""The fleet as the reconciler sees it: agent heartbeats from the hosts bucket, plus what this
reconciler has placed since each heartbeat (so a burst of placements spreads instead of piling
onto the host that looked emptiest a moment ago)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field

import msgspec
from nats.js.kv import KeyValue

from services.reconciler import metrics
from shared.fence.decide import HostView, placeable
from shared.fence.heartbeat import HostHeartbeat
from shared.fence.schema import PlaceTimer, TimerArmed, purpose_text
from shared.fence.state import KeyState

log = logging.getLogger(__name__)

_decoder = msgspec.json.Decoder(HostHeartbeat)
LIVE_CACHE_S = 0.5
PLACE_PURPOSE = purpose_text(PlaceTimer())


def worth_checking(roomier: list[HostView], state: KeyState | None, timer: TimerArmed) -> bool:
    """Whether a check waiting for a host is worth firing now that ``roomier`` came live or have
    more room: a survey waits for any live host; a placement only for one of them that could take
    the pod (``decide.placeable``: a pod bound to a dead node waits for that node, and checking it
    each time another host frees room would undo its backoff). A key not at hand is checked."""
    if timer.purpose != PLACE_PURPOSE or state is None or state.cur is None:
        return True
    return placeable(roomier, state.cur.spec)


@dataclass
class _Host:
    beat: HostHeartbeat
    seen: float  # monotonic time of the last heartbeat received
    placed_vms: int = 0
    placed_cpus: int = 0
    placed_mib: int = 0


@dataclass
class HostsView:
    stale_after_s: float = 15.0
    hosts: dict[str, _Host] = field(default_factory=dict)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    # set when a host comes live (new, or back after stale_after_s) or reports more free CPUs or
    # memory than before, and those hosts: pods they could take are worth checking again
    # (Reconciler._place_again, which takes them with ``take_roomier``)
    roomier: asyncio.Event = field(default_factory=asyncio.Event)
    roomier_hosts: set[str] = field(default_factory=set)
    _live: list[HostView] | None = None
    _live_at: float = 0.0

    def __post_init__(self) -> None:
        metrics.HEARTBEAT_AGES.watch(self)

    def __hash__(self) -> int:  # held in the gauge's WeakSet by identity
        return id(self)

    def update(self, beat: HostHeartbeat) -> None:
        now = time.monotonic()
        old = self.hosts.get(beat.host)
        if (old is None or now - old.seen >= self.stale_after_s or beat.cpus_free > old.beat.cpus_free
                or beat.memory_free_mib > old.beat.memory_free_mib):
            self.roomier_hosts.add(beat.host)
            self.roomier.set()
        self.hosts[beat.host] = _Host(beat, now)
        self._live = None
        self.changed.set()

    def take_roomier(self) -> set[str]:
        """The hosts that came live or have more room since the last call (and clear the signal)."""
        hosts, self.roomier_hosts = self.roomier_hosts, set()
        self.roomier.clear()
        return hosts

    def remove(self, host: str) -> None:
        self.hosts.pop(host, None)

    def placed(self, host: str, cpus: int, memory_mib: int) -> None:
        h = self.hosts.get(host)
        if h is not None:
            h.placed_vms += 1
            h.placed_cpus += cpus
            h.placed_mib += memory_mib
            self._live = None

    def live(self) -> list[HostView]:
        """Live hosts; recomputed at most every LIVE_CACHE_S (placement counts are exact anyway:
        ``placed`` invalidates)."""
        now = time.monotonic()
        if self._live is not None and now - self._live_at < LIVE_CACHE_S:
            return self._live
        self._live_at = now
        self._live = [
            HostView(
                name=name,
                cpus_free=h.beat.cpus_free - h.placed_cpus,
                memory_free_mib=h.beat.memory_free_mib - h.placed_mib,
                vms=h.beat.vms + h.placed_vms,
            )
            for name, h in sorted(self.hosts.items())
            if now - h.seen < self.stale_after_s
        ]
        return self._live

    def heartbeat_ages(self) -> list[tuple[str, float]]:
        """(host, seconds since its last heartbeat arrived) for the heartbeat-age gauge."""
        now = time.monotonic()
        return [(name, now - h.seen) for name, h in self.hosts.items()]

    def ages(self) -> list[tuple[HostHeartbeat, float]]:
        now = time.monotonic()
        return [(h.beat, now - h.seen) for h in self.hosts.values()]

    async def watch(self, kv: KeyValue) -> None:
        """Follow the hosts bucket until cancelled; reconnects are the client's business."""
        while True:
            try:
                watcher = await kv.watchall()
                async for entry in watcher:
                    if entry is None:
                        continue  # end of the initial values
                    if entry.operation in ("DEL", "PURGE") or not entry.value:
                        self.remove(entry.key)
                        continue
                    try:
                        self.update(_decoder.decode(entry.value))
                    except msgspec.DecodeError as exc:
                        log.warning("bad heartbeat for %s: %s", entry.key, exc)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the watch died (server restart): start it again
                log.warning("hosts watch restarting: %r", exc)
                await asyncio.sleep(1.0)
            finally:
                with contextlib.suppress(Exception):
                    await watcher.stop()  # type: ignore[possibly-undefined]
