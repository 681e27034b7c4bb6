"""shared.fence.podspec: annotations and VirtualMachine specs → Spec, with messages naming the field."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shared.fence.keys import Key
from shared.fence.podspec import (
    is_ours,
    key_of_pod,
    key_of_vm,
    pod_observation,
    spec_of_pod,
    spec_of_vm,
    vm_observation,
)
from shared.fence.schema import Spec

NODE = "vmfence-host-a"  # the node pod() binds to: recorded in the spec (decide places the VM there)


def pod(annotations: dict[str, Any] | None = None, **spec: Any) -> dict[str, Any]:
    return {
        "metadata": {
            "name": "web.v1",
            "namespace": "ns1",
            "uid": "u-1",
            "resourceVersion": "42",
            "annotations": annotations or {},
        },
        "spec": {"nodeName": "vmfence-host-a", "containers": [{"name": "main", "image": "busybox"}], **spec},
    }


def test_defaults_without_annotations() -> None:
    assert spec_of_pod(pod()) == (Spec(node=NODE), None)


def test_every_annotation_valid() -> None:
    spec, invalid = spec_of_pod(
        pod(
            {
                "vmfence.io/image": "debian-12",
                "vmfence.io/cpus": "4",
                "vmfence.io/memory": "2Gi",
                "vmfence.io/hibernate": "true",
                "vmfence.io/on-recreate": "adopt",
                "vmfence.io/probe-port": "8080",
            },
            restartPolicy="OnFailure",
        )
    )
    assert invalid is None
    assert spec == Spec(
        node=NODE,
        cpus=4,
        memory_mib=2048,
        image="debian-12",
        restart_policy="OnFailure",
        hibernate=True,
        on_recreate="adopt",
        probe_port=8080,
    )


@pytest.mark.parametrize(
    ("text", "mib"),
    [("512Mi", 512), ("1Gi", 1024), ("256", 256), ("1Ti", 1024 * 1024), ("65536Ki", 64), (" 64Mi ", 64)],
)
def test_memory_forms(text: str, mib: int) -> None:
    spec, invalid = spec_of_pod(pod({"vmfence.io/memory": text}))
    assert invalid is None and spec.memory_mib == mib


@pytest.mark.parametrize(
    ("ann", "value", "words"),
    [
        ("vmfence.io/cpus", "lots", 'vmfence.io/cpus: "lots" is not an integer between 1 and 64'),
        ("vmfence.io/cpus", "0", "between 1 and 64"),
        ("vmfence.io/cpus", "65", "between 1 and 64"),
        ("vmfence.io/cpus", "-1", "between 1 and 64"),
        ("vmfence.io/cpus", "1.5", "between 1 and 64"),
        ("vmfence.io/memory", "lots", "512Mi, 1Gi or 256"),
        ("vmfence.io/memory", "1G", "512Mi, 1Gi or 256"),
        ("vmfence.io/memory", "1000Ki", "whole number of MiB"),
        ("vmfence.io/memory", "8", "out of range"),
        ("vmfence.io/memory", "2Ti", "out of range"),
        ("vmfence.io/hibernate", "yes", 'vmfence.io/hibernate: "yes" is not one of true, false'),
        ("vmfence.io/on-recreate", "keep", 'vmfence.io/on-recreate: "keep" is not one of replace, adopt'),
        ("vmfence.io/probe-port", "0", 'vmfence.io/probe-port: "0" is not an integer between 1 and 65535'),
        ("vmfence.io/probe-port", "70000", "between 1 and 65535"),
        ("vmfence.io/probe-port", "http", "between 1 and 65535"),
        ("vmfence.io/image", "", "vmfence.io/image"),
        ("vmfence.io/image", "a b", "without spaces"),
    ],
)
def test_invalid_annotation_names_field(ann: str, value: str, words: str) -> None:
    spec, invalid = spec_of_pod(pod({ann: value}))
    assert invalid is not None and ann in invalid and words in invalid
    assert spec == Spec(node=NODE)  # the rejected field keeps its default


def test_invalid_restart_policy_and_multiple_errors() -> None:
    spec, invalid = spec_of_pod(pod({"vmfence.io/cpus": "x", "vmfence.io/memory": "1Gi"}, restartPolicy="Sometimes"))
    assert invalid is not None
    assert "vmfence.io/cpus" in invalid and 'spec.restartPolicy: "Sometimes"' in invalid
    assert "Always, OnFailure, Never" in invalid
    assert spec.memory_mib == 1024  # valid fields still apply


def test_hibernate_case_insensitive() -> None:
    assert spec_of_pod(pod({"vmfence.io/hibernate": "False"}))[0].hibernate is False
    assert spec_of_pod(pod({"vmfence.io/hibernate": "TRUE"}))[0].hibernate is True


@given(st.integers(min_value=1, max_value=64))
def test_cpus_in_range_accepted(n: int) -> None:
    assert spec_of_pod(pod({"vmfence.io/cpus": str(n)})) == (Spec(cpus=n, node=NODE), None)


@given(st.text(max_size=12))
def test_cpus_arbitrary_text_never_raises(text: str) -> None:
    spec, invalid = spec_of_pod(pod({"vmfence.io/cpus": text}))
    if invalid is None:
        assert 1 <= spec.cpus <= 64 and text.strip().isdigit()
    else:
        assert invalid.startswith("vmfence.io/cpus: ")


@given(st.integers(min_value=16, max_value=4096), st.sampled_from(["", "Mi"]))
def test_memory_mib_roundtrip(n: int, unit: str) -> None:
    assert spec_of_pod(pod({"vmfence.io/memory": f"{n}{unit}"}))[0].memory_mib == n


def test_ownership() -> None:
    assert is_ours(pod())
    other = pod()
    other["spec"]["nodeName"] = "worker-1"
    assert not is_ours(other) and pod_observation(other) is None
    other["metadata"]["labels"] = {"vmfence.io/managed": "true"}
    assert not is_ours(other), "a pod bound to another node is that node's kubelet's, whatever its labels"
    unscheduled = pod()
    del unscheduled["spec"]["nodeName"]
    assert not is_ours(unscheduled)
    unscheduled["metadata"]["labels"] = {"vmfence.io/managed": "true"}
    assert is_ours(unscheduled), "an unscheduled managed pod is vmfence's to place (and bind)"


def test_pod_observation_fields() -> None:
    p = pod({"vmfence.io/cpus": "nope"})
    p["metadata"]["deletionTimestamp"] = "2025-01-01T00:00:00Z"
    obs = pod_observation(p, gone=True)
    assert obs is not None
    assert obs.key == "ns1/web.v1" and obs.uid == "u-1" and obs.resource_version == 42
    assert obs.deleting and obs.gone and obs.node == "vmfence-host-a"
    assert obs.invalid is not None and "vmfence.io/cpus" in obs.invalid
    assert key_of_pod(p) == Key("pod", "ns1", "web.v1")


def vm(**spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "vmfence.io/v1alpha1",
        "kind": "VirtualMachine",
        "metadata": {"name": "db", "namespace": "ns1", "uid": "v-1", "resourceVersion": "7"},
        "spec": spec,
    }


def test_vm_spec_valid() -> None:
    spec, invalid = spec_of_vm(
        vm(
            image="debian",
            cpus=2,
            memory="1Gi",
            restartPolicy="Never",
            hibernated=True,
            hostSelector="host-b",
        )
    )
    assert invalid is None
    assert spec == Spec(
        cpus=2,
        memory_mib=1024,
        image="debian",
        restart_policy="Never",
        hibernate=True,
        host_selector="host-b",
    )
    assert spec_of_vm(vm(image="x", hostSelector=""))[0].host_selector is None
    firmware_only, invalid = spec_of_vm(vm())
    assert invalid is None and firmware_only.image is None


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        ({"image": ""}, "spec.image"),
        ({"image": "x", "cpus": 100}, "spec.cpus: 100 is not an integer between 1 and 64"),
        ({"image": "x", "cpus": True}, "spec.cpus"),
        ({"image": "x", "memory": "huge"}, 'spec.memory: "huge"'),
        ({"image": "x", "restartPolicy": "Maybe"}, 'spec.restartPolicy: "Maybe" is not one of Always'),
        ({"image": "x", "hibernated": "perhaps"}, "spec.hibernated"),
        ({"image": "x", "hostSelector": 5}, "spec.hostSelector"),
    ],
)
def test_vm_spec_invalid(spec: dict[str, Any], words: str) -> None:
    _spec, invalid = spec_of_vm(vm(**spec))
    assert invalid is not None and words in invalid


def test_vm_observation() -> None:
    obs = vm_observation(vm(image="x"), gone=True)
    assert obs.key == "vm:ns1/db" and obs.uid == "v-1" and obs.resource_version == 7 and obs.gone
    assert key_of_vm(vm()) == Key("vm", "ns1", "db")


@pytest.mark.parametrize("ann", ["vmfence.io/cpus", "vmfence.io/memory", "vmfence.io/probe-port"])
@pytest.mark.parametrize("digits", [19, 4301, 100_000])
def test_a_number_of_any_length_is_a_spec_error_never_an_exception(ann: str, digits: int) -> None:
    """More than 4300 digits made int() raise a plain ValueError, which stopped the watcher for every
    pod (issue 10, finding 1); the message shows a bounded part of the value."""
    spec, invalid = spec_of_pod(pod({ann: "9" * digits}))
    assert invalid is not None and invalid.startswith(f"{ann}: ")
    assert f"({digits} characters)" in invalid or digits <= 64
    assert len(invalid) < 400
    assert spec == Spec(node=NODE)


@pytest.mark.parametrize("field", ["cpus", "memory"])
def test_a_huge_json_integer_in_a_vm_spec_is_a_spec_error(field: str) -> None:
    """A JSON integer of thousands of digits: out of range, and the message does not try to print it
    (repr() of more than 4300 digits raises)."""
    _spec, invalid = spec_of_vm(vm(image="x", **{field: 10**5000}))
    assert invalid is not None and f"spec.{field}" in invalid and "bits" in invalid and len(invalid) < 400
