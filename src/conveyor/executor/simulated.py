"""SimulatedExecutor: an Executor with no model. A cost model prices each step and a virtual clock
advances by that much; every sampled token is the same fixed id.

Requests in the simulator run with ``ignore_eos`` and ``max_tokens`` set to their output
length, so the token's value never ends a request; only the timing matters. Nothing here
imports torch.
"""

from __future__ import annotations

from conveyor.core.scheduler_output import ExecutorOutput, SchedulerOutput
from conveyor.sim.clock import VirtualClock
from conveyor.sim.cost_model import CostModel


class SimulatedExecutor:
    """Implements the Executor protocol (``execute(SchedulerOutput) -> ExecutorOutput``)."""

    def __init__(self, cost_model: CostModel, clock: VirtualClock, token_id: int = 0) -> None:
        self.cost_model = cost_model
        self.clock = clock
        self.token_id = token_id
        self.num_steps = 0
        self.busy_s = 0.0  # virtual time spent computing steps
        self.num_computed_tokens = 0
        self.last_step_s = 0.0

    def execute(self, scheduler_output: SchedulerOutput) -> ExecutorOutput:
        so = scheduler_output
        token = self.token_id
        sampled: list[list[int]] = []
        append = sampled.append
        num_tokens = context = pairs = samples = 0
        for i, (seq, n) in enumerate(zip(so.seqs, so.num_new_tokens, strict=True)):
            cached = seq.num_computed_tokens
            num_tokens += n
            context += cached
            pairs += n * cached + (n * (n + 1) >> 1)
            length = len(seq.token_ids)
            if cached + n < length:  # a prefill chunk that does not reach the end: no sample
                append([])
            elif length > seq.num_prompt_tokens:  # decode, or re-prefill after preemption
                append([token])
                samples += 1
            else:  # the prompt completes: 1 token, or n for parallel samples
                k = so.num_samples(i)
                append([token] * k)
                samples += k
        swapped = len(so.blocks_to_swap_in) + len(so.blocks_to_swap_out)
        dt = self.cost_model.step_time(num_tokens, len(so.seqs), samples, pairs, context,
                                       swapped, len(so.blocks_to_copy))
        self.clock.advance(dt)
        self.num_steps += 1
        self.busy_s += dt
        self.last_step_s = dt
        self.num_computed_tokens += num_tokens
        return ExecutorOutput(sampled_token_ids=sampled)
