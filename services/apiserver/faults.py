"""Fault injection for the development API server.

Every fault reproduces something a real API server (or the network in front of it) is allowed
to do, so that vmfence's tolerance of it can be tested: stale reads from the watch cache, watch
streams that end, 409/429/500 answers, latency, and writes whose response is lost.

Rules address requests by Kubernetes verb (``get list watch create update patch delete``; an
eviction is ``create`` on ``pods/eviction``) and resource: ``"*"`` (any), ``"pods"`` (the main
resource only), ``"pods/status"`` (a subresource) or ``"pods/*"`` (the resource and all its
subresources). A group-qualified plural (``"virtualmachines.vmfence.io"``) matches too.

The same object is controllable in-process (``server.faults``) and over HTTP
(``GET``/``POST /_dev/faults`` with the JSON of :meth:`Faults.snapshot` / :meth:`Faults.apply`).
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

VERBS = frozenset({"get", "list", "watch", "create", "update", "patch", "delete", "*"})


@dataclass
class ErrorRule:
    """Answer matching requests with ``code`` instead of executing them."""

    verb: str
    resource: str
    code: int
    count: int | None = 1
    probability: float | None = None
    message: str | None = None
    fired: int = 0


@dataclass
class LatencyRule:
    """Delay matching requests by ``ms`` before handling them."""

    verb: str
    ms: float
    resource: str = "*"


@dataclass
class LostResponseRule:
    """Apply a matching write, then answer 500 (``mode="500"``) or drop the connection (``"close"``)."""

    verb: str
    resource: str
    count: int | None = 1
    probability: float | None = None
    mode: str = "500"
    fired: int = 0


def _matches(rule_verb: str, rule_res: str, verb: str, resources: tuple[str, ...]) -> bool:
    if rule_verb not in ("*", verb):
        return False
    if rule_res == "*":
        return True
    for res in resources:
        if rule_res == res:
            return True
        if rule_res.endswith("/*") and (res == rule_res[:-2] or res.startswith(rule_res[:-1])):
            return True
    return False


@dataclass
class Faults:
    """Switchable faults; all off by default."""

    seed: int = 0
    stale_events: int = 0
    stale_ms: float = 0.0
    drop_watch_every: int | None = None
    errors: list[ErrorRule] = field(default_factory=list)
    latency: list[LatencyRule] = field(default_factory=list)
    lost_responses: list[LostResponseRule] = field(default_factory=list)
    # requests that reached the resource handlers, by "<verb> <resource>" ("get pods",
    # "patch pods/status"), injected faults included: what tests count round trips with
    requests: Counter[str] = field(default_factory=Counter)
    # Hooks the server installs: re-evaluate the lagging cache, and close open watches.
    _on_stale_change: Callable[[], None] | None = field(default=None, repr=False)
    _on_drop_watches: Callable[[], int] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)

    # --- switches -------------------------------------------------------------------------
    def set_stale(self, events: int = 0, ms: float = 0.0) -> None:
        """Let watches and ``resourceVersion=0`` reads lag by ``events`` events and ``ms`` milliseconds."""
        self.stale_events = max(0, int(events))
        self.stale_ms = max(0.0, float(ms))
        if self._on_stale_change is not None:
            self._on_stale_change()

    def drop_watches(self) -> int:
        """Close every open watch stream now; returns how many were closed."""
        return self._on_drop_watches() if self._on_drop_watches is not None else 0

    def drop_watches_every(self, k: int | None) -> None:
        """Close each watch stream after it has sent ``k`` events, initial ones included (``None``: off)."""
        self.drop_watch_every = k if k and k > 0 else None

    def inject_error(
        self,
        verb: str,
        resource: str,
        code: int,
        count: int | None = 1,
        probability: float | None = None,
        message: str | None = None,
    ) -> ErrorRule:
        """Fail matching requests with ``code`` (409/429/500), ``count`` times and/or with a probability."""
        rule = ErrorRule(verb, resource, int(code), count, probability, message)
        self.errors.append(rule)
        return rule

    def add_latency(self, verb: str, ms: float, resource: str = "*") -> LatencyRule:
        """Delay matching requests."""
        rule = LatencyRule(verb, float(ms), resource)
        self.latency.append(rule)
        return rule

    def lose_response(
        self,
        verb: str,
        resource: str,
        count: int | None = 1,
        probability: float | None = None,
        mode: str = "500",
    ) -> LostResponseRule:
        """Apply matching writes but lose their response (answer 500, or close the connection)."""
        if mode not in ("500", "close"):
            raise ValueError(f"lost-response mode must be '500' or 'close', not {mode!r}")
        rule = LostResponseRule(verb, resource, count, probability, mode)
        self.lost_responses.append(rule)
        return rule

    def reset(self) -> None:
        """Switch every fault off (pending stale events are released)."""
        self.errors.clear()
        self.latency.clear()
        self.lost_responses.clear()
        self.drop_watch_every = None
        self.set_stale(0, 0.0)

    def reseed(self, seed: int) -> None:
        self.seed = seed
        self._rng = random.Random(seed)

    # --- evaluation (used by the server) ----------------------------------------------------
    def count(self, verb: str, resources: tuple[str, ...]) -> None:
        self.requests[f"{verb} {resources[0]}"] += 1

    def _fires(self, count: int | None, probability: float | None) -> bool:
        if count is not None and count <= 0:
            return False
        return probability is None or self._rng.random() < probability

    def take_error(self, verb: str, resources: tuple[str, ...]) -> ErrorRule | None:
        for rule in self.errors:
            if _matches(rule.verb, rule.resource, verb, resources) and self._fires(
                rule.count, rule.probability
            ):
                if rule.count is not None:
                    rule.count -= 1
                rule.fired += 1
                return rule
        return None

    def latency_ms(self, verb: str, resources: tuple[str, ...]) -> float:
        return sum(r.ms for r in self.latency if _matches(r.verb, r.resource, verb, resources))

    def take_lost_response(self, verb: str, resources: tuple[str, ...]) -> LostResponseRule | None:
        for rule in self.lost_responses:
            if _matches(rule.verb, rule.resource, verb, resources) and self._fires(
                rule.count, rule.probability
            ):
                if rule.count is not None:
                    rule.count -= 1
                rule.fired += 1
                return rule
        return None

    # --- JSON form (for /_dev/faults) -------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        """Current state as JSON-able data."""
        return {
            "seed": self.seed,
            "stale": {"events": self.stale_events, "ms": self.stale_ms},
            "drop_watch_every": self.drop_watch_every,
            "errors": [asdict(r) for r in self.errors],
            "latency": [asdict(r) for r in self.latency],
            "lost_responses": [asdict(r) for r in self.lost_responses],
            "requests": dict(self.requests),
        }

    def apply(self, body: dict[str, Any]) -> dict[str, Any]:
        """Apply a JSON command; rule lists are *added* to (use ``"reset": true`` to start clean).

        Keys: ``reset``, ``seed``, ``stale`` {events, ms}, ``drop_watches_now``,
        ``drop_watch_every``, ``errors`` [{verb, resource, code, count, probability, message}],
        ``latency`` [{verb, ms, resource}], ``lost_responses`` [{verb, resource, count,
        probability, mode}]. Returns the snapshot plus ``dropped`` (watches closed now).
        """
        if not isinstance(body, dict):
            raise ValueError("fault command must be a JSON object")
        dropped = 0
        if body.get("reset"):
            self.reset()
        if "seed" in body:
            self.reseed(int(body["seed"]))
        if "stale" in body:
            stale = body["stale"] or {}
            self.set_stale(int(stale.get("events", 0)), float(stale.get("ms", 0.0)))
        if "drop_watch_every" in body:
            self.drop_watches_every(body["drop_watch_every"])
        for spec in body.get("errors") or []:
            self._check_verb(spec["verb"])
            self.inject_error(
                spec["verb"],
                spec.get("resource", "*"),
                int(spec["code"]),
                spec.get("count", 1),
                spec.get("probability"),
                spec.get("message"),
            )
        for spec in body.get("latency") or []:
            self._check_verb(spec["verb"])
            self.add_latency(spec["verb"], float(spec["ms"]), spec.get("resource", "*"))
        for spec in body.get("lost_responses") or []:
            self._check_verb(spec["verb"])
            self.lose_response(
                spec["verb"],
                spec.get("resource", "*"),
                spec.get("count", 1),
                spec.get("probability"),
                str(spec.get("mode", "500")),
            )
        if body.get("drop_watches_now"):
            dropped = self.drop_watches()
        return {**self.snapshot(), "dropped": dropped}

    @staticmethod
    def _check_verb(verb: str) -> None:
        if verb not in VERBS:
            raise ValueError(f"unknown verb {verb!r}; expected one of {sorted(VERBS)}")
