"""Runtime drivers: how an agent runs VMs on its host (``qemu``: real QEMU processes; ``sim``:
in-process, deterministic and fault-injectable)."""

from __future__ import annotations

from typing import Any

from .base import (
    Inconclusive,
    NetAttach,
    RuntimeDriver,
    RuntimeEvent,
    RuntimeFailure,
    SnapshotInfo,
    VMExitedEvent,
    VMGoneEvent,
    VMInfo,
    VMSpec,
)
from .images import ImageError, check_in_store, resolve_image
from .pool import DisplayPool, ReservationError, vnc_owner

__all__ = [
    "DisplayPool",
    "ImageError",
    "Inconclusive",
    "NetAttach",
    "ReservationError",
    "RuntimeDriver",
    "RuntimeEvent",
    "RuntimeFailure",
    "SnapshotInfo",
    "VMExitedEvent",
    "VMGoneEvent",
    "VMInfo",
    "VMSpec",
    "check_in_store",
    "make_driver",
    "resolve_image",
    "vnc_owner",
]


def make_driver(name: str, *, state_dir: str, **options: Any) -> RuntimeDriver:
    """Build a runtime driver by name.

    ``qemu`` options: accel ("auto"|"kvm"|"tcg"), machine, qemu_binary, qemu_img, vnc_displays,
    image_store, reconcile_interval, qmp_timeout, probe_image, ... (see QemuDriver).
    ``sim`` options: seed, vnc_displays, image_store, op_latency (see SimDriver). ``state_dir`` is where the
    driver keeps what must outlive the agent process.
    """
    if name == "qemu":
        from .qemu import QemuDriver

        return QemuDriver(state_dir=state_dir, **options)
    if name == "sim":
        from .sim import SimDriver

        return SimDriver(state_dir=state_dir, **options)
    raise ValueError(f"unknown runtime driver {name!r} (expected 'qemu' or 'sim')")
