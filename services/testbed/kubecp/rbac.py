"""vmfence's services on the real control plane under the Helm chart's RBAC, never as admin.

:func:`install_chart_rbac` renders ``helm template deploy/helm/vmfence`` (the one statement of what
each component may do, ``deploy/helm/vmfence/templates/rbac.yaml``), creates its ServiceAccounts,
ClusterRoles, Roles and their bindings exactly as rendered, asks the TokenRequest API for a token of
each service's account and writes one kubeconfig per service (``watcher``, ``reconciler``) with
that token. The agent's account gets no token and no kubeconfig: agents hold no Kubernetes
credentials. A permission the chart forgot therefore fails a request of the service (a 403 in its
log, a test that waits in vain), it is never papered over by an admin credential.
"""

from __future__ import annotations

import asyncio
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from services.testbed.kubecp.launcher import ROOT, KubeUnavailable, kubeconfig_text
from services.testbed.natsserver import write_private

CHART = ROOT / "deploy" / "helm" / "vmfence"
HELM = ROOT / ".venv" / "tools" / "helm"
RELEASE = "vmfence"
NAMESPACE = "vmfence-system"
SERVICES = ("watcher", "reconciler")  # the components that talk to Kubernetes; the agent never does
RBAC_KINDS = ("ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding")
TOKEN_SECONDS = 24 * 3600  # a test cluster lives minutes; `vmfence up` a working day
HELM_TIMEOUT_S = 60.0
REQUEST_TIMEOUT_S = 15.0

JSON = dict[str, Any]


@dataclass(frozen=True)
class ServiceCredentials:
    """What ``install_chart_rbac`` made: each service's account and kubeconfig."""

    namespace: str
    accounts: dict[str, str]  # component -> ServiceAccount name (agent included: it exists, unbound)
    kubeconfigs: dict[str, Path]  # component -> kubeconfig with that account's token (no agent)

    def user(self, component: str) -> str:
        """The user name the API server authenticates the component as."""
        return f"system:serviceaccount:{self.namespace}:{self.accounts[component]}"


def helm_binary() -> Path:
    if not HELM.is_file():
        raise KubeUnavailable(f"helm is not installed at {HELM} (scripts/bootstrap.sh fetches it): "
                              "the chart's RBAC cannot be rendered")
    return HELM


def render_chart_rbac(release: str = RELEASE, namespace: str = NAMESPACE) -> list[JSON]:
    """The chart's ServiceAccounts, (Cluster)Roles and (Cluster)RoleBindings as rendered by helm."""
    out = subprocess.run(
        [str(helm_binary()), "template", release, str(CHART), "--namespace", namespace],
        capture_output=True, text=True, timeout=HELM_TIMEOUT_S, check=False,
    )
    if out.returncode != 0:
        raise RuntimeError(f"helm template {CHART} failed: {out.stderr.strip()}")
    return [d for d in yaml.safe_load_all(out.stdout) if d and d.get("kind") in RBAC_KINDS]


async def _create(api: client.ApiClient, doc: JSON, namespace: str) -> None:
    core, rbac = client.CoreV1Api(api), client.RbacAuthorizationV1Api(api)
    kind = doc["kind"]
    ns = (doc.get("metadata") or {}).get("namespace") or namespace
    kw: JSON = {"_request_timeout": REQUEST_TIMEOUT_S}
    if kind == "ServiceAccount":
        await core.create_namespaced_service_account(ns, doc, **kw)
    elif kind == "ClusterRole":
        await rbac.create_cluster_role(doc, **kw)
    elif kind == "ClusterRoleBinding":
        await rbac.create_cluster_role_binding(doc, **kw)
    elif kind == "Role":
        await rbac.create_namespaced_role(ns, doc, **kw)
    elif kind == "RoleBinding":
        await rbac.create_namespaced_role_binding(ns, doc, **kw)
    else:  # pragma: no cover - filtered by RBAC_KINDS
        raise ValueError(kind)


async def install_chart_rbac(
    api: client.ApiClient, server: str, ca_pem: bytes, out_dir: Path, *,
    release: str = RELEASE, namespace: str = NAMESPACE,
) -> ServiceCredentials:
    """Apply the chart's RBAC with the admin client ``api`` and write a token kubeconfig per service."""
    docs = await asyncio.to_thread(render_chart_rbac, release, namespace)
    core = client.CoreV1Api(api)
    try:
        await core.create_namespace({"metadata": {"name": namespace}}, _request_timeout=REQUEST_TIMEOUT_S)
    except ApiException as exc:
        if exc.status != 409:
            raise
    for doc in docs:
        await _create(api, doc, namespace)
    accounts: dict[str, str] = {}
    for doc in docs:
        if doc["kind"] == "ServiceAccount":
            component = (doc["metadata"].get("labels") or {}).get("app.kubernetes.io/component", "")
            accounts[component] = doc["metadata"]["name"]
    missing = [c for c in (*SERVICES, "agent") if c not in accounts]
    if missing:
        raise RuntimeError(f"the chart renders no ServiceAccount for {', '.join(missing)}")
    await asyncio.to_thread(out_dir.mkdir, parents=True, exist_ok=True, mode=0o700)
    kubeconfigs: dict[str, Path] = {}
    for component in SERVICES:
        sa = accounts[component]
        tr = await core.create_namespaced_service_account_token(
            sa, namespace, {"spec": {"expirationSeconds": TOKEN_SECONDS}}, _request_timeout=REQUEST_TIMEOUT_S,
        )
        path = out_dir / f"{component}.kubeconfig"
        write_private(path, kubeconfig_text(server, ca_pem, f"{namespace}-{sa}", token=tr.status.token))
        kubeconfigs[component] = path
    return ServiceCredentials(namespace=namespace, accounts=accounts, kubeconfigs=kubeconfigs)
