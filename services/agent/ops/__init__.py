"""The agent's ops as steps (see ``base.Step``), and the one table that names them.

``OPS`` is the static dispatch of ``Command.op`` to its step; a test checks it covers every op.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

from services.agent.ops.adopt import Adopt
from services.agent.ops.base import UP_STATES, Answer, Step
from services.agent.ops.bringup import Create, Start, Wake
from services.agent.ops.look import Inspect, Survey
from services.agent.ops.teardown import Hibernate, Remove
from shared.fence.schema import CommandOp

OPS: Final[Mapping[CommandOp, Step]] = {
    "create": Create(),
    "start": Start(),
    "remove": Remove(),
    "hibernate": Hibernate(),
    "wake": Wake(),
    "adopt": Adopt(),
    "inspect": Inspect(),
    "survey": Survey(),
}

__all__ = ["OPS", "UP_STATES", "Answer", "Step"]
