"""Pod status writes validated as the real API server validates them (``ValidatePodStatusUpdate``
in k8s.io/kubernetes v1.35 pkg/apis/core/validation/validation.go, plus the typed decoding a JSON
body goes through first), so a status the real server would refuse fails here too — and with it the
test that wrote it. What it checks:

- decoding (a body that does not decode into a v1 Pod: 400 BadRequest for an update, 422 Invalid
  naming the patch for a patch, as the real server answers each): ``status`` an object;
  ``phase``, ``reason``, ``message``, ``podIP``, ``hostIP`` strings; ``conditions`` objects with a
  string ``type`` and ``status``; ``containerStatuses`` objects with a string ``name``, a boolean
  ``ready`` / ``started``, an integer ``restartCount``, a ``state`` (and ``lastState``) object whose
  keys are among waiting/running/terminated, ``terminated.exitCode`` an integer; every timestamp
  (``lastTransitionTime``, ``lastProbeTime``, ``startTime``, ``startedAt``, ``finishedAt``)
  RFC 3339 or null;
- validation (422 Invalid): a condition type that is not one of PodScheduled/Ready/Initialized is a
  qualified name; ``observedGeneration`` is not negative; every ``podIPs``/``hostIPs`` entry
  is a valid IP (legacy forms such as leading zeros are accepted, as the real server does), at
  most one per family; ``hostIP``
  equals ``hostIPs[0].ip``; ``qosClass`` is immutable; with ``restartPolicy`` Never (or OnFailure
  and exit code 0) a terminated container may not go back to a non-terminated state.

The real server does not check that container statuses name the pod's containers (its comment:
"consumers must account for unexpected data"); vmfence writes exactly the spec's containers anyway.
"""

from __future__ import annotations

import ipaddress
import re
from datetime import datetime
from typing import Any

Obj = dict[str, Any]

SYSTEM_CONDITIONS = frozenset({"PodScheduled", "Ready", "Initialized"})
_NAME = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
_DNS1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_STATES = frozenset({"waiting", "running", "terminated"})
_TIMES = ("lastTransitionTime", "lastProbeTime", "startTime", "startedAt", "finishedAt")


class StatusDecodeError(ValueError):
    """A body that would not decode into a v1 Pod (the real server answers 400)."""


def qualified_name_problem(value: str) -> str | None:
    """Why ``value`` is not a Kubernetes qualified name ([prefix/]name), or None."""
    prefix, slash, name = value.rpartition("/")
    if slash and (not prefix or len(prefix) > 253 or not _DNS1123_SUBDOMAIN.fullmatch(prefix)):
        return "prefix part must be a lowercase RFC 1123 subdomain"
    if not name or len(name) > 63 or not _NAME.fullmatch(name):
        return ("name part must consist of alphanumeric characters, '-', '_' or '.', and must start and end "
                "with an alphanumeric character (at most 63 characters)")
    return None


def _typed(cond: bool, path: str, want: str, value: Any) -> None:
    if not cond:
        raise StatusDecodeError(
            f"json: cannot unmarshal {type(value).__name__} into Go struct field {path} of type {want}")


def _time(path: str, value: Any) -> None:
    if value is None:
        return
    _typed(isinstance(value, str), path, "metav1.Time", value)
    try:
        datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        raise StatusDecodeError(f'parsing time "{value[:64]}" as "2006-01-02T15:04:05Z07:00": cannot parse') from None


def _times(path: str, obj: Obj) -> None:
    for t in _TIMES:
        if t in obj:
            _time(f"{path}.{t}", obj[t])


def _decode(status: Any) -> None:
    """The typed decoding of ``status`` (raises StatusDecodeError)."""
    _typed(isinstance(status, dict), "Pod.status", "v1.PodStatus", status)
    for k in ("phase", "reason", "message", "podIP", "hostIP", "qosClass", "nominatedNodeName"):
        if status.get(k) is not None:
            _typed(isinstance(status[k], str), f"PodStatus.{k}", "string", status[k])
    _times("PodStatus", status)
    conds = status.get("conditions")
    if conds is not None:
        _typed(isinstance(conds, list), "PodStatus.conditions", "[]v1.PodCondition", conds)
        for c in conds:
            _typed(isinstance(c, dict), "PodStatus.conditions", "v1.PodCondition", c)
            for k in ("type", "status", "reason", "message"):
                if c.get(k) is not None:
                    _typed(isinstance(c[k], str), f"PodCondition.{k}", "string", c[k])
            if c.get("observedGeneration") is not None:
                _typed(isinstance(c["observedGeneration"], int) and not isinstance(c["observedGeneration"], bool),
                       "PodCondition.observedGeneration", "int64", c["observedGeneration"])
            _times("PodCondition", c)
    for field in ("podIPs", "hostIPs"):
        ips = status.get(field)
        if ips is not None:
            _typed(isinstance(ips, list) and all(isinstance(i, dict) and isinstance(i.get("ip"), str) for i in ips),
                   f"PodStatus.{field}", "[]v1.PodIP", ips)
    for field in ("containerStatuses", "initContainerStatuses", "ephemeralContainerStatuses"):
        items = status.get(field)
        if items is None:
            continue
        _typed(isinstance(items, list), f"PodStatus.{field}", "[]v1.ContainerStatus", items)
        for cs in items:
            _typed(isinstance(cs, dict), f"PodStatus.{field}", "v1.ContainerStatus", cs)
            _typed(isinstance(cs.get("name"), str), "ContainerStatus.name", "string", cs.get("name"))
            for k in ("ready", "started"):
                if cs.get(k) is not None:
                    _typed(isinstance(cs[k], bool), f"ContainerStatus.{k}", "bool", cs[k])
            rc = cs.get("restartCount", 0)
            _typed(isinstance(rc, int) and not isinstance(rc, bool) and -2**31 <= rc < 2**31,
                   "ContainerStatus.restartCount", "int32", rc)
            for k in ("image", "imageID", "containerID"):
                if cs.get(k) is not None:
                    _typed(isinstance(cs[k], str), f"ContainerStatus.{k}", "string", cs[k])
            for k in ("state", "lastState"):
                st = cs.get(k)
                if st is None:
                    continue
                _typed(isinstance(st, dict), f"ContainerStatus.{k}", "v1.ContainerState", st)
                for kind, body in st.items():
                    if kind not in _STATES:
                        continue  # an unknown field: dropped by the decoder, as the real server does
                    _typed(isinstance(body, dict) or body is None, f"ContainerState.{kind}", "v1.ContainerState", body)
                    body = body or {}
                    _times(f"ContainerState{kind.capitalize()}", body)
                    if kind == "terminated" and body.get("exitCode") is not None:
                        ec = body["exitCode"]
                        _typed(isinstance(ec, int) and not isinstance(ec, bool) and -2**31 <= ec < 2**31,
                               "ContainerStateTerminated.exitCode", "int32", ec)


