"""Draft-model proposer: a second (smaller) Conveyor model proposes tokens greedily.

Its paged KV cache has as many blocks as the target's and is addressed by the same block
tables: the draft computes every step the target computes (``follow``: same block operations,
same tokens at the same slots), so the draft K/V of every computed token is in place whenever
the scheduler asks for a proposal. A proposal runs k one-token draft forwards from the
sequence's last token, writing draft K/V into the lookahead slots the scheduler reserved; the
target's verification then overwrites nothing of the draft's and rejects what it disagrees with.
Proposals are greedy (a one-hot draft distribution), so rejection sampling keeps the target's
distribution for sampled requests exactly as with n-gram proposals.
"""

from __future__ import annotations

import torch

from conveyor.core.scheduler_output import SchedulerOutput
from conveyor.core.sequence import Sequence
from conveyor.distributed.step import StepMessage
from conveyor.executor.model_executor import ModelExecutor


class DraftModelProposer:
    def __init__(self, draft: ModelExecutor, target_vocab_size: int) -> None:
        if draft.model_config.vocab_size > target_vocab_size:
            raise ValueError(f"speculative_model has a vocabulary of "
                             f"{draft.model_config.vocab_size} tokens, more than the target's "
                             f"{target_vocab_size}: the draft must share the target's tokenizer")
        self.draft = draft

    def initialize_cache(self, block_size: int, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        self.draft.initialize_cache(block_size, num_gpu_blocks, num_cpu_blocks)

    def follow(self, scheduler_output: SchedulerOutput) -> None:
        """Compute the step's tokens (and block operations) in the draft's cache too."""
        self.draft.execute(scheduler_output)

    @torch.inference_mode()
    def propose(self, seq: Sequence, k: int) -> list[int]:
        token, position = seq.token_ids[-1], len(seq.token_ids) - 1
        vocab = self.draft.model_config.vocab_size
        out: list[int] = []
        for _ in range(k):
            logits = self.draft.runner.forward(StepMessage(input_ids=[token], starts=[position], counts=[1],
                                                 block_tables=[seq.block_table],
                                                 logits_indices=[0]))
            token = int(logits[0, :vocab].argmax())
            out.append(token)
            position += 1
        return out
