"""Structured JSON logs: one object per line, carrying key/uid/epoch/vm_id/command_id when known,
so one incarnation's story can be grepped out of a host's log."""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

from shared.schema import Command, Fence

FIELDS = ("host", "key", "uid", "epoch", "vm_id", "command_id", "op", "outcome", "event")


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for f in FIELDS:
            v = record.__dict__.get(f)
            if v is not None:
                out[f] = v
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def setup_logging(level: str = "INFO") -> None:
    """JSON lines on stderr for the whole process (called by ``main`` only, not by the library)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    logging.Formatter.converter = time.gmtime


def fence_fields(fence: Fence | None, vm_id: str | None = None, **more: Any) -> dict[str, Any]:
    """``extra=`` for a log call about one VM and its fence."""
    d: dict[str, Any] = {"vm_id": vm_id, **more}
    if fence is not None:
        d.update(key=fence.key, uid=fence.uid, epoch=fence.epoch)
    return d


def cmd_fields(cmd: Command, **more: Any) -> dict[str, Any]:
    return fence_fields(cmd.fence, cmd.vm_id, command_id=cmd.id, op=cmd.op, **more)