_LEGACY_V4 = re.compile(r"^([0-9]{1,3})\.([0-9]{1,3})\.([0-9]{1,3})\.([0-9]{1,3})$")


def _legacy_ip(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """An IP as Kubernetes' legacy fields parse it (ParseIPSloppy: IPv4 octets with leading zeros
    are accepted, as decimal), or None."""
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        m = _LEGACY_V4.fullmatch(text)
        if m and all(int(o) <= 255 for o in m.groups()):
            return ipaddress.IPv4Address(".".join(str(int(o)) for o in m.groups()))
        return None


def _ips(field: str, new: list[Any], old: list[Any]) -> list[tuple[str, str]]:
    """Every entry a valid IP (the real server accepts non-canonical legacy forms with a warning),
    at most one per family."""
    errors: list[tuple[str, str]] = []
    families = []
    for n, item in enumerate(new):
        text = item["ip"]
        addr = _legacy_ip(text)
        if addr is None:
            errors.append((f"status.{field}[{n}]", f'Invalid value: "{text[:64]}": must be a valid IP address, '
                                                   '(e.g. 10.9.8.7 or 2001:db8::ffff)'))
            continue
        families.append(addr.version)
    if len(new) > 2 or (len(families) == 2 and families[0] == families[1]):
        errors.append((f"status.{field}", "Invalid value: may specify no more than one IP for each IP family"))
    return errors


def _terminated(cs: Obj) -> Obj | None:
    st = cs.get("state") or {}
    t = st.get("terminated") if isinstance(st, dict) else None
    return t if isinstance(t, dict) else None


def validate(new: Obj, old: Obj) -> list[tuple[str, str]]:
    """The field errors of a status update from ``old`` to ``new`` (whole pods); raises
    StatusDecodeError for a body the real server would not decode."""
    status = new.get("status") or {}
    _decode(status)
    prev = old.get("status") or {}
    errors: list[tuple[str, str]] = []
    for i, c in enumerate(status.get("conditions") or []):
        if (c.get("observedGeneration") or 0) < 0:
            errors.append((f"status.conditions[{i}].observedGeneration",
                           "Invalid value: must be a non-negative integer"))
        ctype = c.get("type") or ""
        if ctype in SYSTEM_CONDITIONS:
            continue
        problem = qualified_name_problem(ctype)
        if problem is not None:
            errors.append((f"status.conditions[{i}].Type", f'Invalid value: "{ctype[:64]}": {problem}'))
    if (new.get("spec") or {}).get("nodeName") != (old.get("spec") or {}).get("nodeName"):
        errors.append(("status.nodeName", "Forbidden: may not be changed directly"))
    if prev.get("qosClass") is not None and status.get("qosClass") != prev.get("qosClass"):
        errors.append(("status.qosClass", "Invalid value: field is immutable"))
    errors += _ips("podIPs", status.get("podIPs") or [], prev.get("podIPs") or [])
    host_ips = status.get("hostIPs") or []
    if host_ips and status.get("hostIP") != host_ips[0]["ip"]:
        errors.append(("status.hostIPs[0].ip", "Invalid value: must be equal to `hostIP`"))
    errors += _ips("hostIPs", host_ips, prev.get("hostIPs") or [])
    policy = (old.get("spec") or {}).get("restartPolicy") or "Always"
    if policy != "Always":
        now = {cs.get("name"): cs for cs in status.get("containerStatuses") or []}
        for i, cs in enumerate(prev.get("containerStatuses") or []):
            term = _terminated(cs) if isinstance(cs, dict) else None
            if term is None or (policy == "OnFailure" and (term.get("exitCode") or 0) != 0):
                continue
            later = now.get(cs.get("name"))
            if later is not None and _terminated(later) is None:
                errors.append((f"status.containerStatuses[{i}].state",
                               "Forbidden: may not be transitioned to non-terminated state"))
    return errors
