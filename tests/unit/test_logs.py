"""The services' JSON log lines: one object per line, context fields at the top level, anything
that is not JSON as its text, and the exception with its traceback."""

from __future__ import annotations

import json
import logging
import sys

from shared.logs import JsonFormatter


def _record(msg: str, extra: dict[str, object], exc: bool = False) -> logging.LogRecord:
    exc_info = None
    if exc:
        try:
            raise ValueError("boom")
        except ValueError:
            exc_info = sys.exc_info()
    logger = logging.getLogger("vmfence.test")
    return logger.makeRecord("vmfence.test", logging.INFO, __file__, 1, msg, ("x",), exc_info, extra=extra)


def test_json_line_lifts_context_and_stringifies_the_rest() -> None:
    line = JsonFormatter().format(_record("made %s", {"key": "ns/a", "epoch": 3, "host": object(), "other": 1}))
    assert "\n" not in line
    out = json.loads(line)
    assert out["msg"] == "made x" and out["level"] == "info" and out["logger"] == "vmfence.test"
    assert out["key"] == "ns/a" and out["epoch"] == 3
    assert out["host"].startswith("<object object")  # not JSON: its text, never a crash
    assert "other" not in out  # only the known context fields


def test_json_line_carries_the_exception() -> None:
    out = json.loads(JsonFormatter().format(_record("failed %s", {}, exc=True)))
    assert "ValueError: boom" in out["exc"] and "Traceback" in out["exc"]
