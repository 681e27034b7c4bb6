"""The three patch dialects Kubernetes clients send.

Strategic merge patch is approximated as a JSON merge patch in which the few lists vmfence
writes (``conditions``, container statuses, containers) are merged by their key field instead
of replaced, and ``$patch: delete`` / ``$retainKeys`` directives are ignored.

The two merge patches modify neither input and copy only the dicts and keyed lists along the
patch's paths: their result shares every other subtree with the target or the patch, so a caller
that goes on to mutate the result deep-copies it first (the store does, in ``Store._write``).
A JSON patch edits a deep copy of the target in place.
"""

from __future__ import annotations

from typing import Any

from .errors import ApiError
from .jsontree import deep_copy

MERGE_KEYS: dict[str, str] = {
    "conditions": "type",
    "containerStatuses": "name",
    "initContainerStatuses": "name",
    "ephemeralContainerStatuses": "name",
    "containers": "name",
    "initContainers": "name",
    "ports": "containerPort",
    "env": "name",
    "volumes": "name",
    "volumeMounts": "mountPath",
    "tolerations": "key",
    "taints": "key",
    "addresses": "type",
    "ownerReferences": "uid",
}


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return patch
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def _merge_list(key_field: str, target: list[Any], patch: list[Any]) -> list[Any]:
    out = list(target)  # its items are replaced below, never modified
    index = {item.get(key_field): i for i, item in enumerate(out) if isinstance(item, dict)}
    for item in patch:
        if not isinstance(item, dict) or key_field not in item:
            return patch  # not a keyed list after all: replace, like a merge patch
        if item.get("$patch") == "delete":
            if item[key_field] in index:
                out[index[item[key_field]]] = None
            continue
        pos = index.get(item[key_field])
        if pos is None:
            out.append(strategic_merge_patch({}, item))
            index[item[key_field]] = len(out) - 1
        else:
            out[pos] = strategic_merge_patch(out[pos], item)
    return [x for x in out if x is not None]


def strategic_merge_patch(target: Any, patch: Any) -> Any:
    """Merge patch plus keyed-list merging for the fields in :data:`MERGE_KEYS`."""
    if not isinstance(patch, dict):
        return patch
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if key.startswith("$"):
            continue
        if value is None:
            result.pop(key, None)
        elif key in MERGE_KEYS and isinstance(value, list) and isinstance(result.get(key), list):
            result[key] = _merge_list(MERGE_KEYS[key], result[key], value)
        elif key.startswith("$setElementOrder/"):
            continue
        else:
            result[key] = strategic_merge_patch(result.get(key), value)
    return result


def _unescape(token: str) -> str:
    return token.replace("~1", "/").replace("~0", "~")


def _walk(doc: Any, pointer: str) -> tuple[Any, str]:
    """Return (parent container, last token) for an RFC 6901 pointer."""
    if not pointer.startswith("/"):
        raise ApiError(422, f"invalid JSON pointer {pointer!r}", "Invalid")
    tokens = [_unescape(t) for t in pointer[1:].split("/")]
    cur = doc
    for tok in tokens[:-1]:
        if isinstance(cur, list):
            try:
                cur = cur[int(tok)]
            except (ValueError, IndexError) as exc:
                raise ApiError(422, f"path {pointer!r} not found", "Invalid") from exc
        elif isinstance(cur, dict) and tok in cur:
            cur = cur[tok]
        else:
            raise ApiError(422, f"doc is missing path: {pointer!r}", "Invalid")
    return cur, tokens[-1]


def _get(doc: Any, pointer: str) -> Any:
    if pointer == "":
        return doc
    parent, tok = _walk(doc, pointer)
    try:
        return parent[int(tok)] if isinstance(parent, list) else parent[tok]
    except (KeyError, ValueError, IndexError, TypeError) as exc:
        raise ApiError(422, f"doc is missing path: {pointer!r}", "Invalid") from exc


def _remove(doc: Any, pointer: str) -> Any:
    parent, tok = _walk(doc, pointer)
    try:
        if isinstance(parent, list):
            return parent.pop(int(tok))
        return parent.pop(tok)
    except (KeyError, ValueError, IndexError, TypeError) as exc:
        raise ApiError(422, f"doc is missing path: {pointer!r}", "Invalid") from exc


def _add(doc: Any, pointer: str, value: Any, replace: bool = False) -> None:
    parent, tok = _walk(doc, pointer)
    if isinstance(parent, list):
        if tok == "-":
            parent.append(value)
            return
        try:
            idx = int(tok)
        except ValueError as exc:
            raise ApiError(422, f"invalid index in {pointer!r}", "Invalid") from exc
        if replace:
            if not 0 <= idx < len(parent):
                raise ApiError(422, f"doc is missing path: {pointer!r}", "Invalid")
            parent[idx] = value
        else:
            if not 0 <= idx <= len(parent):
                raise ApiError(422, f"index out of range in {pointer!r}", "Invalid")
            parent.insert(idx, value)
    elif isinstance(parent, dict):
        if replace and tok not in parent:
            raise ApiError(422, f"doc is missing key: {pointer!r}", "Invalid")
        parent[tok] = value
    else:
        raise ApiError(422, f"cannot add at {pointer!r}", "Invalid")


def json_patch(target: dict[str, Any], ops: Any) -> dict[str, Any]:
    """RFC 6902 JSON patch (add, remove, replace, move, copy, test)."""
    if not isinstance(ops, list):
        raise ApiError(
            400,
            "json patch must be a list of operations (kubernetes clients send a dict body as "
            "json-patch unless told otherwise: pass _content_type='application/merge-patch+json')",
            "BadRequest",
        )
    doc = deep_copy(target)
    for op in ops:
        if not isinstance(op, dict) or "op" not in op or "path" not in op:
            raise ApiError(400, f"invalid json patch operation: {op!r}", "BadRequest")
        kind, path = op["op"], op["path"]
        if kind == "add":
            _add(doc, path, deep_copy(op.get("value")))
        elif kind == "remove":
            _remove(doc, path)
        elif kind == "replace":
            _add(doc, path, deep_copy(op.get("value")), replace=True)
        elif kind == "move":
            _add(doc, path, _remove(doc, op["from"]))
        elif kind == "copy":
            _add(doc, path, deep_copy(_get(doc, op["from"])))
        elif kind == "test":
            if _get(doc, path) != op.get("value"):
                raise ApiError(422, f"testing value {path} failed", "Invalid")
        else:
            raise ApiError(400, f"unknown json patch operation {kind!r}", "BadRequest")
    if not isinstance(doc, dict):
        raise ApiError(422, "patch result is not an object", "Invalid")
    return doc
