"""Reservations of VNC displays, owned by an opaque owner string (e.g. "vm_id/uid/epoch")."""

from __future__ import annotations

import secrets
import socket
import string
import threading
from collections.abc import Iterable

from .base import RuntimeFailure, VMSpec

# RFB's "VNC Authentication" uses the first 8 characters of a password and no more (a DES key):
# a per-VM password is exactly that long, from letters and digits (about 47 bits)
VNC_PASSWORD_CHARS = 8
VNC_ALPHABET = string.ascii_letters + string.digits
DEFAULT_VNC_LISTEN = "127.0.0.1"


def new_vnc_password() -> str:
    """A fresh per-VM VNC password."""
    return "".join(secrets.choice(VNC_ALPHABET) for _ in range(VNC_PASSWORD_CHARS))


class ReservationError(RuntimeFailure):
    """A reservation was released or claimed by someone who does not own it."""


def _port_free(port: int, host: str = DEFAULT_VNC_LISTEN) -> bool:
    """Could QEMU listen on ``port`` now? It binds with SO_REUSEADDR, so the check does too: a
    closed VNC connection of a removed VM lingers in TIME_WAIT on its port for a minute, which would
    otherwise make its display look taken; a socket listening there still does."""
    s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, port))
        return True
    except OSError:
        return False
    finally:
        s.close()


class DisplayPool:
    """VNC displays from a fixed range (display N listens on TCP 5900+N).

    A display is freed only by the owner that reserved it; anybody else releasing it gets a
    ReservationError. ``check_port`` makes reserve() skip displays whose TCP port is already
    bound on the host by something else (another process, another agent).
    The pool itself is in-memory: ``owners()`` and ``claim()`` let the agent persist and restore
    ownership (e.g. in its ledger), and the qemu driver re-claims the displays of VMs it
    rediscovers in ``open()``.
    """

    BASE_PORT = 5900

    def __init__(self, displays: Iterable[int] = range(10, 110), *, check_port: bool = True,
                 listen: str = DEFAULT_VNC_LISTEN) -> None:
        self.displays = displays
        self.listen = listen  # the address VNC listens on: where a port must be free
        self._order = list(self.displays)
        self._owner: dict[int, str] = {}
        self._check_port = check_port
        self._lock = threading.Lock()

    def __contains__(self, display: object) -> bool:
        return display in self._order

    def __len__(self) -> int:
        return len(self._order)

    def reserve(self, owner: str) -> int:
        """Reserve the lowest free display for ``owner``; raises RuntimeFailure when exhausted."""
        if not owner:
            raise ValueError("owner must be a non-empty string")
        with self._lock:
            for d in self._order:
                if d in self._owner:
                    continue
                if self._check_port and not _port_free(self.BASE_PORT + d, self.listen):
                    continue
                self._owner[d] = owner
                return d
        raise RuntimeFailure(f"no free VNC display in {self.displays!r}")

    def claim(self, display: int, owner: str) -> None:
        """Record that ``owner`` holds ``display`` (restoring persisted state). Idempotent for the
        same owner; a display held by another owner raises ReservationError."""
        if display not in self._order:
            raise ReservationError(f"display {display} is outside the pool {self.displays!r}")
        with self._lock:
            cur = self._owner.get(display)
            if cur is not None and cur != owner:
                raise ReservationError(f"display {display} is owned by {cur!r}, not {owner!r}")
            self._owner[display] = owner

    def release(self, display: int, owner: str) -> None:
        """Free ``display``; only its owner may. Releasing a free display is a no-op."""
        with self._lock:
            cur = self._owner.get(display)
            if cur is None:
                return
            if cur != owner:
                raise ReservationError(
                    f"display {display} is owned by {cur!r}; {owner!r} may not release it"
                )
            del self._owner[display]

    def owner_of(self, display: int) -> str | None:
        with self._lock:
            return self._owner.get(display)

    def owners(self) -> dict[int, str]:
        with self._lock:
            return dict(self._owner)


def vnc_owner(spec: VMSpec) -> str:
    """The reservation owner of a VM's display: ``vm_id/uid/epoch`` (uid and epoch from the
    vmfence labels ``vmfence.io/uid`` and ``vmfence.io/epoch`` when present)."""
    uid = spec.labels.get("vmfence.io/uid", "")
    epoch = spec.labels.get("vmfence.io/epoch", "")
    return f"{spec.vm_id}/{uid}/{epoch}"
