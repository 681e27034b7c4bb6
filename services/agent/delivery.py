"""A command message as the agent takes it: what can never run (a dead letter), how often it was
delivered, whether a failure may heal, and the backoff before its redelivery."""

from __future__ import annotations

import nats
from nats.aio.msg import Msg

from services.agent.ledger import is_write_failure
from services.agent.runtime.base import VM_ID_RE
from shared.fence.keys import Key
from shared.fence.schema import SCHEMA_VERSION, Command


class Malformed(Exception):
    """A command that can never be executed: it goes to the dead-letter stream."""


def retry_delay(delivered: int, base: float, cap: float) -> float:
    """Seconds before the redelivery of a command that failed on its ``delivered``-th delivery
    (counting from 1): ``base`` doubled each time, at most ``cap``."""
    return float(min(cap, base * 2.0 ** min(max(delivered, 1) - 1, 32)))  # no float overflow


def delivered(msg: Msg) -> int:
    """How often JetStream has delivered ``msg`` (1 the first time)."""
    try:
        return max(1, int(msg.metadata.num_delivered or 1))
    except (nats.errors.Error, ValueError, TypeError, AttributeError):
        return 1


def heals(e: BaseException) -> bool:
    """May a retry of a command that raised ``e`` succeed? A ledger that cannot be written (disk
    full, read-only), a timeout or an I/O error may heal; anything else (a bug, a value no retry
    changes) is answered failed at once."""
    return is_write_failure(e) or isinstance(e, TimeoutError | OSError)


def validate_command(cmd: Command, host: str) -> None:
    """Reject what no retry can fix (dead letter) before touching the ledger."""
    if cmd.v > SCHEMA_VERSION:
        raise Malformed(f"schema version {cmd.v} is newer than this agent's {SCHEMA_VERSION}")
    if cmd.host != host:
        raise Malformed(f"command for host {cmd.host!r} delivered to {host!r}")
    if not cmd.id:
        raise Malformed("empty command id")
    if not VM_ID_RE.match(cmd.vm_id):
        raise Malformed(f"invalid vm_id {cmd.vm_id!r}")
    try:
        Key.parse(cmd.fence.key)
    except ValueError as e:
        raise Malformed(str(e)) from None
