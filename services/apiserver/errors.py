"""Kubernetes ``Status`` error bodies.

Clients (kubernetes-asyncio, kubectl, client-go) decide retry/conflict behaviour from the
``reason`` and ``code`` of a ``Status`` object, so every failure the development server returns
goes through :class:`ApiError` and is rendered in exactly that shape.
"""

from __future__ import annotations

from typing import Any

_REASONS: dict[int, str] = {
    400: "BadRequest",
    404: "NotFound",
    405: "MethodNotAllowed",
    406: "NotAcceptable",
    409: "Conflict",
    410: "Gone",
    415: "UnsupportedMediaType",
    422: "Invalid",
    429: "TooManyRequests",
    500: "InternalError",
    503: "ServiceUnavailable",
}


class ApiError(Exception):
    """A request failure that is answered with a Kubernetes ``Status`` body."""

    def __init__(
        self,
        code: int,
        message: str,
        reason: str | None = None,
        *,
        name: str | None = None,
        kind: str | None = None,
        group: str | None = None,
        uid: str | None = None,
        retry_after_s: int | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.reason = reason or _REASONS.get(code, "Unknown")
        self.name = name
        self.kind = kind
        self.group = group
        self.uid = uid
        self.retry_after_s = retry_after_s

    def status(self) -> dict[str, Any]:
        """Render as a ``v1.Status`` object (also used inside watch ERROR events)."""
        details: dict[str, Any] = {}
        if self.name is not None:
            details["name"] = self.name
        if self.group:
            details["group"] = self.group
        if self.kind is not None:
            details["kind"] = self.kind
        if self.uid is not None:
            details["uid"] = self.uid
        if self.retry_after_s is not None:
            details["retryAfterSeconds"] = self.retry_after_s
        body: dict[str, Any] = {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code,
        }
        if details:
            body["details"] = details
        return body


def not_found(kind_plural: str, name: str, group: str = "") -> ApiError:
    """The exact NotFound wording of the real server (``pods "x" not found``)."""
    resource = f"{kind_plural}.{group}" if group else kind_plural
    return ApiError(
        404, f'{resource} "{name}" not found', "NotFound", name=name, kind=kind_plural, group=group
    )


def already_exists(kind_plural: str, name: str, group: str = "") -> ApiError:
    """409 AlreadyExists, as returned for a create of an existing name."""
    resource = f"{kind_plural}.{group}" if group else kind_plural
    return ApiError(
        409, f'{resource} "{name}" already exists', "AlreadyExists", name=name, kind=kind_plural, group=group
    )


def conflict(kind_plural: str, name: str, detail: str, group: str = "", uid: str | None = None) -> ApiError:
    """409 Conflict with the real server's "Operation cannot be fulfilled" prefix."""
    resource = f"{kind_plural}.{group}" if group else kind_plural
    return ApiError(
        409,
        f'Operation cannot be fulfilled on {resource} "{name}": {detail}',
        "Conflict",
        name=name,
        kind=kind_plural,
        group=group,
        uid=uid,
    )


STALE_DETAIL = "the object has been modified; please apply your changes to the latest version and try again"
