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
        shape, sampled = batch_shape(scheduler_output, self.token_id)
        dt = self.cost_model.step_time(*shape)
        self.clock.advance(dt)
        self.num_steps += 1
        self.busy_s += dt
        self.last_step_s = dt
        self.num_computed_tokens += shape[0]
        return ExecutorOutput(sampled_token_ids=sampled)


def batch_shape(so: SchedulerOutput, token: int = 0) -> tuple[tuple[int, ...], list[list[int]]]:
    """What the cost model prices in a step, and the tokens a step samples (all ``token``).

    The shape is ``CostModel.step_time``'s arguments: (new tokens, sequences, sampled tokens,
    causal attention pairs, cached context tokens, swapped blocks, copied blocks). Read before
    ``Scheduler.update`` (which advances ``num_computed_tokens``). Decode entries (the first
    ``so.num_decodes``) share one read-only ``[token]`` list: this is the simulator's hot path.
    """
    seqs = so.seqs
    d = so.num_decodes
    one = [token]
    if d:  # one new token each, after `cached` ones: cached + 1 causal pairs, one sample
        context = sum([s.num_computed_tokens for s in (seqs if d == len(seqs) else seqs[:d])])
        sampled = [one] * d
        num_tokens = samples = d
        pairs = context + d
    else:
        context = num_tokens = samples = pairs = 0
        sampled = []
    for i in range(d, len(seqs)):  # prefill chunks (whole prompts, pieces, or recomputation)
        seq = seqs[i]
        n = so.num_new_tokens[i]
        cached = seq.num_computed_tokens
        num_tokens += n
        context += cached
        pairs += n * cached + (n * (n + 1) >> 1)
        length = len(seq.token_ids)
        if cached + n < length:  # a chunk that does not reach the end: no sample
            sampled.append([])
        elif length > seq.num_prompt_tokens:  # decode-like, or re-prefill after preemption
            sampled.append(one)
            samples += 1
        else:  # the prompt completes: 1 token, or n for parallel samples
            k = so.num_samples(i)
            sampled.append([token] * k)
            samples += k
    swapped = len(so.blocks_to_swap_in) + len(so.blocks_to_swap_out)
    shape = (num_tokens, len(seqs), samples, pairs, context, swapped, len(so.blocks_to_copy))
    return shape, sampled
