"""The Prometheus metrics the core emits, defined once per process (services in one process —
the demo, tests — share them and tell themselves apart by labels)."""

from __future__ import annotations

import typing
import weakref
from collections.abc import Iterator, Mapping
from typing import Protocol

from prometheus_client import REGISTRY, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from shared.fence.drift import DriftKind

Metric = typing.TypeVar("Metric", Counter, Histogram)


class Labelled(typing.Generic[Metric]):
    """A labelled metric whose children are looked up once per label values: prometheus_client's
    ``labels()`` validates and takes a lock on every call (about 2 µs), and the write path calls it
    for every input, every decision and every effect. Anything else is the metric's own."""

    def __init__(self, metric: Metric) -> None:
        self.metric: Metric = metric
        self._children: dict[tuple[str, ...], Metric] = {}

    def labels(self, *values: str) -> Metric:
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = self.metric.labels(*values)
        return child

    def __getattr__(self, name: str) -> typing.Any:
        return getattr(self.metric, name)


DECISIONS = Labelled(Counter("vmfence_decisions_total", "Decisions appended to the log", ["type"]))
INPUTS = Labelled(Counter("vmfence_inputs_total", "Inputs consumed by reconcilers", ["kind", "result"]))
POD_LIFECYCLE = Labelled(Counter(
    "vmfence_pod_lifecycle_total",
    "Lifecycle steps per key, including every input skipped as superseded",
    ["op", "result", "reason"],
))
APPEND_SECONDS = Histogram(
    "vmfence_append_seconds",
    "Fenced append latency",
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
)
LOST_RACES = Counter("vmfence_append_lost_races_total", "Appends that lost the expected-sequence race")
PLACE_CHECKS_EARLY = Counter(
    "vmfence_place_checks_early_total",
    "Checks of pods waiting for a host (placement, survey), fired early because a host came live or has more room",
)
EFFECTS_PARKED = Gauge(
    "vmfence_effects_parked",
    "Keys whose next effect failed (a publish, a confirm) and waits to be tried again, holding no worker",
)
REWRITES_EARLY = Counter(
    "vmfence_rewrites_early_total",
    "Kubernetes writes again (rewrite timers) fired early because the API server answers again after a silence",
)
PARTITIONS_OWNED = Gauge("vmfence_partitions_owned", "Partitions this reconciler holds", ["reconciler"])
LEASE_LOST = Counter("vmfence_lease_lost_total", "Partition leases lost while held", ["reconciler"])
DEAD_LETTERS = Counter("vmfence_dead_letters_total", "Messages parked in the DLQ", ["reason"])
EFFECT_SECONDS = Labelled(Histogram(
    "vmfence_effect_seconds",
    "Time to carry out one effect",
    ["kind"],
    buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
))
PARTITION_IMAGES = Labelled(Counter(
    "vmfence_partition_images_total",
    "Partition images on the bus: put, too_large (not put), read, used (further along than the snapshot), refused",
    ["result"],
))
PARTITION_LOAD_ENTRIES = Labelled(Counter(
    "vmfence_partition_load_entries_total",
    "Log entries folded when taking a partition, by what the load started from: image, snapshot or log",
    ["source"],
))
K8S_WRITES = Labelled(Counter("vmfence_k8s_writes_total", "Kubernetes writes by outcome", ["verb", "result"]))
CONSUMER_PENDING = Gauge("vmfence_consumer_pending", "Unprocessed inputs per partition", ["partition"])
AUDIT_VIOLATIONS = Counter("vmfence_audit_violations_total", "Violations found by audits in this process")
DRIFT_CHECKS = Counter(
    "vmfence_drift_checks_total",
    "Drift checks of held keys against the hosts' inventories, by result (clean, drift)",
    ["result"],
)
LOG_UNDECODABLE = Counter(
    "vmfence_log_undecodable_total",
    "Log entries found that no reader can take as an entry of their subject's key (each quarantines that key)",
)


