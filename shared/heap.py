"""The cyclic garbage collector, set for a long-running service, and the time it takes.

CPython's collector runs a young collection every 700 net container allocations and, every so
often, a full one that walks every tracked object: the tens of thousands a service imports
(kubernetes-asyncio's models are most of a reconciler's 77 000) and every key it holds. Under load
that was 5-8 % of a reconciler's CPU (``perf``: ``gc_collect_main``, ``visit_decref``,
``visit_reachable``). Nearly every object a service makes dies by its reference count; the
collector is there for the few cycles (exceptions with their tracebacks, some futures).

So a service, once imported (:func:`settle`): collects once, freezes what survived (modules,
classes, constants: never garbage, never walked again), and runs young collections less often.
Every pause is counted in ``vmfence_gc_pause_seconds_total`` (a full collection also stalls the
event loop for that long).
"""

from __future__ import annotations

import gc
import time

from prometheus_client import Counter

# a young collection every YOUNG container allocations net of deallocations: objects alive across
# one are walked; with a larger YOUNG more of them have died by reference count first (and at most
# a few MiB of cyclic garbage wait for it)
YOUNG = 20_000
MIDDLE = 10  # young collections per middle one (CPython's default)
OLD = 10  # middle collections per full one (CPython's default; a full one also waits for 25 % growth)

GC_PAUSE = Counter(
    "vmfence_gc_pause_seconds",
    "Seconds this process spent in the cyclic garbage collector, by generation collected",
    ["generation"],
)
_pause = [GC_PAUSE.labels(str(g)) for g in range(3)]
_started = [0.0]


def _timed(phase: str, info: dict[str, int]) -> None:
    if phase == "start":
        _started[0] = time.perf_counter()
    else:
        _pause[min(2, max(0, info.get("generation", 0)))].inc(time.perf_counter() - _started[0])


def count_pauses() -> None:
    """Count every collection's pause from now on (idempotent)."""
    if _timed not in gc.callbacks:
        gc.callbacks.append(_timed)


def settle() -> None:
    """Freeze the heap as it is now, set the thresholds above, and count the pauses (call once,
    after the service's imports)."""
    count_pauses()
    gc.collect()
    gc.freeze()
    gc.set_threshold(YOUNG, MIDDLE, OLD)
