"""Label and field selectors in the syntax of ``?labelSelector=`` / ``?fieldSelector=``.

Only the subset real controllers use is parsed: ``=``/``==``/``!=``, ``in``, ``notin``,
existence (``key``) and non-existence (``!key``). Field selectors resolve any dotted path
(``spec.nodeName``, ``involvedObject.uid``...), which is more lenient than a real server.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from .errors import ApiError

Predicate = Callable[[dict[str, Any]], bool]

_SET_RE = re.compile(r"^\s*(!?)\s*([A-Za-z0-9_./-]+)\s*(?:(notin|in)\s*\(([^)]*)\))?\s*$")


def _split_top_level(text: str) -> list[str]:
    """Split on commas that are not inside ``( )`` (set-based requirements contain commas)."""
    parts: list[str] = []
    depth = 0
    cur = ""
    for ch in text:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    parts.append(cur)
    return [p.strip() for p in parts if p.strip()]


def _requirement(expr: str) -> Callable[[dict[str, str]], bool]:
    for op in ("!=", "==", "="):
        if op in expr and "(" not in expr:
            key, _, value = expr.partition(op)
            key, value = key.strip(), value.strip()
            if not key:
                raise ApiError(400, f"invalid selector: {expr!r}", "BadRequest")
            if op == "!=":
                return lambda labels: labels.get(key) != value
            return lambda labels: labels.get(key) == value
    m = _SET_RE.match(expr)
    if m is None:
        raise ApiError(400, f"unable to parse requirement: {expr!r}", "BadRequest")
    neg, key, op, values_text = m.groups()
    if op is None:
        if neg:
            return lambda labels: key not in labels
        return lambda labels: key in labels
    if neg:
        raise ApiError(400, f"unable to parse requirement: {expr!r}", "BadRequest")
    values = {v.strip() for v in values_text.split(",") if v.strip()}
    if op == "in":
        return lambda labels: labels.get(key) in values
    return lambda labels: labels.get(key) not in values


def label_selector(text: str | None) -> Predicate:
    """Compile a label selector into a predicate over whole objects."""
    if not text:
        return lambda _obj: True
    reqs = [_requirement(p) for p in _split_top_level(text)]

    def match(obj: dict[str, Any]) -> bool:
        labels = (obj.get("metadata") or {}).get("labels") or {}
        return all(r(labels) for r in reqs)

    return match


def field_value(obj: dict[str, Any], path: str) -> str:
    """Resolve a dotted field path to the string a field selector compares against."""
    cur: Any = obj
    for part in path.split("."):
        if not isinstance(cur, dict):
            return ""
        cur = cur.get(part)
    if cur is None:
        return ""
    if isinstance(cur, bool):
        return "true" if cur else "false"
    return str(cur)


def field_selector(text: str | None) -> Predicate:
    """Compile a field selector (only equality / inequality exist for fields)."""
    if not text:
        return lambda _obj: True
    reqs: list[tuple[str, bool, str]] = []
    for part in _split_top_level(text):
        for op in ("!=", "==", "="):
            if op in part:
                key, _, value = part.partition(op)
                reqs.append((key.strip(), op == "!=", value.strip()))
                break
        else:
            raise ApiError(400, f"invalid field selector: {part!r}", "BadRequest")

    def match(obj: dict[str, Any]) -> bool:
        for key, negate, value in reqs:
            if (field_value(obj, key) == value) == negate:
                return False
        return True

    return match
