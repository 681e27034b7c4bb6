"""Server-side printing (``meta.k8s.io/v1 Table``) for kubectl.

kubectl asks for ``application/json;as=Table`` and prints whatever columns the server chooses;
serving tables makes ``kubectl get pods``/``get vm`` look like they do against a real cluster.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from .resources import ResourceType
from .selectors import field_value

_NAME_COL = {"name": "Name", "type": "string", "format": "name", "description": "Name", "priority": 0}


def wants_table(accept: str) -> bool:
    return "as=Table" in accept


def human_age(ts: str | None) -> str:
    """kubectl-style short duration since ``ts`` (``5s``, ``3m``, ``2d``)."""
    if not ts:
        return "<unknown>"
    try:
        then = datetime.strptime(ts, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC)
    except ValueError:
        return "<invalid>"
    s = max(0, int((datetime.now(UTC) - then).total_seconds()))
    if s < 120:
        return f"{s}s"
    if s < 600:
        return f"{s // 60}m{s % 60}s" if s % 60 else f"{s // 60}m"
    if s < 3 * 3600:
        return f"{s // 60}m"
    if s < 48 * 3600:
        return f"{s // 3600}h"
    return f"{s // 86400}d"


def _col(name: str, typ: str = "string", priority: int = 0) -> dict[str, Any]:
    return {"name": name, "type": typ, "format": "", "description": name, "priority": priority}


def _pod_row(o: dict[str, Any]) -> list[Any]:
    spec, status, m = o.get("spec") or {}, o.get("status") or {}, o.get("metadata") or {}
    cstat = status.get("containerStatuses") or []
    ready = sum(1 for c in cstat if c.get("ready"))
    total = len(spec.get("containers") or []) or len(cstat)
    phase = status.get("reason") or status.get("phase") or "Unknown"
    if m.get("deletionTimestamp"):
        phase = "Terminating"
    restarts = sum(int(c.get("restartCount") or 0) for c in cstat)
    return [
        m.get("name"),
        f"{ready}/{total}",
        phase,
        restarts,
        human_age(m.get("creationTimestamp")),
        status.get("podIP") or "<none>",
        spec.get("nodeName") or "<none>",
    ]


def _node_row(o: dict[str, Any]) -> list[Any]:
    m, status = o.get("metadata") or {}, o.get("status") or {}
    ready = next((c for c in status.get("conditions") or [] if c.get("type") == "Ready"), None)
    state = "Ready" if ready and ready.get("status") == "True" else "NotReady"
    if (o.get("spec") or {}).get("unschedulable"):
        state += ",SchedulingDisabled"
    version = (status.get("nodeInfo") or {}).get("kubeletVersion") or ""
    return [m.get("name"), state, "<none>", human_age(m.get("creationTimestamp")), version]


def _event_row(o: dict[str, Any]) -> list[Any]:
    inv = o.get("involvedObject") or {}
    last = o.get("lastTimestamp") or o.get("eventTime") or (o.get("metadata") or {}).get("creationTimestamp")
    return [
        human_age(last),
        o.get("type", ""),
        o.get("reason", ""),
        f"{str(inv.get('kind', '')).lower()}/{inv.get('name', '')}",
        o.get("message", ""),
    ]


def _columns_and_rows(rt: ResourceType, items: list[dict[str, Any]]) -> tuple[list[Any], list[list[Any]]]:
    if rt.kind == "Pod" and not rt.group:
        cols = [
            _NAME_COL,
            _col("Ready"),
            _col("Status"),
            _col("Restarts", "integer"),
            _col("Age"),
            _col("IP", priority=1),
            _col("Node", priority=1),
        ]
        return cols, [_pod_row(o) for o in items]
    if rt.kind == "Node" and not rt.group:
        return (
            [_NAME_COL, _col("Status"), _col("Roles"), _col("Age"), _col("Version")],
            [_node_row(o) for o in items],
        )
    if rt.kind == "Event" and not rt.group:
        return (
            [_col("Last Seen"), _col("Type"), _col("Reason"), _col("Object"), _col("Message")],
            [_event_row(o) for o in items],
        )
    if rt.kind == "Namespace":
        return (
            [_NAME_COL, _col("Status"), _col("Age")],
            [
                [
                    o["metadata"]["name"],
                    (o.get("status") or {}).get("phase", ""),
                    human_age(o["metadata"].get("creationTimestamp")),
                ]
                for o in items
            ],
        )
    if rt.kind == "Lease":
        return (
            [_NAME_COL, _col("Holder"), _col("Age")],
            [
                [
                    o["metadata"]["name"],
                    (o.get("spec") or {}).get("holderIdentity") or "",
                    human_age(o["metadata"].get("creationTimestamp")),
                ]
                for o in items
            ],
        )
    if rt.printer_columns:
        cols = [_NAME_COL]
        for pc in rt.printer_columns:
            cols.append(_col(pc["name"], pc.get("type", "string"), int(pc.get("priority", 0))))
        rows = []
        for o in items:
            row: list[Any] = [o["metadata"]["name"]]
            for pc in rt.printer_columns:
                path = str(pc.get("jsonPath", "")).lstrip(".")
                val = field_value(o, path)
                if pc.get("type") == "date":
                    row.append(human_age(val) if val else "<unknown>")
                elif pc.get("type") == "integer" and val:
                    row.append(int(val) if val.lstrip("-").isdigit() else val)
                else:
                    row.append(val if val != "" else None)
            rows.append(row)
        return cols, rows
    return (
        [_NAME_COL, _col("Age")],
        [[o["metadata"]["name"], human_age(o["metadata"].get("creationTimestamp"))] for o in items],
    )


def table(
    rt: ResourceType, items: list[dict[str, Any]], rv: str, _store: object = None, with_columns: bool = True
) -> dict[str, Any]:
    """A Table for ``items``; rows embed the full object (kubectl reads metadata from it)."""
    cols, rows = _columns_and_rows(rt, items)
    return {
        "kind": "Table",
        "apiVersion": "meta.k8s.io/v1",
        "metadata": {"resourceVersion": rv},
        "columnDefinitions": cols if with_columns else [],
        "rows": [{"cells": cells, "object": obj} for cells, obj in zip(rows, items, strict=True)],
    }
