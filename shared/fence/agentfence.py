"""The agent's half of rule 4 as data: may a command under its fence touch this VM, here, now?

Four tables, each total over its product (tests/unit/test_agent_fence.py checks every cell and the
rules below as properties), so a reader sees the whole policy at once and a new case is a new cell:

- ``OWNER``: (op class x the command's relation to the VM's owner fence) -> verdict. A command older
  than the owner, or at the owner's epoch under another uid, or of another key, is refused; a
  ``remove`` with the owner's own (possibly old) fence is cleanup; a newer fence may collect, adopt
  or look at its predecessor's VM, but only ``adopt`` moves ownership (rule 8).
- ``MARK``: (op class x the command's relation to the key's mark, the newest epoch of the key this
  host has seen and the uid it belongs to) -> verdict. Nothing decided under an older epoch, or
  under this epoch for another incarnation, may make or wake a VM here.
- ``BELOW_FLOOR``: op class -> whether it is refused when its writer's partition generation is below
  the host's floor for the partition (a newer writer verified the host: ``PartitionVerify``).
- ``BURIED``: op class -> verdict for a vm_id that was removed, hibernated or lost: it is never
  brought back. (``adopt`` refuses a buried vm_id too, but only after asking the runtime, since
  rule 8 wants "the runtime does not know it" answered first: its own step does that.)

Pure and synchronous; the agent's executor only looks verdicts up and renders their reasons.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final, Literal, get_args

from shared.fence.schema import CommandOp, Fence

OpClass = Literal["bring_up", "hibernate", "collect", "adopt", "look", "survey"]
"""What an op does to a VM: makes it run, snapshots it away, removes it, takes it over, reads it, or
(a survey) names no VM at all."""

OP_CLASS: Final[Mapping[CommandOp, OpClass]] = {
    "create": "bring_up",
    "start": "bring_up",
    "wake": "bring_up",
    "hibernate": "hibernate",
    "remove": "collect",
    "adopt": "adopt",
    "inspect": "look",
    "survey": "survey",
}

Relation = Literal["unowned", "owner", "other_key", "older", "rival", "newer"]
"""The command's fence against the VM's owner: no owner, the owner itself, another key's VM, an older
epoch, the owner's epoch under another uid, a newer epoch (the owner is a predecessor)."""

MarkRelation = Literal["clear", "below", "rival"]
"""The command's fence against the key's mark: at or above it, below it, or at it under another
known uid."""

Verdict = Literal[
    "allow",
    "other_key",
    "older_than_owner",
    "epoch_owned",
    "only_adopt_moves",
    "older_than_mark",
    "epoch_marked",
    "buried",
]

OP_CLASSES: Final[tuple[OpClass, ...]] = get_args(OpClass)
RELATIONS: Final[tuple[Relation, ...]] = get_args(Relation)
MARK_RELATIONS: Final[tuple[MarkRelation, ...]] = get_args(MarkRelation)


def _rows(
    columns: tuple[str, ...], rows: Mapping[OpClass, tuple[Verdict, ...]]
) -> dict[tuple[OpClass, str], Verdict]:
    """A table written as rows (one per op class) under its columns, as a reader wants to see it."""
    table: dict[tuple[OpClass, str], Verdict] = {}
    for op_class, verdicts in rows.items():
        if len(verdicts) != len(columns):
            raise ValueError(f"row {op_class!r} has {len(verdicts)} cells for {len(columns)} columns")
        table.update({(op_class, col): v for col, v in zip(columns, verdicts, strict=True)})
    return table


# fmt: off
OWNER: Final[Mapping[tuple[OpClass, str], Verdict]] = _rows(RELATIONS, {
    #             unowned  owner    other_key    older               rival          newer
    "bring_up":  ("allow", "allow", "other_key", "older_than_owner", "epoch_owned", "only_adopt_moves"),
    "hibernate": ("allow", "allow", "other_key", "older_than_owner", "epoch_owned", "only_adopt_moves"),
    "collect":   ("allow", "allow", "other_key", "older_than_owner", "epoch_owned", "allow"),
    "adopt":     ("allow", "allow", "other_key", "older_than_owner", "epoch_owned", "allow"),
    "look":      ("allow", "allow", "other_key", "older_than_owner", "epoch_owned", "allow"),
    "survey":    ("allow", "allow", "allow",     "allow",            "allow",       "allow"),  # no VM
})

MARK: Final[Mapping[tuple[OpClass, str], Verdict]] = _rows(MARK_RELATIONS, {
    #             clear    below              rival
    "bring_up":  ("allow", "older_than_mark", "epoch_marked"),
    "hibernate": ("allow", "older_than_mark", "epoch_marked"),
    "adopt":     ("allow", "older_than_mark", "epoch_marked"),
    # a remove carries the VM owner's own (possibly old) fence; surveys and inspections touch nothing
    "collect":   ("allow", "allow", "allow"),
    "look":      ("allow", "allow", "allow"),
    "survey":    ("allow", "allow", "allow"),
})
# fmt: on

