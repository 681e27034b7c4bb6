"""Pods and VirtualMachine objects → validated :class:`shared.fence.schema.Spec` and observations.

Pure functions over the Kubernetes JSON form of an object (camelCase dicts, as the API server sends
them). Invalid user input never raises: it yields a best-effort ``Spec`` (defaults where a field was
rejected) plus a message naming each rejected field and the values it accepts, e.g.
``vmfence.io/cpus: "lots" is not an integer between 1 and 64``. The reconciler turns that message
into a Warning Event and a ``vmfence.io/SpecValid=False`` condition.

Which pods are vmfence's ("ours"):

- ``spec.nodeName`` starts with ``vmfence-`` (the pod was bound to one of our virtual Nodes), or
- the pod carries the label ``vmfence.io/managed=true``.

Everything else is ignored (``pod_observation`` returns ``None``).

Memory accepts ``<n>`` (MiB), ``<n>Ki`` (a whole number of MiB), ``<n>Mi``, ``<n>Gi`` or ``<n>Ti``,
between 16 MiB and 1 TiB. A bare number means MiB for annotations *and* for VirtualMachine objects.

Pod sizing (in this order; the first that says something wins):

1. the annotations ``vmfence.io/cpus`` / ``vmfence.io/memory`` (each on its own);
2. the containers' ``resources`` as Kubernetes quantities (``500m``, ``2``, ``256Mi``, ``1G``, ``1.5Gi``,
   ``1e3``): per container its **limit** if set, else its request (a VM cannot burst past its
   configured size, so the most the workload may use is what it gets; Kubernetes' scheduler fits
   the requests, which are at most the limits). The pod's size is the sum over ``containers``, or
   the largest ``initContainers`` entry if that is larger (init containers run one at a time, as
   Kubernetes counts them). A pod-level ``spec.resources`` (limits, else requests) wins over the
   containers'. CPUs are rounded up to whole vCPUs (``500m`` → 1), memory up to whole MiB;
3. Spec's defaults (1 CPU, 128 MiB).

A quantity is parsed hostile-safe: at most 18 integer and 9 fraction digits and a two-digit
exponent, so no value makes ``int()`` or a Fraction huge; a size outside 1..64 CPUs or
16 MiB..1 TiB is an invalid spec, never a clamp.

Scheduling: ``spec.nodeName`` is recorded as ``Spec.node`` (``decide`` places the VM on that host
or nowhere). A pod bound to a node that is not ``vmfence-*`` belongs to that node's kubelet and is
not vmfence's, whatever its labels say.

Probes: ``readinessProbe`` / ``livenessProbe`` of the first container that has one (the pod is one
VM), ``tcpSocket`` or ``httpGet`` with a numeric port or a named port of that container, and the
timing fields with Kubernetes' defaults. ``exec`` and ``grpc`` probes are not carried out:
``Spec.unsupported`` says so, and the reconciler turns it into a Warning Event.
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Any, Final, cast

from shared.fence.keys import Key
from shared.fence.schema import Observed, Probe, RecreatePolicy, RestartPolicy, Spec

PREFIX: Final = "vmfence.io/"
ANN_IMAGE: Final = "vmfence.io/image"
ANN_CPUS: Final = "vmfence.io/cpus"
ANN_MEMORY: Final = "vmfence.io/memory"
ANN_HIBERNATE: Final = "vmfence.io/hibernate"
ANN_ON_RECREATE: Final = "vmfence.io/on-recreate"
ANN_PROBE_PORT: Final = "vmfence.io/probe-port"
LABEL_MANAGED: Final = "vmfence.io/managed"
NODE_PREFIX: Final = "vmfence-"

VM_GROUP: Final = "vmfence.io"
VM_VERSION: Final = "v1alpha1"
VM_PLURAL: Final = "virtualmachines"

CPUS_MIN: Final = 1
CPUS_MAX: Final = 64
MEMORY_MIN_MIB: Final = 16
MEMORY_MAX_MIB: Final = 1024 * 1024
PORT_MIN: Final = 1
PORT_MAX: Final = 65535
RESTART_POLICIES: Final[tuple[RestartPolicy, ...]] = ("Always", "OnFailure", "Never")
RECREATE_POLICIES: Final[tuple[RecreatePolicy, ...]] = ("replace", "adopt")

# At most 18 digits: every bound here is far below 10**18, and Python's int() refuses strings of
# more than 4300 digits with a ValueError that is not a SpecError (one such annotation stopped the
# watcher for everyone). A longer number is simply out of range.
_INT = re.compile(r"^[0-9]{1,18}$")
_MEMORY = re.compile(r"^([0-9]{1,18})(Ki|Mi|Gi|Ti)?$")
_MEMORY_FACTOR_KIB: Final = {"Ki": 1, "Mi": 1024, "Gi": 1024**2, "Ti": 1024**3}

MEMORY_ACCEPTED: Final = (
    f"a size like 512Mi, 1Gi or 256 (MiB) between {MEMORY_MIN_MIB}Mi and {MEMORY_MAX_MIB // 1024**2}Ti"
)

JSON = dict[str, Any]


class SpecError(ValueError):
    """One rejected field; ``str()`` is the user-facing message."""


QUOTE_MAX_CHARS: Final = 64  # a message shows at most this much of a rejected value


def _q(value: object) -> str:
    """Quote a value for a message the way the user wrote it (a long one cut, with its length, so a
    hostile annotation cannot make every message, condition and log entry about it huge)."""
    if isinstance(value, str):
        shown = value if len(value) <= QUOTE_MAX_CHARS else value[:QUOTE_MAX_CHARS]
        quoted = '"' + shown.replace("\\", "\\\\").replace('"', '\\"') + '"'
        return quoted if shown is value else f"{quoted}... ({len(value)} characters)"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int) and value.bit_length() > 60:  # repr() of > 4300 digits raises
        return f"an integer of {value.bit_length()} bits"
    text = repr(value)
    return text if len(text) <= QUOTE_MAX_CHARS else f"{text[:QUOTE_MAX_CHARS]}... ({len(text)} characters)"


def _dict(value: object) -> JSON:
    return cast(JSON, value) if isinstance(value, dict) else {}


# ---------------------------------------------------------------------------------- field parsers


def parse_int(field: str, value: object, lo: int, hi: int) -> int:
    """An integer in [lo, hi], given as an int or a string of digits."""
    if isinstance(value, int) and not isinstance(value, bool):
        n = value
    elif isinstance(value, str) and _INT.fullmatch(value.strip()):
        n = int(value.strip())
    else:
        raise SpecError(f"{field}: {_q(value)} is not an integer between {lo} and {hi}")
    if not lo <= n <= hi:
        raise SpecError(f"{field}: {_q(value)} is not an integer between {lo} and {hi}")
    return n


def parse_memory(field: str, value: object) -> int:
    """Memory in MiB from ``<n>`` (MiB), ``<n>Ki``/``Mi``/``Gi``/``Ti`` (or a JSON integer, MiB)."""
    if isinstance(value, int) and not isinstance(value, bool):
        mib = value
    elif isinstance(value, str) and (m := _MEMORY.fullmatch(value.strip())):
        n, unit = int(m.group(1)), m.group(2) or "Mi"
        kib = n * _MEMORY_FACTOR_KIB[unit]
        if kib % 1024:
            raise SpecError(f"{field}: {_q(value)} is not a whole number of MiB; expected {MEMORY_ACCEPTED}")
        mib = kib // 1024
    else:
        raise SpecError(f"{field}: {_q(value)} is not {MEMORY_ACCEPTED}")
    if not MEMORY_MIN_MIB <= mib <= MEMORY_MAX_MIB:
        raise SpecError(f"{field}: {_q(value)} is out of range; expected {MEMORY_ACCEPTED}")
    return mib


def parse_bool(field: str, value: object) -> bool:
    """``true`` or ``false`` (case-insensitive), or a JSON boolean."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    raise SpecError(f"{field}: {_q(value)} is not one of true, false")


