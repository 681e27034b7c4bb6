"""Minimal structural-schema validation and defaulting for custom resources.

Covers the OpenAPI v3 keywords the VirtualMachine CRD uses (type, properties, required, enum,
minimum/maximum, minLength, pattern, items, default) so that bad specs get the 422 a real
server would give and defaults (e.g. ``restartPolicy: Always``) appear. Unknown fields are not
pruned (a real server prunes them).
"""

from __future__ import annotations

import re
from typing import Any

_TYPES: dict[str, tuple[type, ...]] = {
    "object": (dict,),
    "array": (list,),
    "string": (str,),
    "boolean": (bool,),
    "integer": (int,),
    "number": (int, float),
}


def _type_ok(value: Any, typ: str) -> bool:
    if typ in ("integer", "number") and isinstance(value, bool):
        return False
    return isinstance(value, _TYPES.get(typ, (object,)))


def _check(value: Any, sch: dict[str, Any], path: str, errors: list[tuple[str, str]]) -> None:
    typ = sch.get("type")
    if typ and not _type_ok(value, typ):
        errors.append(
            (path, f'Invalid value: "{type(value).__name__}": {path} in body must be of type {typ}')
        )
        return
    if "enum" in sch and value not in sch["enum"]:
        allowed = ", ".join(f'"{v}"' for v in sch["enum"])
        errors.append((path, f'Unsupported value: "{value}": supported values: {allowed}'))
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if "minimum" in sch and value < sch["minimum"]:
            errors.append(
                (
                    path,
                    f"Invalid value: {value}: {path} in body should be greater than or equal to "
                    f"{sch['minimum']}",
                )
            )
        if "maximum" in sch and value > sch["maximum"]:
            errors.append(
                (
                    path,
                    f"Invalid value: {value}: {path} in body should be less than or equal to "
                    f"{sch['maximum']}",
                )
            )
    if isinstance(value, str):
        if "minLength" in sch and len(value) < sch["minLength"]:
            errors.append(
                (
                    path,
                    f'Invalid value: "{value}": {path} in body should be at least '
                    f"{sch['minLength']} chars long",
                )
            )
        if "pattern" in sch and not re.search(sch["pattern"], value):
            errors.append(
                (path, f"Invalid value: \"{value}\": {path} in body should match '{sch['pattern']}'")
            )
    if isinstance(value, dict):
        props: dict[str, Any] = sch.get("properties") or {}
        for name, sub in props.items():
            if name not in value and "default" in sub:
                value[name] = sub["default"]
        for name in sch.get("required") or []:
            if name not in value:
                errors.append((f"{path}.{name}", "Required value"))
        for name, sub in props.items():
            if name in value and value[name] is not None:
                _check(value[name], sub, f"{path}.{name}", errors)
    if isinstance(value, list) and isinstance(sch.get("items"), dict):
        for i, item in enumerate(value):
            _check(item, sch["items"], f"{path}[{i}]", errors)


def validate_and_default(
    obj: dict[str, Any], sch: dict[str, Any], skip: tuple[str, ...] = ()
) -> list[tuple[str, str]]:
    """Apply defaults in place and return ``(field path, message)`` for every violation."""
    errors: list[tuple[str, str]] = []
    props: dict[str, Any] = sch.get("properties") or {}
    for name in sch.get("required") or []:
        if name not in obj and name not in skip:
            errors.append((name, "Required value"))
    for name, sub in props.items():
        if name in skip:
            continue
        if name not in obj and "default" in sub:
            obj[name] = sub["default"]
        if name in obj and obj[name] is not None:
            _check(obj[name], sub, name, errors)
    return errors
