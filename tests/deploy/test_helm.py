"""The Helm chart lints, renders, and grants each component exactly the Kubernetes access it uses.

The RBAC table below is the single statement of what each component may do; the chart's rendered
Roles and ClusterRoles must match it exactly (more is a privilege leak, less breaks the service).
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from .conftest import CHART, DEPLOY, find_tool

HELM = find_tool("helm")
pytestmark = pytest.mark.skipif(
    HELM is None, reason="helm binary not installed (scripts/bootstrap.sh fetches it)"
)

RELEASE = "vmf"
NAMESPACE = "vmfence-system"

# (apiGroup, resource, namespace or "*" for cluster-wide) -> verbs, per component
ALLOWED: dict[str, dict[tuple[str, str, str], set[str]]] = {
    "watcher": {
        ("", "pods", "*"): {"get", "list", "watch"},
        ("vmfence.io", "virtualmachines", "*"): {"get", "list", "watch"},
    },
    "reconciler": {
        ("", "pods", "*"): {"get", "list", "watch", "delete"},
        ("", "pods/status", "*"): {"get", "patch", "update"},
        ("", "pods/eviction", "*"): {"create"},
        ("", "events", "*"): {"create", "patch"},
        ("", "nodes", "*"): {"get", "list", "watch", "create", "patch", "update", "delete"},
        ("", "nodes/status", "*"): {"patch", "update"},
        ("coordination.k8s.io", "leases", "kube-node-lease"): {"get", "create", "update", "patch", "delete"},
        ("vmfence.io", "virtualmachines", "*"): {"get", "list", "watch", "delete"},
        ("vmfence.io", "virtualmachines/status", "*"): {"get", "patch", "update"},
    },
    "agent": {},
}

VALUE_SETS: dict[str, list[str]] = {
    "defaults": [],
    "secret-auth-device-plugin": [
        "--set",
        "agent.natsAuth=secret",
        "--set",
        "agent.kvm.mode=devicePlugin",
        "--set",
        "nats.users.agent.user=agent",
        "--set",
        "nats.users.agent.password=p",
        "--set",
        "nats.users.watcher.password=w",
        "--set",
        "nats.users.reconciler.password=r",
    ],
    "sim-runtime": ["--set", "agent.runtime=sim"],
    "existing-secret-monitoring": [
        "--set",
        "nats.existingSecret=vmfence-nats",
        "--set",
        "metrics.serviceMonitor.enabled=true",
        "--set",
        "metrics.prometheusRule.enabled=true",
        "--set",
        "reconciler.replicas=3",
        "--set",
        "agent.kvm.mode=none",
        "--set",
        "agent.accel=tcg",
        "--set",
        "nats.tlsCASecret=nats-ca",
    ],
}


def helm(*args: str) -> subprocess.CompletedProcess[str]:
    assert HELM
    return subprocess.run([HELM, *args], capture_output=True, text=True, timeout=60)


def render(extra: list[str]) -> list[dict[str, Any]]:
    res = helm("template", RELEASE, str(CHART), "--namespace", NAMESPACE, "--include-crds", *extra)
    assert res.returncode == 0, res.stderr
    return [d for d in yaml.safe_load_all(res.stdout) if d]


@pytest.fixture(scope="module", params=list(VALUE_SETS), ids=list(VALUE_SETS))
def docs(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    return render(VALUE_SETS[request.param])


@pytest.fixture(scope="module")
def default_docs() -> list[dict[str, Any]]:
    return render([])


def of_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def component(doc: dict[str, Any]) -> str:
    return str(doc["metadata"].get("labels", {}).get("app.kubernetes.io/component", ""))


def workload(docs: list[dict[str, Any]], name: str) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] in ("Deployment", "DaemonSet") and component(d) == name]
    assert len(found) == 1, f"one workload for {name}"
    return found[0]


# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("values", list(VALUE_SETS))
def test_lint_strict(values: str) -> None:
    res = helm("lint", "--strict", str(CHART), *VALUE_SETS[values])
    assert res.returncode == 0, res.stdout + res.stderr


def test_rejects_a_single_reconciler() -> None:
    res = helm("template", RELEASE, str(CHART), "--set", "reconciler.replicas=1")
    assert res.returncode != 0
    assert "at least 2" in res.stderr


def _grants(docs: list[dict[str, Any]]) -> Iterator[tuple[str, tuple[str, str, str], str]]:
    """(service account, (group, resource, namespace|*), verb) for every binding in the render."""
    roles = {
        (d["kind"], d["metadata"].get("namespace", "*"), d["metadata"]["name"]): d
        for d in docs
        if d["kind"] in ("Role", "ClusterRole")
    }
    for b in docs:
        if b["kind"] not in ("RoleBinding", "ClusterRoleBinding"):
            continue
        ns = b["metadata"].get("namespace", "*") if b["kind"] == "RoleBinding" else "*"
        ref = b["roleRef"]
        role_ns = ns if ref["kind"] == "Role" else "*"
        role = roles.get((ref["kind"], role_ns, ref["name"]))
        assert role is not None, f"{b['metadata']['name']} binds a role the chart does not define"
        for subj in b["subjects"]:
            assert subj["kind"] == "ServiceAccount", "bind service accounts only"
            assert subj["namespace"] == NAMESPACE
            for rule in role["rules"]:
                assert not rule.get("nonResourceURLs"), "no non-resource URLs"
                for group in rule.get("apiGroups", []):
                    for res in rule.get("resources", []):
                        for verb in rule.get("verbs", []):
                            yield subj["name"], (group, res, ns), verb


def test_rbac_is_exactly_what_each_component_uses(docs: list[dict[str, Any]]) -> None:
    sa_component = {d["metadata"]["name"]: component(d) for d in of_kind(docs, "ServiceAccount")}
    granted: dict[str, dict[tuple[str, str, str], set[str]]] = {c: {} for c in ALLOWED}
    for sa, target, verb in _grants(docs):
        assert sa in sa_component, f"binding to a service account the chart does not create: {sa}"
        assert "*" not in (target[0], target[1], verb), f"wildcard grant to {sa}: {target} {verb}"
        granted[sa_component[sa]].setdefault(target, set()).add(verb)
    for comp, allowed in ALLOWED.items():
        extra = {t: v - allowed.get(t, set()) for t, v in granted[comp].items() if v - allowed.get(t, set())}
        missing = {
            t: v - granted[comp].get(t, set()) for t, v in allowed.items() if v - granted[comp].get(t, set())
        }
        assert not extra, f"{comp} is granted more than it uses: {extra}"
        assert not missing, f"{comp} lacks access it needs: {missing}"


def test_binding_unscheduled_pods_is_granted_only_when_switched_on() -> None:
    """reconciler.bindUnscheduled=on (the reconciler binds pods itself, as on a cluster without a
    scheduler) adds exactly pods/binding create to the table; auto (the default: kube-scheduler
    binds) and off grant no binding; anything else is refused at render."""
    for value, extra in (("on", {("", "pods/binding", "*"): {"create"}}), ("off", {}), ("auto", {})):
        docs = render(["--set", f"reconciler.bindUnscheduled={value}"])
        sa_component = {d["metadata"]["name"]: component(d) for d in of_kind(docs, "ServiceAccount")}
        granted: dict[tuple[str, str, str], set[str]] = {}
        for sa, target, verb in _grants(docs):
            if sa_component[sa] == "reconciler":
                granted.setdefault(target, set()).add(verb)
        assert granted == {**ALLOWED["reconciler"], **extra}, value
        env = {e["name"]: e.get("value") for e in workload(docs, "reconciler")["spec"]["template"]["spec"]
               ["containers"][0]["env"]}
        assert env["VMFENCE_BIND_UNSCHEDULED"] == value
    res = helm("template", RELEASE, str(CHART), "--set", "reconciler.bindUnscheduled=yes")
    assert res.returncode != 0 and "must be auto, on or off" in res.stderr


def test_workloads_use_their_own_service_accounts(docs: list[dict[str, Any]]) -> None:
    for comp in ("watcher", "reconciler", "agent"):
        w = workload(docs, comp)
        sa = w["spec"]["template"]["spec"]["serviceAccountName"]
        assert sa == f"{RELEASE}-vmfence-{comp}"
        assert any(d["metadata"]["name"] == sa for d in of_kind(docs, "ServiceAccount"))


def test_agent_has_no_kubernetes_credentials(docs: list[dict[str, Any]]) -> None:
    agent_sa = f"{RELEASE}-vmfence-agent"
    for d in docs:
        if d["kind"] in ("Role", "ClusterRole"):
            assert component(d) != "agent", "no role for the agent"
        if d["kind"] in ("RoleBinding", "ClusterRoleBinding"):
            assert all(s["name"] != agent_sa for s in d["subjects"]), "no binding to the agent"
    sa = next(d for d in of_kind(docs, "ServiceAccount") if d["metadata"]["name"] == agent_sa)
    assert sa.get("automountServiceAccountToken") is False
    pod = workload(docs, "agent")["spec"]["template"]["spec"]
    assert pod.get("automountServiceAccountToken") is False
    assert not pod.get("hostNetwork", False)
    for c in pod["containers"]:
        names = {e["name"] for e in c.get("env", [])}
        assert not any("KUBE" in n for n in names)
    assert not any("projected" in v or "serviceAccountToken" in str(v) for v in pod["volumes"])


def test_agent_daemonset(docs: list[dict[str, Any]]) -> None:
    ds = workload(docs, "agent")
    assert ds["kind"] == "DaemonSet"
    pod = ds["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    env = {e["name"]: e for e in c["env"]}
    assert env["VMFENCE_HOST"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    for name in (
        "VMFENCE_RUNTIME",
        "VMFENCE_ACCEL",
        "VMFENCE_DATA_DIR",
        "VMFENCE_SNAPSHOT_DIR",
        "VMFENCE_VNC_PORTS",
        "VMFENCE_VNC_LISTEN",
    ):
        assert name in env
    assert ("VMFENCE_NATS_CREDS" in env) != ("VMFENCE_NATS_USER" in env), "one way to authenticate"
    vols = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    for path in (env["VMFENCE_DATA_DIR"]["value"], env["VMFENCE_SNAPSHOT_DIR"]["value"]):
        assert "hostPath" in vols[mounts[path]], f"{path} must survive the pod: hostPath"
    kvm = [v for v in pod["volumes"] if v.get("hostPath", {}).get("path") == "/dev/kvm"]
    limits = c.get("resources", {}).get("limits", {})
    if kvm:
        assert kvm[0]["hostPath"]["type"] == "CharDevice"
        assert c["securityContext"].get("privileged") is True
    elif any("kvm" in k for k in limits):
        assert not c["securityContext"].get("privileged")
    else:
        assert env["VMFENCE_ACCEL"]["value"] == "tcg" or env["VMFENCE_RUNTIME"]["value"] == "sim", (
            "without /dev/kvm only tcg (or the sim runtime) can work"
        )
        assert not c["securityContext"].get("privileged")
        assert c["securityContext"]["runAsNonRoot"] is True
    for probe, path in (("livenessProbe", "/livez"), ("readinessProbe", "/readyz")):
        assert c[probe]["httpGet"]["path"] == path


def test_reconciler_is_redundant(docs: list[dict[str, Any]]) -> None:
    dep = workload(docs, "reconciler")
    assert dep["kind"] == "Deployment"
    assert dep["spec"]["replicas"] >= 2
    pdbs = [d for d in of_kind(docs, "PodDisruptionBudget") if component(d) == "reconciler"]
    assert len(pdbs) == 1
    pdb = pdbs[0]["spec"]
    assert pdb["minAvailable"] == 1
    pod_labels = dep["spec"]["template"]["metadata"]["labels"]
    assert all(pod_labels.get(k) == v for k, v in pdb["selector"]["matchLabels"].items())
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e for e in c["env"]}
    assert env["VMFENCE_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert "VMFENCE_DATA_DIR" in env


def test_every_component_is_probed_and_configured(docs: list[dict[str, Any]]) -> None:
    secret_name = None
    for comp in ("watcher", "reconciler", "agent"):
        w = workload(docs, comp)
        (c,) = w["spec"]["template"]["spec"]["containers"]
        assert c["args"] == [comp]
        assert c["livenessProbe"]["httpGet"]["path"] == "/livez"
        assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
        env = {e["name"]: e for e in c["env"]}
        for name in ("VMFENCE_PREFIX", "VMFENCE_PARTITIONS", "VMFENCE_REPLICAS", "VMFENCE_HTTP_PORT"):
            assert name in env, f"{comp}: {name}"
        ref = env["VMFENCE_NATS_URL"]["valueFrom"]["secretKeyRef"]
        secret_name = secret_name or ref["name"]
        assert ref["name"] == secret_name, "one NATS Secret"
        assert env["VMFENCE_HTTP_PORT"]["value"] == str(c["ports"][0]["containerPort"])
        if comp != "agent":
            sc = c["securityContext"]
            assert sc["runAsNonRoot"] and sc["readOnlyRootFilesystem"] and not sc["allowPrivilegeEscalation"]
            assert not any("KUBECONFIG" in n for n in env), "in-cluster config"
    secrets = [d for d in of_kind(docs, "Secret") if d["metadata"]["name"] == secret_name]
    # chart-created unless nats.existingSecret names one
    assert len(secrets) in (0, 1)
    if secrets:
        assert "url" in secrets[0]["stringData"]
    else:
        assert secret_name == "vmfence-nats"


def test_metrics_services_and_monitor(docs: list[dict[str, Any]]) -> None:
    services = {component(s): s for s in of_kind(docs, "Service")}
    assert {"watcher", "reconciler", "agent"} <= set(services)
    for comp, svc in services.items():
        pod_labels = workload(docs, comp)["spec"]["template"]["metadata"]["labels"]
        assert all(pod_labels.get(k) == v for k, v in svc["spec"]["selector"].items())
        assert svc["spec"]["ports"][0]["name"] == "metrics"
    for sm in of_kind(docs, "ServiceMonitor"):
        sel = sm["spec"]["selector"]["matchLabels"]
        matched = [
            s for s in services.values() if all(s["metadata"]["labels"].get(k) == v for k, v in sel.items())
        ]
        assert len(matched) == 3
        assert sm["spec"]["endpoints"][0]["port"] == "metrics"
    for rule in of_kind(docs, "PrometheusRule"):
        names = {r["alert"] for g in rule["spec"]["groups"] for r in g["rules"]}
        assert "VmfenceAuditViolation" in names


def test_service_monitor_is_optional(default_docs: list[dict[str, Any]]) -> None:
    assert not of_kind(default_docs, "ServiceMonitor")
    assert not of_kind(default_docs, "PrometheusRule")


def test_chart_crd_is_a_copy_of_the_projects_crd() -> None:
    source = DEPLOY / "crds" / "virtualmachines.vmfence.io.yaml"
    copy = CHART / "crds" / "virtualmachines.vmfence.io.yaml"
    if not source.exists():
        pytest.skip("deploy/crds/virtualmachines.vmfence.io.yaml not written yet")
    assert copy.read_bytes() == source.read_bytes(), "cp deploy/crds/*.yaml deploy/helm/vmfence/crds/"


def test_crd_is_rendered_with_the_spec_and_status_fields(default_docs: list[dict[str, Any]]) -> None:
    (crd,) = of_kind(default_docs, "CustomResourceDefinition")
    assert crd["metadata"]["name"] == "virtualmachines.vmfence.io"
    assert crd["spec"]["group"] == "vmfence.io"
    assert crd["spec"]["names"]["plural"] == "virtualmachines"
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1alpha1"]
    assert "status" in version["subresources"]
    props = version["schema"]["openAPIV3Schema"]["properties"]
    assert {"cpus", "memory", "image", "restartPolicy", "hibernated", "hostSelector"} <= set(
        props["spec"]["properties"]
    )
    assert {"phase", "host", "vmID", "ip", "restartCount", "epoch", "conditions"} <= set(
        props["status"]["properties"]
    )


def test_alert_rules_copy_is_identical() -> None:
    assert (CHART / "files" / "alerts.yaml").read_bytes() == (
        DEPLOY / "prometheus" / "alerts.yaml"
    ).read_bytes()


def test_manifests_match_kubernetes_schemas(docs: list[dict[str, Any]]) -> None:
    """Full OpenAPI validation of every built-in object (needs the optional kubernetes-validate)."""
    kv = pytest.importorskip("kubernetes_validate")
    version = kv.latest_version()
    for d in docs:
        if d["apiVersion"].startswith("monitoring.coreos.com"):
            continue
        kv.validate(d, version, strict=True)
