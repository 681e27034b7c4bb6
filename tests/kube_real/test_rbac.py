"""The chart's RBAC as the real API server enforces it: each vmfence service's token may do exactly
what tests/deploy/test_helm.py's table says (asked of the server with SelfSubjectAccessReviews in the
service's own name), is refused what a compromised watcher or reconciler must not do, and the agent
has no Kubernetes credential at all. That the services need nothing more is shown by every other
test here: they run under these roles and fail on any refused request."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
from collections.abc import AsyncIterator
from typing import Any

import pytest
from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from services.agent.config import AgentConfig
from services.testbed.kubecp import KubeControlPlane, ServiceCredentials
from services.testbed.stack import load_kubeconfig
from tests.deploy.test_helm import ALLOWED

Plane = tuple[KubeControlPlane, ServiceCredentials]

# (verb, group, resource, subresource, namespace) a service must be refused
FORBIDDEN: dict[str, list[tuple[str, str, str, str, str]]] = {
    "watcher": [
        ("create", "", "pods", "", "default"), ("patch", "", "pods", "", "default"),
        ("delete", "", "pods", "", "default"), ("patch", "", "pods", "status", "default"),
        ("create", "", "pods", "eviction", "default"), ("create", "", "events", "", "default"),
        ("get", "", "secrets", "", "default"), ("list", "", "nodes", "", ""),
        ("patch", "vmfence.io", "virtualmachines", "status", "default"),
    ],
    "reconciler": [
        ("create", "", "pods", "", "default"), ("update", "", "pods", "", "default"),
        ("patch", "", "pods", "", "default"),  # its annotations go through pods/status
        ("get", "", "secrets", "", "default"), ("list", "", "secrets", "", ""),
        ("get", "", "configmaps", "", "default"), ("create", "", "namespaces", "", ""),
        ("delete", "", "namespaces", "", ""), ("create", "", "serviceaccounts", "token", "default"),
        ("update", "apps", "deployments", "", "default"), ("delete", "apps", "statefulsets", "", "default"),
        ("create", "coordination.k8s.io", "leases", "", "default"),
        ("update", "coordination.k8s.io", "leases", "", "kube-system"),
        ("create", "rbac.authorization.k8s.io", "clusterrolebindings", "", ""),
        ("escalate", "rbac.authorization.k8s.io", "clusterroles", "", ""),
        ("impersonate", "", "users", "", ""),
        ("create", "vmfence.io", "virtualmachines", "", "default"),
        ("patch", "vmfence.io", "virtualmachines", "", "default"),
    ],
}


@pytest.fixture
async def clients(control_plane: Plane) -> AsyncIterator[dict[str, client.ApiClient]]:
    _, creds = control_plane
    out = {c: client.ApiClient(await load_kubeconfig(str(p))) for c, p in creds.kubeconfigs.items()}
    try:
        yield out
    finally:
        for c in out.values():
            await c.close()


async def can(api: client.ApiClient, verb: str, group: str, resource: str, sub: str, ns: str) -> bool:
    attrs: dict[str, Any] = {"verb": verb, "group": group, "resource": resource}
    if sub:
        attrs["subresource"] = sub
    if ns:
        attrs["namespace"] = ns
    review = await client.AuthorizationV1Api(api).create_self_subject_access_review(
        {"spec": {"resourceAttributes": attrs}})
    return bool(review.status.allowed)


async def test_each_service_may_do_what_the_chart_table_says(clients: dict[str, client.ApiClient]) -> None:
    missing = []
    for component in ("watcher", "reconciler"):
        for (group, resource, scope), verbs in ALLOWED[component].items():
            res, _, sub = resource.partition("/")
            ns = "default" if scope == "*" else scope
            for verb in sorted(verbs):
                if not await can(clients[component], verb, group, res, sub, ns):
                    missing.append(f"{component}: {verb} {group or 'core'}/{resource} in {ns}")
    assert not missing, "the real API server refuses what the chart grants:\n" + "\n".join(missing)


async def test_what_the_watcher_and_the_reconciler_may_not_do(clients: dict[str, client.ApiClient]) -> None:
    leaks = [f"{c}: {v} {g or 'core'}/{r}{'/' + s if s else ''} in {ns or 'the cluster'}"
             for c, checks in FORBIDDEN.items() for (v, g, r, s, ns) in checks
             if await can(clients[c], v, g, r, s, ns)]
    assert not leaks, "allowed beyond the chart's table:\n" + "\n".join(leaks)


async def test_a_refused_request_is_a_403_from_the_real_server(clients: dict[str, client.ApiClient]) -> None:
    pod = {"metadata": {"name": "not-yours"}, "spec": {"containers": [{"name": "main", "image": "vm"}]}}
    with pytest.raises(ApiException) as exc:
        await client.CoreV1Api(clients["watcher"]).create_namespaced_pod("default", pod)
    assert exc.value.status == 403
    assert "system:serviceaccount:" in str(exc.value.body)
    with pytest.raises(ApiException) as exc:
        await client.CoreV1Api(clients["reconciler"]).list_namespaced_secret("default")
    assert exc.value.status == 403


async def test_the_agent_has_no_kubernetes_credentials(control_plane: Plane) -> None:
    cp, creds = control_plane
    assert set(creds.kubeconfigs) == {"watcher", "reconciler"}, "a kubeconfig was made for the agent"
    api = await cp.admin_client()
    try:
        core, rbac = client.CoreV1Api(api), client.RbacAuthorizationV1Api(api)
        sa = await core.read_namespaced_service_account(creds.accounts["agent"], creds.namespace)
        assert sa.automount_service_account_token is False
        agent = creds.accounts["agent"]
        bound = [b.metadata.name for b in [*(await rbac.list_cluster_role_binding()).items,
                                           *(await rbac.list_role_binding_for_all_namespaces()).items]
                 if any(s.kind == "ServiceAccount" and s.name == agent for s in (b.subjects or []))]
        assert bound == [], f"bindings for the agent's account: {bound}"
        review = await client.AuthorizationV1Api(api).create_subject_access_review({"spec": {
            "user": creds.user("agent"), "groups": ["system:serviceaccounts"],
            "resourceAttributes": {"verb": "get", "resource": "pods", "namespace": "default"}}})
        assert not review.status.allowed
    finally:
        await api.close()
    # nor can one be given to it: the agent's configuration has no Kubernetes setting
    # (its kubelet_* settings serve the endpoint the API server proxies logs to; they are no credential)
    assert not [f for f in AgentConfig.__dataclass_fields__ if re.search(r"kubeconfig|^kube_|token", f)]
    help_text = (await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "services.cli", "agent", "--help"],
                                         capture_output=True, text=True, timeout=60, check=True)).stdout
    assert "kubeconfig" not in help_text and not re.search(r"--kube[-\s]", help_text)
