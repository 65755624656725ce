"""SchedulerOutput and ExecutorOutput: the data that crosses from the scheduler to an executor and back.

This is the contract between the scheduler and any executor. The scheduler fills ``seqs`` and
``num_new_tokens``; everything else an executor needs per scheduled sequence is read off the
sequence itself, which does not change between ``Scheduler.schedule()`` and
``Scheduler.update()``:

* tokens to compute this step: ``seq.token_ids[start : start + num_new_tokens[i]]`` with
  ``start = seq.num_computed_tokens`` (the position of the first of them), followed, for a
  decode with a speculative proposal, by ``seq.spec_token_ids`` (``token_ids(i)``);
* block tables: ``seq.block_tables[g]`` for each KV-cache group ``g`` of
  ``CacheConfig.kv_cache_groups`` (physical block ids, ``block_size`` tokens each; see below);
* sampling: an entry samples when its chunk reaches the end of the sequence's tokens;
  it samples ``seq.group.sampling_params.n`` tokens when this is the group's first sample
  (the prompt's prefill completing: the parent forks into ``n`` parallel samples), else 1.
  A decode with a proposal is verified instead: it returns the accepted proposed tokens plus
  one more (1 to 1 + len(spec_token_ids) tokens). A pooling request never samples: the chunk
  that reaches the end of its prompt returns its pooled hidden state (``ExecutorOutput.pooled``).

KV-cache groups (``core/kv_cache_spec.py``). Every block of the one pool holds
``layers_per_group`` layers' K/V for ``block_size`` tokens (the KV cache is
``[layers_per_group, 2, num_blocks, block_size, num_kv_heads, head_dim]``). Model layer ``l`` is
(group ``g``, slot ``s``) = ``layer_slots(groups, num_layers)[l]``: it writes and reads the K/V
of position ``p`` at slot ``s`` of block ``seq.block_tables[g][p // block_size]``, offset
``p % block_size``. All of a sequence's tables have the same length. In a sliding-window group
(window ``W``) the entries of blocks that lie wholly before the window of the step's first query
(``p < num_computed_tokens - W + 1``) may be ``NULL_BLOCK`` (-1, ``core/block_manager.py``):
their blocks were given back, and window attention never reads them (the step writes only
positions from ``num_computed_tokens`` on, whose entries are real blocks). With the default
layout (``kv_cache_groups == ()``) there is one full-attention group: ``seq.block_tables[0]``
serves every layer, slot = layer index, and no entry is ``NULL_BLOCK``. Block copies and swaps
move whole blocks (every slot), whichever group owns them.

KV connector (``core/kv_connector/interface.py``): ``kv_connector_metadata`` carries the step's
ops for the connector's runner half; a ``SaveBlock`` reads its block before any block operation
or load of the step writes into the pool. The executor runs a step that carries ops even when no
sequence is scheduled, and returns the runner half's report in ``kv_connector_output``.

Block operations run before the forward, in the order swap out, swap in, copy. A prefix-cache
hit may name a block that an earlier entry of the *same* step computes (identical prompts
admitted together share blocks), so an executor writes each layer's new K/V into the cache
before that layer's attention reads it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from conveyor.core.kv_connector.interface import KVConnectorMetadata, KVConnectorOutput
    from conveyor.core.sequence import Sequence


@dataclass(slots=True)
class SchedulerOutput:
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    # Block operations to run before the forward, in this order: swap out, swap in, copy.
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # (gpu, cpu)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)  # (cpu, gpu)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # (src gpu, dst gpu)
    num_batched_tokens: int = 0
    is_prefill: bool = False  # True when every entry is a prefill chunk
    # Entries [0, num_decodes) are single-token decodes of sequences that already sampled;
    # prefill chunks (which may fork n>1 groups) follow them.
    num_decodes: int = 0
    num_spec_tokens: int = 0  # proposed tokens to verify, over all decodes (core/lookahead.py)
    kv_connector_metadata: KVConnectorMetadata | None = None  # the KV connector's ops

    @property
    def is_empty(self) -> bool:
        return not self.seqs

    def start_position(self, i: int) -> int:
        return self.seqs[i].num_computed_tokens

    def token_ids(self, i: int) -> list[int]:
        seq = self.seqs[i]
        start = seq.num_computed_tokens
        spec = seq.spec_token_ids
        if spec:
            return seq.token_ids[start:] + spec
        return seq.token_ids[start : start + self.num_new_tokens[i]]

    def num_samples(self, i: int) -> int:
        """How many tokens entry ``i`` samples from its last position's logits (0, 1 or n)."""
        seq = self.seqs[i]
        if seq.num_computed_tokens + self.num_new_tokens[i] < len(seq.token_ids):
            return 0
        group = seq.group
        if group.pooling_params is not None:
            return 0
        if len(seq.token_ids) == seq.num_prompt_tokens and len(group.seqs) == 1:
            return group.sampling_params.n
        return 1


@dataclass(slots=True)
class ExecutorOutput:
    """What an executor returns for one SchedulerOutput.

    ``sampled_token_ids[i]`` holds ``SchedulerOutput.num_samples(i)`` tokens for entry i (a
    verified proposal: its accepted tokens and the one after them).
    ``logprobs[i]`` (when any request asked for logprobs, else None) holds, per sampled token,
    a dict ``{token_id: logprob}`` with the sampled token and the top-N alternatives.
    """

    sampled_token_ids: list[list[int]]
    logprobs: list[list[dict[int, float]]] | None = None
    # entry i -> (position of the first prompt token scored, per scored prompt token
    # {token_id: (logprob, rank)} with the actual token and the top-N), for the requests that
    # asked for prompt_logprobs
    prompt_logprobs: dict[int, tuple[int, list[dict[int, tuple[float, int]]]]] | None = None
    # entry i -> the pooled vector of a pooling request whose prompt this step completed
    pooled: dict[int, list[float]] | None = None
    # per entry, the tokens proposed after this step to verify in its next (empty: none);
    # None without speculative decoding (Scheduler.update_draft_token_ids)
    draft_token_ids: list[list[int]] | None = None
    # the KV connector's runner half: loads finished, stored blocks lost (None: no connector)
    kv_connector_output: KVConnectorOutput | None = None
