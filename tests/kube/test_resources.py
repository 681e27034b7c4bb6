"""Pod sizing from the containers' resources and probes from the pod spec (shared.fence.podspec),
hostile-safe: Kubernetes quantities, limits over requests, init containers as Kubernetes counts
them, annotations still override; a bad value names its field."""

from __future__ import annotations

from typing import Any

import pytest

from shared.fence.decide import decide
from shared.fence.podspec import parse_quantity, spec_of_pod
from shared.fence.schema import ConfirmedRead, ConfirmRequested, Observed, Probe, WriteRequested
from shared.fence.state import KeyState, fold_all


def pod(containers: list[dict[str, Any]], init: list[dict[str, Any]] | None = None,
        annotations: dict[str, str] | None = None, **spec: Any) -> dict[str, Any]:
    return {"metadata": {"name": "p", "annotations": annotations or {}},
            "spec": {"containers": containers, **({"initContainers": init} if init else {}), **spec}}


def c(name: str, limits: dict[str, Any] | None = None, requests: dict[str, Any] | None = None,
      **extra: Any) -> dict[str, Any]:
    res: dict[str, Any] = {}
    if limits is not None:
        res["limits"] = limits
    if requests is not None:
        res["requests"] = requests
    return {"name": name, "image": "vm", "resources": res, **extra}


@pytest.mark.parametrize(("text", "value"), [
    ("500m", 0.5), ("2", 2), ("256Mi", 256 * 2**20), ("1G", 10**9), ("1.5Gi", 1.5 * 2**30), ("1e3", 1000),
    (".5", 0.5), ("100k", 100_000), ("0", 0), (3, 3), (1.5, 1.5),
])
def test_quantities(text: Any, value: float) -> None:
    assert float(parse_quantity("f", text)) == value


@pytest.mark.parametrize("text", ["-1", "1x", "1.2.3", "", "lots", "1" * 19, "1e100", "1." + "0" * 10, True, None, -1.5,
                                  float("nan")])
def test_bad_quantities_are_spec_errors(text: Any) -> None:
    _, invalid = spec_of_pod(pod([c("main", limits={"cpu": text})]))
    assert invalid is not None and "spec.containers[main].resources.limits.cpu" in invalid


def test_limits_over_requests_summed_over_containers_and_init_containers_as_max() -> None:
    spec, invalid = spec_of_pod(pod([
        c("web", limits={"cpu": "1500m", "memory": "1G"}, requests={"cpu": "100m", "memory": "64Mi"}),
        c("side", requests={"cpu": "250m", "memory": "64Mi"}),
    ]))
    assert invalid is None
    assert spec.cpus == 2  # 1.5 + 0.25 -> 2 vCPUs
    assert spec.memory_mib == 954 + 64  # 1G is 953.67 MiB -> 954, plus 64Mi
    spec, _ = spec_of_pod(pod([c("web", requests={"memory": "256Mi"})], init=[c("i", limits={"memory": "2Gi"})]))
    assert spec.memory_mib == 2048, "an init container larger than the sum sizes the pod"
    spec, _ = spec_of_pod(pod([c("web", requests={"cpu": "2"})], resources={"limits": {"cpu": "4"}}))
    assert spec.cpus == 4, "a pod-level resources stanza wins"


def test_annotations_override_and_defaults_stay() -> None:
    spec, _ = spec_of_pod(pod([c("web", limits={"cpu": "8", "memory": "8Gi"})],
                              annotations={"vmfence.io/cpus": "2"}))
    assert (spec.cpus, spec.memory_mib) == (2, 8192)
    spec, invalid = spec_of_pod(pod([c("web")]))
    assert (spec.cpus, spec.memory_mib, invalid) == (1, 128, None)


def test_a_size_outside_what_a_vm_can_have_is_invalid_never_clamped() -> None:
    _, invalid = spec_of_pod(pod([c("web", limits={"cpu": "65"})]))
    assert invalid is not None and "between 1 and 64" in invalid
    _, invalid = spec_of_pod(pod([c("web", limits={"memory": "8Mi"})]))
    assert invalid is not None and "8 MiB" in invalid


def test_probes_with_named_ports_timing_and_defaults() -> None:
    spec, invalid = spec_of_pod(pod([c("web", ports=[{"name": "http", "containerPort": 8080}],
                                       readinessProbe={"httpGet": {"port": "http", "path": "/ready"},
                                                       "initialDelaySeconds": 3, "periodSeconds": 2},
                                       livenessProbe={"tcpSocket": {"port": 22}})]))
    assert invalid is None
    assert spec.readiness == Probe("http", 8080, path="/ready", initial_delay_s=3, period_s=2)
    assert spec.liveness == Probe("tcp", 22)
    _, invalid = spec_of_pod(pod([c("web", readinessProbe={"httpGet": {"port": "nope"}})]))
    assert invalid is not None and "names no port" in invalid
    _, invalid = spec_of_pod(pod([c("web", readinessProbe={"tcpSocket": {"port": 1}, "periodSeconds": 0})]))
    assert invalid is not None and "periodSeconds" in invalid


def test_an_exec_probe_is_admitted_with_a_warning_event() -> None:
    spec, invalid = spec_of_pod(pod([c("web", readinessProbe={"exec": {"command": ["true"]}})],
                                    nodeName="vmfence-host-a"))
    assert invalid is None and spec.unsupported
    s = KeyState(key="default/p")
    out = decide(s, Observed("default/p", "u1", 1, spec=spec))
    fold_all(s, out)
    s.n += 1
    (req,) = [d for d in out if isinstance(d, ConfirmRequested)]
    out = decide(s, ConfirmedRead("default/p", req.request, "u1", 1, spec=spec))
    warnings = [d.write for d in out if isinstance(d, WriteRequested) and d.write.event_reason == "Unsupported"]
    assert len(warnings) == 1 and warnings[0].event_type == "Warning" and "exec" in (warnings[0].message or "")