IMAGE_NAME_MAX_CHARS: Final = 1024


def image_name_problem(name: str) -> str | None:
    """Why ``name`` cannot name an image inside an image store (None: its shape is fine). Only the
    shape: the agent resolves the name against its store, symlinks included (the real guard)."""
    if "\0" in name:
        return "contains a NUL byte"
    if len(name) > IMAGE_NAME_MAX_CHARS:
        return f"is longer than {IMAGE_NAME_MAX_CHARS} characters"
    if name.startswith("/"):
        return "is an absolute path (an image is a name inside the agent's image store)"
    if ".." in name.split("/"):
        return "leaves the image store (a '..' component)"
    return None


def parse_image(field: str, value: object) -> str:
    """A non-empty image name without whitespace, inside the image store (see image_name_problem)."""
    if not isinstance(value, str) or not value.strip() or any(c.isspace() for c in value.strip()):
        raise SpecError(f"{field}: {_q(value)} is not an image reference (a non-empty string without spaces)")
    problem = image_name_problem(value.strip())
    if problem is not None:
        shown = _q(value.strip().replace("\0", "\\x00"))  # a NUL never reaches a message
        raise SpecError(f"{field}: {shown} {problem}")
    return value.strip()


def parse_restart_policy(field: str, value: object) -> RestartPolicy:
    if isinstance(value, str) and value in RESTART_POLICIES:
        return value
    raise SpecError(f"{field}: {_q(value)} is not one of {', '.join(RESTART_POLICIES)}")


