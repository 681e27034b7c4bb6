"""The real Kubernetes control plane for tests and ``vmfence up --control-plane kube``.

``launcher`` starts etcd, kube-apiserver, kube-scheduler and kube-controller-manager (built by
``make kube``) on loopback; ``pki`` makes their certificates; ``rbac`` gives vmfence's services the
Helm chart's ServiceAccounts, roles and token kubeconfigs. :func:`start_control_plane` does all three.
"""

from __future__ import annotations

from pathlib import Path

from services.testbed.kubecp.launcher import (
    ControlPlaneError,
    KubeControlPlane,
    KubeUnavailable,
    binaries,
)
from services.testbed.kubecp.rbac import ServiceCredentials, install_chart_rbac

__all__ = [
    "ControlPlaneError",
    "KubeControlPlane",
    "KubeUnavailable",
    "ServiceCredentials",
    "binaries",
    "start_control_plane",
]


async def start_control_plane(directory: Path, **kw: object) -> tuple[KubeControlPlane, ServiceCredentials]:
    """A started control plane in ``directory`` with the chart's RBAC installed and a token kubeconfig
    per vmfence service under ``<directory>/services``; the caller stops it (``await cp.stop()``)."""
    cp = KubeControlPlane(directory, **kw)  # type: ignore[arg-type]
    try:
        await cp.start()
        assert cp.pki is not None
        api = await cp.admin_client()
        try:
            creds = await install_chart_rbac(api, cp.url, cp.pki.ca_pem(), cp.directory / "services")
        finally:
            await api.close()
    except BaseException:
        await cp.stop()
        raise
    return cp, creds
