"""The ``qemu`` runtime driver, split by job (see driver.py): ``QemuDriver`` is what agents use."""

from __future__ import annotations

from .accel import REPO_GUEST_IMAGE
from .driver import GUEST_IP, QemuDriver, tcp_probe

__all__ = ["GUEST_IP", "REPO_GUEST_IMAGE", "QemuDriver", "tcp_probe"]
