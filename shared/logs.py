"""Structured logging: JSON lines in services, readable lines in the CLI.

Callers pass context as ``extra={"key": …, "uid": …, "epoch": …}``; the JSON formatter lifts the
known context fields to the top level so logs can be filtered by key, uid or epoch.
"""

from __future__ import annotations

import logging
import sys
import time

import msgspec

CONTEXT_FIELDS = (
    "key", "uid", "epoch", "vm_id", "host", "command_id", "op", "outcome", "event", "partition", "component", "seq"
)


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, object] = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for name in CONTEXT_FIELDS:
            value = record.__dict__.get(name)
            if value is not None:
                out[name] = value
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return msgspec.json.encode(out, enc_hook=str).decode()


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        ctx = " ".join(
            f"{name}={record.__dict__[name]}" for name in CONTEXT_FIELDS if record.__dict__.get(name) is not None
        )
        stamp = time.strftime("%H:%M:%S", time.localtime(record.created))
        line = f"{stamp} {record.levelname.lower():7} {record.name}: {record.getMessage()}"
        return f"{line} [{ctx}]" if ctx else line


def setup_logging(fmt: str = "json", level: str = "info") -> None:
    """Configure the root logger once; ``fmt`` is ``json`` (services) or ``text`` (CLI)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # neither formatter prints the caller's file and line, thread or process: records need not
    # find them (a stack walk per line; the logging HOWTO's "Optimization")
    logging._srcfile = None
    logging.logThreads = logging.logProcesses = logging.logMultiprocessing = False
    logging.getLogger("nats").setLevel(logging.WARNING)
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    # aiosqlite logs every statement with its parameters at DEBUG: the agent's ledger holds VNC
    # passwords, and a secret never enters a log line, whatever the level
    logging.getLogger("aiosqlite").setLevel(logging.WARNING)