class HeartbeatAges(Collector):
    """``vmfence_host_heartbeat_age_seconds{host}``: seconds since this process last received each
    host's heartbeat, computed at scrape time from every live hosts view (several reconcilers in one
    process — the demo, tests — report the freshest view of a host)."""

    def __init__(self) -> None:
        self._sources: weakref.WeakSet[_AgesSource] = weakref.WeakSet()

    def watch(self, source: _AgesSource) -> None:
        self._sources.add(source)

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "vmfence_host_heartbeat_age_seconds",
            "Seconds since each host's last heartbeat was received",
            labels=["host"],
        )
        freshest: dict[str, float] = {}
        for source in list(self._sources):
            for host, age in source.heartbeat_ages():
                freshest[host] = min(age, freshest.get(host, age))
        for host, age in sorted(freshest.items()):
            family.add_metric([host], age)
        yield family


class _AgesSource(Protocol):
    def heartbeat_ages(self) -> list[tuple[str, float]]: ...


HEARTBEAT_AGES = HeartbeatAges()
REGISTRY.register(HEARTBEAT_AGES)


class QuarantinedKeys(Collector):
    """``vmfence_quarantined_keys{partition}``: keys whose log holds an entry that does not decode,
    so nothing is decided for them, per partition held in this process (computed at scrape time
    from the partitions still held: a dropped partition reports nothing, never a stale count)."""

    def __init__(self) -> None:
        self._sources: weakref.WeakSet[_QuarantineSource] = weakref.WeakSet()

    def watch(self, source: _QuarantineSource) -> None:
        self._sources.add(source)

    def counts(self) -> dict[int, int]:
        out: dict[int, int] = {}
        for source in list(self._sources):
            if source.held:
                out[source.p] = max(out.get(source.p, 0), len(source.quarantined))
        return out

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "vmfence_quarantined_keys",
            "Keys whose log holds an undecodable entry: no decision, command or write is made for them",
            labels=["partition"],
        )
        for p, n in sorted(self.counts().items()):
            family.add_metric([str(p)], n)
        yield family


class _QuarantineSource(Protocol):
    p: int
    held: bool

    @property
    def quarantined(self) -> Mapping[str, object]: ...


QUARANTINED_KEYS = QuarantinedKeys()
REGISTRY.register(QUARANTINED_KEYS)

DRIFT_KINDS: tuple[str, ...] = typing.get_args(DriftKind)
# judged by every reconciler alike (not per partition): the hosts' side, so never summed
_FLEET_KINDS = frozenset({"host_unanswered"})


class DriftGauge(Collector):
    """``vmfence_drift{kind}``: what the last drift check of each reconciler in this process found,
    every kind (0 when none). Reconcilers hold disjoint partitions, so their partition-scoped counts
    add up; a kind about hosts is the largest any saw. Nothing until a check has run."""

    def __init__(self) -> None:
        self._sources: weakref.WeakSet[_DriftSource] = weakref.WeakSet()

    def watch(self, source: _DriftSource) -> None:
        self._sources.add(source)

    def counts(self) -> dict[str, int] | None:
        seen = [s.drift_counts for s in list(self._sources) if s.drift_counts is not None]
        if not seen:
            return None
        out = dict.fromkeys(DRIFT_KINDS, 0)
        for counts in seen:
            for kind in DRIFT_KINDS:
                n = counts.get(kind, 0)
                out[kind] = max(out[kind], n) if kind in _FLEET_KINDS else out[kind] + n
        return out

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "vmfence_drift",
            "Drift between the log's end state and the hosts' inventories at the last check, by kind",
            labels=["kind"],
        )
        for kind, n in (self.counts() or {}).items():
            family.add_metric([kind], n)
        yield family


class _DriftSource(Protocol):
    @property
    def drift_counts(self) -> Mapping[str, int] | None: ...


DRIFT = DriftGauge()
REGISTRY.register(DRIFT)
