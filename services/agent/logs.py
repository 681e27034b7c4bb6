"""Log context for one VM and its fence, so one incarnation's story can be grepped out of a host's
log (the JSON formatting itself is ``shared.logs``)."""

from __future__ import annotations

from typing import Any

from shared.fence.schema import Command, Fence
from shared.logs import setup_logging as _setup


def setup_logging(level: str = "INFO") -> None:
    """JSON lines on stderr for the whole process (called by ``main`` only, not by the library)."""
    _setup("json", level)


def fence_fields(fence: Fence | None, vm_id: str | None = None, **more: Any) -> dict[str, Any]:
    """``extra=`` for a log call about one VM and its fence."""
    d: dict[str, Any] = {"vm_id": vm_id, **more}
    if fence is not None:
        d.update(key=fence.key, uid=fence.uid, epoch=fence.epoch)
    return d


def cmd_fields(cmd: Command, **more: Any) -> dict[str, Any]:
    return fence_fields(cmd.fence, cmd.vm_id, command_id=cmd.id, op=cmd.op, **more)
