"""Paged attention over block tables, batched: no Python loop over sequences.

A step's tokens are laid out flat, entry by entry: entries computing one token (decodes), then
entries computing a chunk of >1 tokens (prefill, possibly after a cached prefix).

* On the CPU (float32/bf16, a C++ compiler at hand) every token goes to the kernel of
  ``kernels/paged_attention.cpp``: each token attends to its own causal prefix, read straight
  from its sequence's blocks (``KernelBatch``). No padding, no mask, no gathered keys.
* Otherwise (CUDA, float16, no compiler, ``CONVEYOR_KERNELS=off``) entries are split into
  groups, each attended with one ``scaled_dot_product_attention`` call per layer: decode groups
  of up to ``DECODE_GROUP_SIZE``, then prefill groups (entries of similar length together, see
  ``_prefill_ranges``). For each group, keys and values are gathered a whole block at a time
  through the ``[B, blocks]`` block table and an additive mask (0 or -inf, in the model's
  dtype, built once per step rather than converted from bool by every layer's call) hides
  padding and future positions. Grouped-query attention is done without repeating K/V: the
  ``g`` query heads that share a KV head are folded into the query-length axis,
  ``[B, kv_heads, Q * g, head_dim]``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from conveyor.model.kernels.fused_ops import packed_heads
from conveyor.model.kernels.paged_attention import kernel_attention

if TYPE_CHECKING:
    from conveyor.model.layers.triton_attention import TritonBatch

DECODE_GROUP_SIZE = 16
PREFILL_PADDING_LIMIT = 2.0  # a prefill group's padded work may be at most this x its real work


@dataclass
class AttentionGroup:
    batch: int
    max_query_len: int
    token_start: int  # first flat token of this group
    num_tokens: int
    block_table: torch.Tensor  # [B, C / block_size] blocks of each entry's context (padding: 0)
    mask: torch.Tensor  # [B, 1, Q * g, C] additive: 0 = attend, -inf = hidden
    query_tokens: torch.Tensor  # [B, Q] flat token of each query slot (padding: the group's first)
    real_slots: torch.Tensor  # [num_tokens] the slot b * Q + q of each of the group's tokens
    _rows: dict[tuple[str | int, ...], torch.Tensor] = field(default_factory=dict, repr=False)

    def query_rows(self, rows_per_token: int, kv_heads: int, g: int) -> torch.Tensor:
        """Row (token * rows_per_token + head) of each query head in a [rows, head_dim] view of
        q, in the order [B, kv_heads, Q, g] that folds GQA into the query axis. Every layer of a
        step has the same layout, so it is computed once."""
        key = ("q", rows_per_token, kv_heads, g)
        if key not in self._rows:
            heads = torch.arange(kv_heads * g, device=self.query_tokens.device).view(kv_heads, 1, g)
            tokens = self.query_tokens[:, None, :, None] * rows_per_token
            self._rows[key] = (tokens + heads).reshape(-1)
        return self._rows[key]

    def output_rows(self, kv_heads: int, g: int) -> torch.Tensor:
        """For each of the group's tokens and each head h = kv_head * g + i, its row in the
        attention output [B * kv_heads * Q * g, head_dim]."""
        key = ("o", kv_heads, g)
        if key not in self._rows:
            q_len = self.max_query_len
            b, q = self.real_slots // q_len, self.real_slots % q_len
            kvh = torch.arange(kv_heads, device=b.device)[None, :, None]
            i = torch.arange(g, device=b.device)[None, None, :]
            rows = ((b[:, None, None] * kv_heads + kvh) * q_len + q[:, None, None]) * g + i
            self._rows[key] = rows.reshape(-1)
        return self._rows[key]


@dataclass
class KernelBatch:
    """Every token of a step, for the C++ kernel: token t attends to the first
    ``context_lens[t]`` positions of the sequence whose block table is row ``token_seqs[t]``."""
    block_tables: torch.Tensor  # [S, max_blocks] int32 (padding: 0)
    context_lens: torch.Tensor  # [T] int32, the token itself included
    token_seqs: torch.Tensor | None  # [T] int32; None in a decode-only step (token t -> row t)
    deterministic: bool = True  # one arithmetic for every query row (kernel_attention)


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] cache slot where each new token's K/V goes
    positions: torch.Tensor  # [T] position of each new token in its sequence
    kernel: KernelBatch | None  # set when the C++ kernel attends every token
    groups: list[AttentionGroup]  # scaled_dot_product_attention groups, without the kernel
    triton: TritonBatch | None = None  # set on the CUDA path (layers/triton_attention.py)

    @property
    def decode_only(self) -> bool:
        """Every token is a decode, and the kernel serves them."""
        return self.kernel is not None and self.kernel.token_seqs is None


def build_attention_metadata(
    block_tables: list[list[int]],
    starts: list[int],
    num_new: list[int],
    block_size: int,
    num_queries_per_kv: int,
    device: torch.device,
    attention_kernel: bool = False,
    dtype: torch.dtype = torch.float32,
    deterministic: bool = True,
) -> AttentionMetadata:
    """With ``attention_kernel``, one ``KernelBatch`` covers every token, in any entry order.

    Without it, entries must be ordered decode (num_new == 1) first, then prefill chunks. The
    decodes are attended in groups of ``DECODE_GROUP_SIZE``, each padded to its own longest
    context: with decodes sorted by context length, little of the padding is computed.
    """
    num_decode = 0
    while num_decode < len(num_new) and num_new[num_decode] == 1:
        num_decode += 1
    if attention_kernel and num_decode == len(num_new):
        return _decode_only_metadata(block_tables, starts, block_size, device, deterministic)
    if not attention_kernel and any(n == 1 for n in num_new[num_decode:]):
        raise ValueError("entries must be ordered with single-token entries first")
    width = max(len(t) for t in block_tables)
    table = torch.tensor([t + [0] * (width - len(t)) for t in block_tables], dtype=torch.int64)
    start_t = torch.tensor(starts, dtype=torch.int64)
    new_t = torch.tensor(num_new, dtype=torch.int64)

    # Slot of every new token.
    entry_of_token = torch.repeat_interleave(torch.arange(len(num_new)), new_t)
    offset_in_entry = torch.arange(int(new_t.sum())) - torch.repeat_interleave(
        torch.cumsum(new_t, 0) - new_t, new_t)
    pos = start_t[entry_of_token] + offset_in_entry
    slot_mapping = table[entry_of_token, pos // block_size] * block_size + pos % block_size
    if attention_kernel:
        kernel = KernelBatch(table.to(torch.int32).to(device), (pos + 1).to(torch.int32).to(device),
                             entry_of_token.to(torch.int32).to(device), deterministic)
        return AttentionMetadata(slot_mapping.to(device), pos.to(device), kernel, [])

    groups = []
    token_start = 0
    ranges = [(lo, min(lo + DECODE_GROUP_SIZE, num_decode))
              for lo in range(0, num_decode, DECODE_GROUP_SIZE)]
    if num_decode < len(num_new):
        ranges += _prefill_ranges(starts, num_new, num_decode)
    for lo, hi in ranges:
        g_tab, g_start, g_new = table[lo:hi], start_t[lo:hi], new_t[lo:hi]
        batch, max_q = hi - lo, int(g_new.max())
        ctx = g_start + g_new
        num_blocks = (int(ctx.max()) + block_size - 1) // block_size
        key_pos = torch.arange(num_blocks * block_size)[None, :]
        q_off = torch.arange(max_q)[None, :]
        q_valid = q_off < g_new[:, None]  # [B, Q]
        q_pos = torch.where(q_valid, g_start[:, None] + q_off, 0)
        mask = key_pos[:, None, :] <= q_pos[:, :, None]  # causal, [B, Q, C]; covers ctx padding
        mask = mask.repeat_interleave(num_queries_per_kv, dim=1)[:, None]
        mask = torch.zeros(mask.shape, dtype=dtype).masked_fill_(~mask, float("-inf"))
        n_tok = int(g_new.sum())
        first = token_start + torch.cumsum(g_new, 0) - g_new
        query_tokens = torch.where(q_valid, first[:, None] + q_off, token_start)
        real_slots = (torch.arange(batch)[:, None] * max_q + q_off)[q_valid]
        groups.append(AttentionGroup(batch, max_q, token_start, n_tok,
                                     g_tab[:, :num_blocks].contiguous().to(device),
                                     mask.to(device), query_tokens.to(device),
                                     real_slots.to(device)))
        token_start += n_tok
    return AttentionMetadata(slot_mapping.to(device), pos.to(device), None, groups)


def _decode_only_metadata(block_tables: list[list[int]], starts: list[int], block_size: int,
                          device: torch.device, deterministic: bool) -> AttentionMetadata:
    """The same metadata for a step of decodes only, computed in plain Python: the general
    path's dozen small torch ops are a visible part of a single-stream step."""
    slots = [table[p // block_size] * block_size + p % block_size
             for table, p in zip(block_tables, starts, strict=True)]
    width = max(len(t) for t in block_tables)
    table = torch.tensor([t + [0] * (width - len(t)) for t in block_tables], dtype=torch.int32)
    context_lens = torch.tensor([p + 1 for p in starts], dtype=torch.int32)
    kernel = KernelBatch(table.to(device), context_lens.to(device), None, deterministic)
    return AttentionMetadata(torch.tensor(slots, device=device),
                             torch.tensor(starts, device=device), kernel, [])


def _prefill_ranges(starts: list[int], num_new: list[int], lo: int) -> list[tuple[int, int]]:
    """Split the prefill entries ``lo:`` into consecutive groups whose padded work (entries x
    longest query x longest context) stays within ``PREFILL_PADDING_LIMIT`` x their real work
    (sum of query x context). Entries should come sorted by length: one 560-token prompt
    padded together with 63 48-token ones (a shared prefix cached) would do ten times the work.
    """
    ranges, begin = [], lo
    max_q = max_c = real = 0
    for i in range(lo, len(num_new)):
        q, c = num_new[i], starts[i] + num_new[i]
        grown = (max(max_q, q), max(max_c, c), real + q * c)
        if i > begin and (i + 1 - begin) * grown[0] * grown[1] > PREFILL_PADDING_LIMIT * grown[2]:
            ranges.append((begin, i))
            begin, grown = i, (q, c, q * c)
        max_q, max_c, real = grown
    ranges.append((begin, len(num_new)))
    return ranges


def paged_attention(
    q: torch.Tensor,  # [T, num_heads, head_dim]
    k: torch.Tensor,  # [T, num_kv_heads, head_dim]
    v: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Write this step's K/V into the cache, then attend. Returns [T, num_heads * head_dim],
    written into ``out`` when it is a contiguous tensor of that shape and q's dtype.

    q's rows may be strided (a view of the fused QKV output) as long as its heads are packed.
    Without the kernel, each group is gathered straight into SDPA's [B, kv_heads, Q * g, head_dim] layout,
    and its output straight into its rows of the result: one copy each way, with
    ``index_select`` (whole head_dim rows; advanced indexing would go element by element)."""
    num_tokens, num_heads, head_dim = q.shape
    kv_heads = k.shape[1]
    g = num_heads // kv_heads
    if meta.triton is not None:
        from conveyor.model.layers.triton_attention import triton_paged_attention

        return triton_paged_attention(q, k, v, k_cache, v_cache, meta.slot_mapping, meta.triton,
                                      out=out)
    if meta.kernel is not None:  # it writes k and v into the cache too
        kb = meta.kernel
        return kernel_attention(q, k_cache, v_cache, kb.block_tables, kb.context_lens,
                                head_dim ** -0.5, kb.token_seqs, out=out,
                                new_kv=(k, v, meta.slot_mapping),
                                deterministic=kb.deterministic)
    flat_k = k_cache.view(-1, kv_heads, head_dim)
    flat_v = v_cache.view(-1, kv_heads, head_dim)
    flat_k.index_copy_(0, meta.slot_mapping, k.to(k_cache.dtype))  # .to: no-op unless a bf16
    flat_v.index_copy_(0, meta.slot_mapping, v.to(v_cache.dtype))  # cache under float32
    if not packed_heads(q) or q.stride(0) % head_dim:  # rows of whole heads, for q_rows
        q = q.contiguous()
    rows_per_token = q.stride(0) // head_dim
    q_rows = q.as_strided(((num_tokens - 1) * rows_per_token + num_heads, head_dim), (head_dim, 1))
    shape = (num_tokens, num_heads * head_dim)
    if out is None or out.shape != shape or out.dtype != q.dtype or not out.is_contiguous():
        out = torch.empty(shape, dtype=q.dtype, device=q.device)
    for grp in meta.groups:
        b, nq = grp.batch, grp.max_query_len
        qg = q_rows.index_select(0, grp.query_rows(rows_per_token, kv_heads, g))
        blocks = grp.block_table.view(-1)
        keys = k_cache.index_select(0, blocks).view(b, -1, kv_heads, head_dim).transpose(1, 2)
        values = v_cache.index_select(0, blocks).view(b, -1, kv_heads, head_dim).transpose(1, 2)
        keys, values = keys.to(q.dtype), values.to(q.dtype)
        o = F.scaled_dot_product_attention(qg.view(b, kv_heads, nq * g, head_dim), keys, values,
                                           attn_mask=grp.mask)
        rows = out[grp.token_start: grp.token_start + grp.num_tokens].view(-1, head_dim)
        torch.index_select(o.reshape(-1, head_dim), 0, grp.output_rows(kv_heads, g), out=rows)
    return out
