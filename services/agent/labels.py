"""The runtime labels a VM carries: the fence it was created under, readable when the ledger lost it."""

from __future__ import annotations

from shared.fence.schema import Fence

LABEL_KEY = "vmfence.io/key"
LABEL_UID = "vmfence.io/uid"
LABEL_EPOCH = "vmfence.io/epoch"


def fence_labels(fence: Fence) -> dict[str, str]:
    """The labels a VM made under ``fence`` gets."""
    return {LABEL_KEY: fence.key, LABEL_UID: fence.uid, LABEL_EPOCH: str(fence.epoch)}


def labels_fence(labels: dict[str, str]) -> Fence | None:
    """The fence a VM was created under, from its runtime labels (when the ledger lost it)."""
    try:
        return Fence(labels[LABEL_KEY], labels[LABEL_UID], int(labels[LABEL_EPOCH]))
    except (KeyError, ValueError):
        return None
