"""What every op step shares: its shape, the early answer, the states that count as up."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, ClassVar

from shared.fence.schema import ResultOutcome

if TYPE_CHECKING:
    from services.agent.executor import Executor
    from services.agent.ledger import VMRow
    from shared.fence.schema import Command, CommandResult

UP_STATES = ("running", "paused")


class Answer(Exception):
    """Raised by a step (or the executor's helpers) to answer the command now with ``outcome``;
    the executor records it by command id like any other result and changes nothing else."""

    def __init__(self, outcome: ResultOutcome, error: str | None = None) -> None:
        super().__init__(outcome, error)
        self.outcome: ResultOutcome = outcome
        self.error = error


class Step(ABC):
    """One op: look at the ledger row (given) and the runtime (through the executor), act only on
    the difference, record the result by command id together with the ledger change, verify.

    The executor runs it under the VM's lock, after the ledger replay and the fence checks, and
    answers an ``Answer`` it raises; a step never calls the runtime but through the executor's
    ``inspect``/``peek``/``effect``/``transition``/``bring_up``, which bound every call, map the
    runtime's doubts and failures to outcomes and record intent before effect.
    """

    # a redelivery is answered with the stored result (rule 11); a survey is a question about now
    replay: ClassVar[bool] = True
    # an ok answer that found nothing is logged at DEBUG: a survey is two lines per new pod (one per
    # host) that say nothing the log stream does not (what it found, or a failure, stays at INFO+)
    quiet: ClassVar[bool] = False

    @abstractmethod
    async def run(self, ex: Executor, cmd: Command, row: VMRow | None) -> CommandResult:
        """The command's result, recorded by its id (or raise ``Answer``)."""
