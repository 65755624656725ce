"""ModelRunner: one per process, on every device and every tensor-parallel rank. It owns the
model, its backend (chosen once at load, ``model/backends/``), the paged KV cache and the LoRA
slots, and runs a step: the block operations, the step's metadata (one object per step, built
by the backend), the forward (replayed from CUDA graphs for decode steps on CUDA), and on
rank 0 the sampling, the grammar masks of structured outputs and, after the step, the
proposals of speculative decoding.

The KV cache follows the model's KV-cache groups (``model_kv_cache_groups``: Gemma 3's window and
global layers in groups of their own, ``docs/kv_cache.md``): a block holds ``layers_per_group``
layers, each layer reads and writes its group's slot, and a step carries each entry's block table
in every group, from which the backend builds one metadata object per group.

``prepare`` lays a ``SchedulerOutput`` out flat (single-token entries first, then prefill
chunks, each by length: attention groups pad less) as the ``StepInput`` every rank runs,
with logits only at sampling positions; ``forward`` runs it; ``sample`` turns the logits into
the step's tokens (and pooled vectors, prompt logprobs, verified proposals).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from conveyor.core.kv_cache_spec import (
    KVCacheGroup,
    kv_cache_groups,
    layer_slots,
    layers_per_group,
)
from conveyor.core.lookahead import may_speculate
from conveyor.core.scheduler_output import ExecutorOutput, SchedulerOutput
from conveyor.core.spec_decode.config import SpeculativeConfig
from conveyor.core.step_input import StepInput
from conveyor.executor.cuda_graphs import CudaGraphRunner, graph_batch_sizes
from conveyor.executor.pooler import Pooler, PoolingEntry
from conveyor.executor.prompt_logprobs import PromptScoring, positions_to_score, score
from conveyor.executor.proposer import Proposer
from conveyor.executor.spec_verify import Proposal, proposal_rows, verify
from conveyor.model.backends.base import StepMetadata
from conveyor.model.config import ModelConfig
from conveyor.model.device import TRIM_AFTER_TOKENS, return_freed_memory
from conveyor.model.kv_cache import KVCache
from conveyor.model.loader import LoadedModel
from conveyor.model.sampler import Sampler, SampleRow


@dataclass
class PreparedStep:
    """A step laid out for the model, and what ``sample`` needs to read its logits back."""
    input: StepInput
    sample_entries: list[int] = field(default_factory=list)  # entry index, in logits-row order
    num_sampled_rows: int = 0  # logits rows of sampling positions (scored rows follow)
    scorings: list[PromptScoring] = field(default_factory=list)
    pooling: list[PoolingEntry] = field(default_factory=list)
    hidden_rows: list[int] = field(default_factory=list)  # flat tokens whose hidden states pool


def model_kv_cache_groups(config: ModelConfig) -> tuple[KVCacheGroup, ...]:
    """The KV-cache groups of ``config``'s layers (``kv_cache_groups`` of its attention windows);
    ``()``, the default layout of one group of every layer, where they form one group."""
    groups = kv_cache_groups(config.attention_windows)
    return groups if len(groups) > 1 else ()


class ModelRunner:
    def __init__(self, loaded: LoadedModel, device: torch.device, seed: int = 0,
                 max_num_seqs: int = 64, cuda_graphs: bool = False,
                 trim_after_long_steps: bool = False) -> None:
        """``cuda_graphs``: replay decode steps from CUDA graphs (on CUDA, one process, with a
        backend that ``captures_decode``; eager steps elsewhere)."""
        self.model = loaded.model
        self.config = loaded.config
        self.backend = loaded.kernels.backend
        self.device, self.dtype = device, self.model.dtype
        layer = self.model.layers[0]  # this rank's shapes
        self.num_kv_heads = layer.num_kv_heads
        self.num_queries_per_kv = layer.num_heads // layer.num_kv_heads
        self.max_num_seqs = max_num_seqs
        self.kv_cache_groups = model_kv_cache_groups(self.config)
        self.layer_slots = layer_slots(self.kv_cache_groups, self.config.num_layers)
        self.use_cuda_graphs = (cuda_graphs and device.type == "cuda"
                                and self.backend.captures_decode)
        # eager decode steps (with graphs off too) plan as the graph they would pad to
        self.backend.plan_decode(self.config.max_position_embeddings, self.config.num_kv_heads,
                                 graph_batch_sizes(max_num_seqs))
        self.trim_after_long_steps = trim_after_long_steps
        self.sampler = Sampler(seed, self.config.eos_token_ids)
        self.pooler = Pooler()
        self.kv_cache: KVCache | None = None
        self.graphs: CudaGraphRunner | None = None
        self.lora_slot_of: Mapping[int, int] | None = None  # adapter -> slot (enable_lora)
        self.structured_outputs: Any = None  # conveyor.structured_outputs' manager, once used
        self.speculative: SpeculativeConfig | None = None  # with its proposer (use_proposer)
        self.proposer: Proposer | None = None

    def use_proposer(self, speculative: SpeculativeConfig, proposer: Proposer) -> None:
        """Propose ``speculative.num_speculative_tokens`` tokens after each step."""
        self.speculative, self.proposer = speculative, proposer

    def init_cache(self, block_size: int, num_blocks: int, num_cpu_blocks: int,
                   dtype: torch.dtype) -> None:
        c = self.config
        self.kv_cache = self.graphs = None  # the old one's memory goes first
        groups = self.kv_cache_groups
        self.kv_cache = KVCache(layers_per_group(groups, c.num_layers), self.num_kv_heads,
                                c.head_dim, block_size, num_blocks, num_cpu_blocks, dtype,
                                self.device,
                                [s for _, s in self.layer_slots] if groups else None)
        if self.use_cuda_graphs:
            width = -(-c.max_position_embeddings // block_size)
            self.graphs = CudaGraphRunner(self._decode_forward, self.max_num_seqs, width,
                                          self.device, max(1, len(groups)))

    def enable_lora(self, num_slots: int, max_rank: int,
                    slot_of: Mapping[int, int] | None = None) -> None:
        """``slot_of``: which slot each adapter sits in (rank 0: the engine's ``LoRAPool``)."""
        self.model.enable_lora(num_slots, max_rank)
        self.lora_slot_of = slot_of

    def set_lora_slot(self, slot: int,
                      weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]],
                      scale: float) -> None:
        self.model.set_lora_slot(slot, weights, scale)

    # -- a step on every rank -------------------------------------------------------------

    def forward(self, step: StepInput, hidden_indices: list[int] | None = None) -> Any:
        """``step``'s block operations and one forward: the logits of ``step.logits_indices``
        (None when nothing was computed, or off rank 0 under tensor parallelism); with
        ``hidden_indices`` (rank 0 only: every rank holds the whole hidden state), ``(logits,
        hidden)`` as the model returns them."""
        cache = self.kv_cache
        if cache is None:
            raise RuntimeError("the KV cache must be initialized before a step runs")
        cache.swap_out(step.swap_out)
        cache.swap_in(step.swap_in)
        cache.copy(step.copy)
        if not step.input_ids:
            return None
        lora = self.model.lora
        if lora is not None:
            lora.set_slots([slot for slot, count in zip(step.lora_slots, step.counts, strict=True)
                            for _ in range(count)] if step.lora_slots else [], self.device)
        n = len(step.counts)
        if (self.graphs is not None and hidden_indices is None and max(step.counts) == 1
                and (lora is None or not lora.active)
                and self.graphs.serves(n, max(len(t) for t in step.block_tables))):
            logits = self.graphs.run(step.input_ids, step.starts, step.block_tables,
                                     cache.block_size, step.group_tables)
            return logits[torch.tensor(step.logits_indices, device=self.device)]
        meta = self.backend.build_metadata(step.block_tables, step.starts, step.counts,
                                           cache.block_size, self.num_queries_per_kv, self.dtype)
        if step.group_tables:  # a hybrid cache: each group's tables, slots and metadata
            self._per_layer(meta, [
                self.backend.build_metadata(tables, step.starts, step.counts, cache.block_size,
                                            self.num_queries_per_kv, self.dtype)
                for tables in step.group_tables])
        hidden = (None if hidden_indices is None
                  else torch.tensor(hidden_indices, device=self.device))
        out = self.model(torch.tensor(step.input_ids, device=self.device), meta.positions,
                         cache.layers, meta, torch.tensor(step.logits_indices, device=self.device),
                         hidden)
        if self.trim_after_long_steps and len(step.input_ids) > TRIM_AFTER_TOKENS:
            return_freed_memory()  # the step's activations are freed once the caller is done
        return out

    def _per_layer(self, meta: StepMetadata, others: list[StepMetadata]) -> None:
        """Give ``meta`` (group 0's) every layer's metadata: its group's, ``others`` being
        groups 1..G-1's."""
        by_group = [meta, *others]
        meta.layer_metadata = [by_group[g] for g, _ in self.layer_slots]

    def _decode_forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                        slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                        seq_lens: torch.Tensor, group_slot_mapping: torch.Tensor | None = None,
                        group_block_tables: torch.Tensor | None = None) -> torch.Tensor:
        """The forward a CUDA graph captures: a decode step over the graphs' static inputs
        (with several KV-cache groups, groups 1..G-1's slots and tables too)."""
        decode_metadata = self.backend.decode_metadata
        meta = decode_metadata(slot_mapping, positions, block_tables, seq_lens)
        if group_slot_mapping is not None:
            self._per_layer(meta, [decode_metadata(slots, positions, tables, seq_lens)
                                   for slots, tables in zip(group_slot_mapping,
                                                            group_block_tables, strict=True)])
        rows = torch.arange(input_ids.shape[0], device=self.device)
        return self.model(input_ids, positions, self.kv_cache.layers, meta, rows)

    # -- rank 0: the scheduler's output in, tokens out ------------------------------------

    def prepare(self, so: SchedulerOutput) -> PreparedStep:
        step = PreparedStep(StepInput(swap_out=so.blocks_to_swap_out,
                                        swap_in=so.blocks_to_swap_in, copy=so.blocks_to_copy))
        if so.is_empty:
            return step
        msg = step.input  # the StepInput being laid out
        n = len(so.seqs)
        # A proposal to verify goes as one-token entries (below) where the backend wants them.
        expand = self.backend.proposals_as_decodes
        order = sorted(range(n), key=lambda i: (
            so.num_new_tokens[i] != 1 and not (expand and so.seqs[i].spec_token_ids),
            so.num_new_tokens[i], so.seqs[i].num_computed_tokens))
        logits_indices: list[int] = []
        scored_indices: list[int] = []  # their logits rows follow the sampling ones
        lora_slot_of = self.lora_slot_of  # None: no LoRA
        entry_slots: list[int] = []  # each entry's adapter slot (0: the base model)
        ids = msg.input_ids
        # a hybrid cache: groups 1..G-1's tables, entry by entry (group 0's: block_tables)
        group_tables = msg.group_tables = [[] for _ in self.kv_cache_groups[1:]]
        for i in order:
            seq, count = so.seqs[i], so.num_new_tokens[i]
            start = seq.num_computed_tokens
            lora_slot = lora_slot_of[seq.group.lora_id] if seq.group.lora_id else 0
            if seq.spec_token_ids:  # a decode and its proposal: logits at every token
                ids.extend(so.token_ids(i))
                logits_indices.extend(range(len(ids) - count, len(ids)))
                step.sample_entries.append(i)
                if expand:
                    # as `count` one-token entries over the same blocks: each attends to its
                    # own prefix, and a step of decodes keeps the fused decode path
                    msg.starts.extend(range(start, start + count))
                    msg.counts.extend([1] * count)
                    msg.block_tables.extend([seq.block_tables[0]] * count)
                    if group_tables:
                        for g, tables in enumerate(group_tables, 1):
                            tables.extend([seq.block_tables[g]] * count)
                    entry_slots.extend([lora_slot] * count)
                    continue
            else:
                scoring = positions_to_score(i, seq, start, count)
                if scoring is not None:
                    step.scorings.append(scoring)
                    first = len(ids)
                    scored_indices.extend(range(first, first + len(scoring.targets)))
                if seq.group.pooling_params is not None:
                    step.pooling.append(PoolingEntry(i, seq, len(ids), start, count))
                ids.extend(seq.token_ids[start:start + count])
                if so.num_samples(i) > 0:
                    step.sample_entries.append(i)
                    logits_indices.append(len(ids) - 1)
            msg.starts.append(start)
            msg.counts.append(count)
            msg.block_tables.append(seq.block_tables[0])
            if group_tables:
                for g, tables in enumerate(group_tables, 1):
                    tables.append(seq.block_tables[g])
            entry_slots.append(lora_slot)
        if any(entry_slots):
            msg.lora_slots = entry_slots
        msg.logits_indices = (logits_indices + scored_indices) or [len(ids) - 1]
        step.num_sampled_rows = len(logits_indices)
        step.hidden_rows = self.pooler.rows(step.pooling)
        return step

    def sample(self, so: SchedulerOutput, step: PreparedStep, result: Any) -> ExecutorOutput:
        """The step's output from ``forward``'s ``result`` for ``step``."""
        n = len(so.seqs)
        sampled: list[list[int]] = [[] for _ in range(n)]
        if so.is_empty:
            return ExecutorOutput(sampled_token_ids=[])
        logits, hidden = result if step.hidden_rows else (result, None)
        pooled = self.pooler.pool(step.pooling, hidden) if step.pooling else None
        prompt_lps = None
        if step.scorings:
            prompt_lps = score(logits[step.num_sampled_rows:], step.scorings)
            logits = logits[:step.num_sampled_rows]
        if not step.sample_entries:
            return ExecutorOutput(sampled_token_ids=sampled, prompt_logprobs=prompt_lps,
                                  pooled=pooled)
        logprobs: list[list[dict[int, float]]] = [[] for _ in range(n)]
        rows, repeats = [], []
        proposals: list[Proposal] = []
        manager = self.structured_outputs
        grammar = manager.bitmask(so) if manager is not None else None  # GrammarBitmask
        mask_rows: list[int] = []  # constrained sequences never carry proposals (lookahead.py)
        for i in step.sample_entries:
            seq, k = so.seqs[i], so.num_samples(i)
            if seq.spec_token_ids:
                proposals.append(Proposal(i, len(rows), seq.spec_token_ids))
                rows.extend(proposal_rows(seq))
                repeats.extend([1] * (len(seq.spec_token_ids) + 1))
                mask_rows += [-1] * (len(seq.spec_token_ids) + 1)
                continue
            group = seq.group
            if grammar is not None:
                mask_rows += [grammar.row_of.get(seq.seq_id, -1)] * k
            for s in range(k):
                rows.append(SampleRow(
                    params=group.sampling_params,
                    prompt_token_ids=seq.token_ids[:seq.num_prompt_tokens],
                    output_token_ids=seq.token_ids[seq.num_prompt_tokens:],
                    sample_index=s if k > 1 else seq.index,
                    position=len(seq.token_ids),
                ))
            repeats.append(k)
        if any(r > 1 for r in repeats):
            # output_size: without it a GPU waits for the sum of the repeats
            logits = logits.repeat_interleave(torch.tensor(repeats, device=logits.device), dim=0,
                                              output_size=sum(repeats))
        out = self.sampler(logits, rows,
                           (grammar.bitmask, mask_rows) if grammar is not None else None)
        verified = verify(self.sampler, logits, rows, out.token_ids, proposals) if proposals else {}
        row = 0
        for i in step.sample_entries:
            if i in verified:
                sampled[i] = verified[i]
                row += len(so.seqs[i].spec_token_ids) + 1
                continue
            k = so.num_samples(i)
            sampled[i] = out.token_ids[row:row + k]
            if out.logprobs is not None:
                logprobs[i] = out.logprobs[row:row + k]
            row += k
        return ExecutorOutput(sampled_token_ids=sampled,
                              logprobs=logprobs if out.logprobs is not None else None,
                              prompt_logprobs=prompt_lps, pooled=pooled)

    def propose(self, so: SchedulerOutput, step: PreparedStep,
                sampled: list[list[int]]) -> list[list[int]] | None:
        """After the step: the proposer's tokens to follow each entry's sequence once its
        ``sampled`` tokens are appended (None without speculative decoding)."""
        proposer, spec = self.proposer, self.speculative
        if proposer is None:
            return None
        proposer.follow(step.input)
        drafts: list[list[int]] = [[] for _ in so.seqs]
        chosen = [i for i in step.sample_entries
                  if sampled[i] and (so.num_samples(i) == 1 or so.seqs[i].spec_token_ids)
                  and may_speculate(so.seqs[i])]
        if chosen and spec.enabled_for(len(chosen)):
            seqs = [so.seqs[i] for i in chosen]
            proposals = proposer.propose([seq.token_ids + sampled[i]
                                          for seq, i in zip(seqs, chosen, strict=True)],
                                         [seq.block_tables for seq in seqs],
                                         spec.num_speculative_tokens)
            for i, tokens in zip(chosen, proposals, strict=True):
                drafts[i] = tokens
        return drafts