def parse_recreate_policy(field: str, value: object) -> RecreatePolicy:
    if isinstance(value, str) and value.strip() in RECREATE_POLICIES:
        return cast(RecreatePolicy, value.strip())
    raise SpecError(f"{field}: {_q(value)} is not one of {', '.join(RECREATE_POLICIES)}")


# ---------------------------------------------------------------------- Kubernetes quantities

# <digits>[.<digits>][suffix | e<exp>]: at most 18 integer digits, 9 fraction digits, a two-digit
# exponent (as the digit caps above: nothing a hostile pod writes makes a number big to compute)
_SUFFIXES = "Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E"
_QUANTITY = re.compile(rf"^\+?([0-9]{{1,18}})(?:\.([0-9]{{0,9}}))?(?:({_SUFFIXES})|[eE]([+-]?[0-9]{{1,2}}))?$")
_QUANTITY_FRACTIONAL = re.compile(rf"^\+?\.([0-9]{{1,9}})({_SUFFIXES})?$")
_SUFFIX: Final[dict[str, Fraction]] = {
    "": Fraction(1),
    "Ki": Fraction(2**10), "Mi": Fraction(2**20), "Gi": Fraction(2**30),
    "Ti": Fraction(2**40), "Pi": Fraction(2**50), "Ei": Fraction(2**60),
    "n": Fraction(1, 10**9), "u": Fraction(1, 10**6), "m": Fraction(1, 10**3),
    "k": Fraction(10**3), "M": Fraction(10**6), "G": Fraction(10**9),
    "T": Fraction(10**12), "P": Fraction(10**15), "E": Fraction(10**18),
}
QUANTITY_ACCEPTED: Final = "a Kubernetes quantity such as 500m, 2, 256Mi, 1G or 1.5Gi"


def parse_quantity(field: str, value: object) -> Fraction:
    """A non-negative Kubernetes quantity (``resource.Quantity``'s forms) as an exact fraction."""
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 10**18:
        return Fraction(value)
    if isinstance(value, float) and 0 <= value < 1e18:
        value = repr(value)  # a YAML number the development server kept (a real one stores the string)
    text = value.strip() if isinstance(value, str) else None
    if text is not None and (m := _QUANTITY.fullmatch(text)):
        whole, frac, suffix, exp = m.group(1), m.group(2) or "", m.group(3) or "", m.group(4)
    elif text is not None and (m := _QUANTITY_FRACTIONAL.fullmatch(text)):
        whole, frac, suffix, exp = "0", m.group(1), m.group(2) or "", None
    else:
        raise SpecError(f"{field}: {_q(value)} is not {QUANTITY_ACCEPTED}")
    n = Fraction(int(whole)) + (Fraction(int(frac), 10 ** len(frac)) if frac else 0)
    return n * (Fraction(10) ** int(exp) if exp is not None else _SUFFIX[suffix])


