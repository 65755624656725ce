"""The executor interface: ``execute`` turns the scheduler's ``SchedulerOutput`` into the
step's ``ExecutorOutput`` (sampled tokens, logprobs, pooled vectors). The contract itself is
in ``core/scheduler_output.py``."""

from __future__ import annotations

from typing import Protocol

from conveyor.core.scheduler_output import ExecutorOutput, SchedulerOutput


class Executor(Protocol):
    def execute(self, scheduler_output: SchedulerOutput) -> ExecutorOutput: ...