BURIED: Final[Mapping[OpClass, Verdict]] = {
    "bring_up": "buried",
    "hibernate": "allow",  # finds no VM row: not_found
    "collect": "allow",  # an idempotent remove answers ok
    "adopt": "allow",  # refused by its own step, after the runtime was asked (see above)
    "look": "allow",
    "survey": "allow",
}

RAISES_MARK: Final[Mapping[OpClass, bool]] = {
    # a survey under an epoch the log gave to no incarnation (fence uid "") raises it too: nothing
    # may run at that epoch here afterwards
    "bring_up": True,
    "hibernate": True,
    "adopt": True,
    "look": True,
    "survey": True,
    "collect": False,  # a remove carries the owner's own, possibly old, fence
}

BELOW_FLOOR: Final[Mapping[OpClass, bool]] = {
    # refused when sent under a partition generation below the host's floor for that partition
    # (a newer writer of the partition verified this host since; PartitionVerify): answered
    # ``inconclusive`` and not stored, so the newer writer, if the command is in its log too, asks
    # again under its own generation -- never ``fenced``, which would end its record of the VM
    "bring_up": True,
    "hibernate": True,
    "adopt": True,
    "look": True,
    "survey": True,
    "collect": False,  # a remove carries the owner's own, possibly old, fence; cleanup is allowed
}

_REASONS: Final[Mapping[Verdict, str]] = {
    "other_key": "VM belongs to key {owner.key!r}",
    "older_than_owner": "fence epoch {fence.epoch} is older than the owner's {owner.epoch}",
    "epoch_owned": "owner at epoch {owner.epoch} is uid {owner.uid}",
    "only_adopt_moves": "VM is owned by epoch {owner.epoch}; only adopt moves ownership",
    "older_than_mark": "fence epoch {fence.epoch} is older than epoch {owner.epoch} seen for the key",
    "epoch_marked": "epoch {owner.epoch} of the key belongs to uid {owner.uid} here, not {fence.uid}",
    "buried": "vm {vm_id} was {why}; a vm_id is never brought back",
}


def owner_relation(fence: Fence, owner: Fence | None) -> Relation:
    """How ``fence`` stands to the fence that owns the VM."""
    if owner is None:
        return "unowned"
    if fence == owner:
        return "owner"
    if fence.key != owner.key:
        return "other_key"
    if fence.epoch < owner.epoch:
        return "older"
    if fence.epoch == owner.epoch:
        return "rival"
    return "newer"


def mark_relation(fence: Fence, mark: int, mark_uid: str) -> MarkRelation:
    """How ``fence`` stands to the key's mark (``mark_uid`` "" when the mark's uid is unknown)."""
    if fence.epoch < mark:
        return "below"
    if fence.epoch == mark and mark_uid and fence.uid and fence.uid != mark_uid:
        return "rival"
    return "clear"


def reason(verdict: Verdict, fence: Fence, owner: Fence, *, vm_id: str = "", why: str = "") -> str | None:
    """None for ``allow``, else the refusal said with the fences it compared."""
    if verdict == "allow":
        return None
    return _REASONS[verdict].format(fence=fence, owner=owner, vm_id=vm_id, why=why)


def fence_verdict(op: CommandOp, fence: Fence, owner: Fence | None) -> str | None:
    """None if ``op`` under ``fence`` may touch a VM owned by ``owner``, else why not (rule 4)."""
    verdict = OWNER[OP_CLASS[op], owner_relation(fence, owner)]
    return reason(verdict, fence, owner or fence)


def mark_verdict(op: CommandOp, fence: Fence, mark: int, mark_uid: str) -> str | None:
    """None if the key's mark lets ``op`` under ``fence`` run here, else why not."""
    verdict = MARK[OP_CLASS[op], mark_relation(fence, mark, mark_uid)]
    return reason(verdict, fence, Fence(fence.key, mark_uid, mark))


def floor_verdict(op: CommandOp, gen: int, floor: int) -> str | None:
    """None if ``op`` sent under partition generation ``gen`` may run on a host whose floor for the
    partition is ``floor``, else why not."""
    if gen >= floor or not BELOW_FLOOR[OP_CLASS[op]]:
        return None
    return (f"sent by the partition's writer of generation {gen}; "
            f"a writer of generation {floor} verified this host since")


def raises_mark(op: CommandOp) -> bool:
    """Whether running ``op`` raises the key's mark to its fence."""
    return RAISES_MARK[OP_CLASS[op]]


def refusal(op: CommandOp, fence: Fence, vm_id: str, owner: Fence | None, buried: str | None) -> str | None:
    """Why the host's record of the VM forbids ``op``: its vm_id was buried (``buried`` names why),
    or its owner fence does not let ``fence`` touch it. None: it may."""
    if buried is not None and (verdict := BURIED[OP_CLASS[op]]) != "allow":
        return reason(verdict, fence, owner or fence, vm_id=vm_id, why=buried)
    return fence_verdict(op, fence, owner)
