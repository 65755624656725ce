"""The executor interface: turn a SchedulerOutput into sampled tokens (see DESIGN.md)."""

from __future__ import annotations

from typing import Protocol

from conveyor.core.scheduler_output import ExecutorOutput, SchedulerOutput


class Executor(Protocol):
    def execute(self, scheduler_output: SchedulerOutput) -> ExecutorOutput: ...
