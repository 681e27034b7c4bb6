"""Shared paths and tool lookups for the deployment tests."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
NATS_DIR = DEPLOY / "nats"
CHART = DEPLOY / "helm" / "vmfence"
DOCS = REPO / "docs"

# Dev-only passwords the NATS configuration reads from the environment (compose.yaml has the same
# variable names with its own dev defaults).
NATS_PASSWORD_ENV = {
    "VMFENCE_NATS_WATCHER_PASSWORD": "test-watcher",
    "VMFENCE_NATS_RECONCILER_PASSWORD": "test-reconciler",
    "VMFENCE_NATS_AGENT_HOST_A_PASSWORD": "test-agent-a",
    "VMFENCE_NATS_AGENT_HOST_B_PASSWORD": "test-agent-b",
    "VMFENCE_NATS_AGENT_HOST_C_PASSWORD": "test-agent-c",
    "VMFENCE_NATS_AUDIT_PASSWORD": "test-audit",
    "VMFENCE_NATS_OPERATOR_PASSWORD": "test-operator",
    "VMFENCE_NATS_ADMIN_PASSWORD": "test-admin",
}


def find_tool(name: str) -> str | None:
    """A tool from the venv's bin or tools directory first, then PATH."""
    for d in (REPO / ".venv" / "bin", REPO / ".venv" / "tools"):
        p = d / name
        if p.is_file() and os.access(p, os.X_OK):
            return str(p)
    return shutil.which(name)