def _ceil(q: Fraction) -> int:
    return -(-q.numerator // q.denominator)


_CPU_UNIT, _MIB = Fraction(1), Fraction(2**20)


def _container_size(where: str, res: JSON, resource: str, errors: list[str]) -> Fraction | None:
    """One container's (or the pod's) size of ``resource``: its limit if set, else its request."""
    for part in ("limits", "requests"):
        values = _dict(res.get(part))
        if resource in values:
            try:
                return parse_quantity(f"{where}.resources.{part}.{resource}", values[resource])
            except SpecError as exc:
                errors.append(str(exc))
                return None
    return None


def _pod_size(spec: JSON, resource: str, errors: list[str]) -> Fraction | None:
    """The pod's size of ``resource`` from its containers' resources (see the module docstring),
    or None when no container names it."""
    pod_level = _container_size("spec", _dict(spec.get("resources")), resource, errors)
    if pod_level is not None:
        return pod_level
    def sizes(kind: str) -> list[Fraction]:
        out: list[Fraction] = []
        items = spec.get(kind)
        for i, c in enumerate(items if isinstance(items, list) else []):
            c = _dict(c)
            name = c.get("name") if isinstance(c.get("name"), str) else str(i)
            got = _container_size(f"spec.{kind}[{str(name)[:QUOTE_MAX_CHARS]}]", _dict(c.get("resources")),
                                  resource, errors)
            if got is not None:
                out.append(got)
        return out
    main, init = sizes("containers"), sizes("initContainers")
    if not main and not init:
        return None
    return max(sum(main, Fraction(0)), max(init, default=Fraction(0)))


def _cpus_of(spec: JSON, errors: list[str]) -> int | None:
    q = _pod_size(spec, "cpu", errors)
    if q is None:
        return None
    cpus = max(1, _ceil(q / _CPU_UNIT))
    if cpus > CPUS_MAX:
        errors.append(f"resources: the containers ask for {_q(float(q))} CPUs; a VM has between {CPUS_MIN} "
                      f"and {CPUS_MAX}")
        return None
    return cpus


def _memory_of(spec: JSON, errors: list[str]) -> int | None:
    q = _pod_size(spec, "memory", errors)
    if q is None:
        return None
    mib = _ceil(q / _MIB)
    if not MEMORY_MIN_MIB <= mib <= MEMORY_MAX_MIB:
        errors.append(f"resources: the containers ask for {mib} MiB of memory; a VM has between "
                      f"{MEMORY_MIN_MIB}Mi and {MEMORY_MAX_MIB // 1024**2}Ti")
        return None
    return mib


# ----------------------------------------------------------------------------------- probes

PROBE_SECONDS_MAX: Final = 86400
_PORT_NAME = re.compile(r"^[a-z0-9]([a-z0-9-]{0,13}[a-z0-9])?$")  # an IANA_SVC_NAME, as Kubernetes'
_PATH_MAX: Final = 2048


def _probe_port(field: str, value: object, container: JSON) -> int:
    if isinstance(value, str) and not _INT.fullmatch(value.strip()):
        name = value.strip()
        if _PORT_NAME.fullmatch(name):
            ports = container.get("ports")
            for p in ports if isinstance(ports, list) else []:
                p = _dict(p)
                if p.get("name") == name:
                    return parse_int(f"{field} ({name})", p.get("containerPort"), PORT_MIN, PORT_MAX)
        raise SpecError(f"{field}: {_q(value)} names no port of the container (and is not a number "
                        f"between {PORT_MIN} and {PORT_MAX})")
    return parse_int(field, value, PORT_MIN, PORT_MAX)


def _probe_of(field: str, raw: JSON, container: JSON, *, liveness: bool) -> Probe:
    """One probe; SpecError for a bad field, ``_Unsupported`` for exec/grpc."""
    timing: dict[str, int] = {}
    for name, attr, lo, default in (
        ("initialDelaySeconds", "initial_delay_s", 0, 0),
        ("periodSeconds", "period_s", 1, 10),
        ("timeoutSeconds", "timeout_s", 1, 1),
        ("successThreshold", "success_threshold", 1, 1),
        ("failureThreshold", "failure_threshold", 1, 3),
    ):
        v = raw.get(name)
        timing[attr] = default if v is None else parse_int(f"{field}.{name}", v, lo, PROBE_SECONDS_MAX)
    if liveness and timing["success_threshold"] != 1:
        raise SpecError(f"{field}.successThreshold: must be 1 for a liveness probe (as Kubernetes requires)")
    tcp, http = raw.get("tcpSocket"), raw.get("httpGet")
    if isinstance(tcp, dict):
        return Probe("tcp", _probe_port(f"{field}.tcpSocket.port", tcp.get("port"), container), **timing)  # type: ignore[arg-type]
    if isinstance(http, dict):
        port = _probe_port(f"{field}.httpGet.port", http.get("port"), container)
        path = http.get("path") if http.get("path") is not None else "/"
        if not isinstance(path, str) or not path.startswith("/") or len(path) > _PATH_MAX \
                or any(ch.isspace() or not ch.isprintable() for ch in path):
            raise SpecError(f"{field}.httpGet.path: {_q(path)} is not an absolute URL path without spaces")
        scheme = http.get("scheme") if http.get("scheme") is not None else "HTTP"
        if scheme not in ("HTTP", "HTTPS"):
            raise SpecError(f"{field}.httpGet.scheme: {_q(scheme)} is not one of HTTP, HTTPS")
        return Probe("http", port, path=path, scheme=scheme, **timing)  # type: ignore[arg-type]
    kinds = [k for k in ("exec", "grpc") if raw.get(k) is not None]
    if kinds:
        raise _Unsupported(f"{field}: {kinds[0]} probes are not supported by vmfence (the pod is a VM: use "
                           f"tcpSocket or httpGet against the guest); the probe is ignored")
    raise SpecError(f"{field}: names none of tcpSocket, httpGet")


class _Unsupported(Exception):
    """A probe vmfence reads but does not carry out (not an invalid spec: a Warning)."""


def _probes(spec: JSON, c: _Collector) -> list[str]:
    """readinessProbe/livenessProbe of the first container that has each; the unsupported notes."""
    notes: list[str] = []
    items = spec.get("containers")
    containers = [_dict(x) for x in (items if isinstance(items, list) else [])]
    for kind, attr in (("readinessProbe", "readiness"), ("livenessProbe", "liveness")):
        for i, container in enumerate(containers):
            raw = container.get(kind)
            if raw is None:
                continue
            name = container.get("name") if isinstance(container.get("name"), str) else str(i)
            field = f"spec.containers[{str(name)[:QUOTE_MAX_CHARS]}].{kind}"
            if not isinstance(raw, dict):
                c.errors.append(f"{field}: {_q(raw)} is not a probe")
                break
            try:
                c.fields[attr] = _probe_of(field, raw, container, liveness=attr == "liveness")
            except SpecError as exc:
                c.errors.append(str(exc))
            except _Unsupported as exc:
                notes.append(str(exc))
            break
    return notes


# ----------------------------------------------------------------------------------------- specs


class _Collector:
    """Gathers accepted fields and error messages; never raises."""

    def __init__(self) -> None:
        self.fields: dict[str, Any] = {}
        self.errors: list[str] = []

    def take(self, name: str, parse: Any, *args: Any) -> None:
        try:
            self.fields[name] = parse(*args)
        except SpecError as exc:
            self.errors.append(str(exc))

    def result(self) -> tuple[Spec, str | None]:
        return Spec(**self.fields), ("; ".join(self.errors) if self.errors else None)


def spec_of_pod(pod: JSON) -> tuple[Spec, str | None]:
    """Spec from the pod's vmfence.io annotations and ``spec.restartPolicy``.

    Absent annotations take Spec's defaults; ``image`` stays ``None`` when not annotated (the
    runtime picks its default image). Returns ``(spec, invalid)`` with ``invalid`` naming every
    rejected field, or ``None``.
    """
    ann = _dict(_dict(pod.get("metadata")).get("annotations"))
    spec = _dict(pod.get("spec"))
    c = _Collector()
    if ANN_IMAGE in ann:
        c.take("image", parse_image, ANN_IMAGE, ann[ANN_IMAGE])
    if ANN_CPUS in ann:
        c.take("cpus", parse_int, ANN_CPUS, ann[ANN_CPUS], CPUS_MIN, CPUS_MAX)
    if ANN_MEMORY in ann:
        c.take("memory_mib", parse_memory, ANN_MEMORY, ann[ANN_MEMORY])
    if ANN_HIBERNATE in ann:
        c.take("hibernate", parse_bool, ANN_HIBERNATE, ann[ANN_HIBERNATE])
    if ANN_ON_RECREATE in ann:
        c.take("on_recreate", parse_recreate_policy, ANN_ON_RECREATE, ann[ANN_ON_RECREATE])
    if ANN_PROBE_PORT in ann:
        c.take("probe_port", parse_int, ANN_PROBE_PORT, ann[ANN_PROBE_PORT], PORT_MIN, PORT_MAX)
    if spec.get("restartPolicy") is not None:
        c.take("restart_policy", parse_restart_policy, "spec.restartPolicy", spec["restartPolicy"])
    if ANN_CPUS not in ann and (cpus := _cpus_of(spec, c.errors)) is not None:
        c.fields["cpus"] = cpus
    if ANN_MEMORY not in ann and (mib := _memory_of(spec, c.errors)) is not None:
        c.fields["memory_mib"] = mib
    notes = _probes(spec, c)
    if notes:
        c.fields["unsupported"] = "; ".join(notes)
    node = spec.get("nodeName")
    if isinstance(node, str) and node:
        c.fields["node"] = node[:253]  # a DNS subdomain at most: a longer one is not a node of ours anyway
    return c.result()


def spec_of_vm(obj: JSON) -> tuple[Spec, str | None]:
    """Spec from a VirtualMachine's ``spec`` (cpus, memory, image, restartPolicy, hibernated,
    hostSelector). Without ``image`` the VM runs firmware-only, as a pod without the image
    annotation does; an empty hostSelector means any host."""
    spec = _dict(obj.get("spec"))
    c = _Collector()
    if spec.get("image") is not None:
        c.take("image", parse_image, "spec.image", spec["image"])
    if spec.get("cpus") is not None:
        c.take("cpus", parse_int, "spec.cpus", spec["cpus"], CPUS_MIN, CPUS_MAX)
    if spec.get("memory") is not None:
        c.take("memory_mib", parse_memory, "spec.memory", spec["memory"])
    if spec.get("restartPolicy") is not None:
        c.take("restart_policy", parse_restart_policy, "spec.restartPolicy", spec["restartPolicy"])
    if spec.get("hibernated") is not None:
        c.take("hibernate", parse_bool, "spec.hibernated", spec["hibernated"])
    sel = spec.get("hostSelector")
    if sel not in (None, ""):
        if isinstance(sel, str) and sel.strip() and not any(ch.isspace() for ch in sel.strip()):
            c.fields["host_selector"] = sel.strip()
        else:
            c.errors.append(f"spec.hostSelector: {_q(sel)} is not a host name (a string without spaces)")
    return c.result()


# ------------------------------------------------------------------------------ keys, ownership


def _meta(obj: JSON) -> JSON:
    return _dict(obj.get("metadata"))


def key_of_pod(pod: JSON) -> Key:
    m = _meta(pod)
    return Key("pod", str(m.get("namespace") or "default"), str(m["name"]))


def key_of_vm(obj: JSON) -> Key:
    m = _meta(obj)
    return Key("vm", str(m.get("namespace") or "default"), str(m["name"]))


def is_ours(pod: JSON) -> bool:
    """nodeName ``vmfence-*``, or label ``vmfence.io/managed=true`` on a pod not bound to another
    node (a pod bound to a node that is not ``vmfence-*`` is that node's kubelet's)."""
    node = _dict(pod.get("spec")).get("nodeName")
    if isinstance(node, str) and node.startswith(NODE_PREFIX):
        return True
    if isinstance(node, str) and node:
        return False
    labels = _dict(_meta(pod).get("labels"))
    return str(labels.get(LABEL_MANAGED, "")).lower() == "true"


def resource_version(obj: JSON) -> int:
    """metadata.resourceVersion as an int (0 when absent or not numeric)."""
    rv = _meta(obj).get("resourceVersion")
    try:
        return int(str(rv))
    except ValueError:
        return 0


def uid_of(obj: JSON) -> str:
    return str(_meta(obj).get("uid") or "")


def deleting(obj: JSON) -> bool:
    return bool(_meta(obj).get("deletionTimestamp"))


def pod_observation(pod: JSON, *, gone: bool = False) -> Observed | None:
    """The Observed input for a pod, or None for pods that are not vmfence's."""
    if not is_ours(pod):
        return None
    spec, invalid = spec_of_pod(pod)
    node = _dict(pod.get("spec")).get("nodeName")
    return Observed(
        key=str(key_of_pod(pod)),
        uid=uid_of(pod),
        resource_version=resource_version(pod),
        deleting=deleting(pod),
        gone=gone,
        spec=spec,
        invalid=invalid,
        node=node if isinstance(node, str) and node else None,
    )


def vm_observation(obj: JSON, *, gone: bool = False) -> Observed:
    """The Observed input for a VirtualMachine object (every one is vmfence's)."""
    spec, invalid = spec_of_vm(obj)
    return Observed(
        key=str(key_of_vm(obj)),
        uid=uid_of(obj),
        resource_version=resource_version(obj),
        deleting=deleting(obj),
        gone=gone,
        spec=spec,
        invalid=invalid,
    )
