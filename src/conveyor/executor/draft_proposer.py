"""DraftModelProposer: a second, smaller model proposes the tokens the scheduler verifies in each
sequence's next decode (``executor/proposer.py``).

The draft model's paged KV cache has as many blocks as the target's and is addressed by the
same block tables (so its KV-cache groups must be the target's): it computes every step the target computes (``follow``: the same block
operations, the same tokens at the same slots), so the draft K/V of every computed token is in
place when the step's proposals are made. A proposal is k greedy one-token forwards, batched
across the sequences, from each sequence's newest token, writing draft K/V into the lookahead
slots the scheduler reserved for drafting (``SpeculativeConfig.drafting_slots``). Proposals are
greedy (a one-hot draft distribution), so rejection sampling keeps the target's distribution
for sampled requests exactly as with n-gram proposals.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from conveyor.core.step_input import StepInput

if TYPE_CHECKING:
    from conveyor.core.kv_cache_spec import KVCacheGroup
    from conveyor.executor.model_executor import ModelExecutor


class DraftModelProposer:
    def __init__(self, draft: ModelExecutor, target_vocab_size: int,
                 target_kv_cache_groups: tuple[KVCacheGroup, ...] = ()) -> None:
        if draft.kv_cache_groups != target_kv_cache_groups:
            raise ValueError("speculative_model's KV-cache groups (its sliding-window and "
                             "global layers) differ from the target's: the draft follows the "
                             "target's block tables, so its layers must group alike")
        if draft.model_config.vocab_size > target_vocab_size:
            raise ValueError(f"speculative_model has a vocabulary of "
                             f"{draft.model_config.vocab_size} tokens, more than the target's "
                             f"{target_vocab_size}: the draft must share the target's tokenizer")
        self.draft = draft

    def initialize_cache(self, block_size: int, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        self.draft.initialize_cache(block_size, num_gpu_blocks, num_cpu_blocks)

    def follow(self, step: StepInput) -> None:
        self.draft.runner.forward(step)

    @torch.inference_mode()
    def propose(self, contexts: list[list[int]], block_tables: list[list[list[int]]],
                k: int) -> list[list[int]]:
        """The j-th forward computes each sequence's token at position ``len(context) - 1 +
        j``, so a sequence proposes as many tokens as its tables have slots from its newest
        token on (up to ``k``). ``block_tables``: each sequence's table in every group."""
        runner = self.draft.runner
        slots = runner.kv_cache.block_size
        vocab = self.draft.model_config.vocab_size
        tokens = [tokens[-1] for tokens in contexts]
        positions = [len(tokens) - 1 for tokens in contexts]
        limits = [min(k, len(tables[0]) * slots - p)
                  for tables, p in zip(block_tables, positions, strict=True)]
        num_groups = len(block_tables[0]) if block_tables else 1
        out: list[list[int]] = [[] for _ in contexts]
        for j in range(k):
            active = [i for i, limit in enumerate(limits) if limit > j]
            if not active:
                break
            logits = runner.forward(StepInput(
                input_ids=[tokens[i] for i in active], starts=[positions[i] for i in active],
                counts=[1] * len(active), block_tables=[block_tables[i][0] for i in active],
                group_tables=[[block_tables[i][g] for i in active]
                              for g in range(1, num_groups)],
                logits_indices=list(range(len(active)))))
            for i, token in zip(active, logits[:, :vocab].argmax(-1).tolist(), strict=True):
                out[i].append(token)
                tokens[i] = token
                positions[i] += 1
        return out
