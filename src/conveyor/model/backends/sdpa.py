"""``TorchBackend``: plain torch on any device, the backend where no kernel of this project
serves (``CONVEYOR_KERNELS=off``, no compiler, float16 on the CPU, a CUDA model without Triton).

Attention: a step's entries are split into groups, each attended with one
``scaled_dot_product_attention`` call per layer: decode groups of up to ``DECODE_GROUP_SIZE``,
then prefill groups (entries of similar length together, see ``_prefill_ranges``). For each
group, keys and values are gathered a whole block at a time through the ``[B, blocks]`` block
table and an additive mask (0 or -inf, in the model's dtype, built once per step rather than
converted from bool by every layer's call) hides padding and future positions. Grouped-query
attention is done without repeating K/V: the ``g`` query heads that share a KV head are folded
into the query-length axis, ``[B, kv_heads, Q * g, head_dim]``.

A sliding-window layer's group gathers each entry's blocks from the one holding its first
query's window start on (``AttentionGroup.window_view``, built once per step and window): the
blocks before it are never read, and the mask hides the positions of the gathered blocks that
are outside a query's window.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from conveyor.model.backends.base import Backend, StepMetadata, output_buffer
from conveyor.model.kernels.fused_ops import packed_heads

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
    # On the CPU, for window_view: each entry's first position computed, its count, its whole
    # block table (padding: 0), and the block size and query heads per KV head
    starts: torch.Tensor | None = None
    counts: torch.Tensor | None = None
    tables: torch.Tensor | None = None
    block_size: int = 0
    num_queries_per_kv: int = 1
    _rows: dict[tuple[str | int, ...], torch.Tensor] = field(default_factory=dict, repr=False)
    _windows: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict,
                                                                   repr=False)

    def window_view(self, window: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(block table, additive mask) of a layer whose tokens attend to the last ``window``
        positions: each entry's row of blocks starts at the block of its first query's window
        start (padding: its last block), the mask hides what is outside each query's window.
        Every such
        layer of a step has the same, so it is built once."""
        if window in self._windows:
            return self._windows[window]
        bs = self.block_size
        ctx = self.starts + self.counts
        if int(ctx.max()) <= window:  # no query's window leaves out any position
            self._windows[window] = (self.block_table, self.mask)
            return self._windows[window]
        first = torch.clamp(self.starts - window + 1, min=0) // bs  # [B] first block read
        last = (ctx + bs - 1) // bs  # [B] blocks up to the context's end
        width = int((last - first).max())
        cols = first[:, None] + torch.arange(width)[None, :]  # [B, width] columns of the table
        # padding repeats the entry's last block (one it reads anyway; masked as future)
        table = self.tables.gather(1, torch.minimum(cols, last[:, None] - 1))
        key_pos = (cols[:, :, None] * bs + torch.arange(bs)).reshape(len(cols), 1, -1)
        q_off = torch.arange(self.max_query_len)[None, :]
        # a padding query slot takes its entry's last position: its row then sees something
        q_pos = (self.starts[:, None] + torch.minimum(q_off, self.counts[:, None] - 1))[:, :, None]
        visible = (key_pos <= q_pos) & (key_pos > q_pos - window)  # [B, Q, C]
        visible = visible.repeat_interleave(self.num_queries_per_kv, dim=1)[:, None]
        mask = torch.zeros(visible.shape, dtype=self.mask.dtype).masked_fill_(~visible,
                                                                              float("-inf"))
        device = self.block_table.device
        self._windows[window] = (table.to(torch.int64).to(device), mask.to(device))
        return self._windows[window]

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
class GroupedMetadata(StepMetadata):
    groups: list[AttentionGroup] = field(default_factory=list)


def num_leading_decodes(counts: list[int]) -> int:
    """How many entries at the front compute one token each."""
    n = 0
    while n < len(counts) and counts[n] == 1:
        n += 1
    return n


def slots_and_positions(block_tables: list[list[int]], starts: list[int], counts: list[int],
                        block_size: int) -> tuple[list[int], list[int]]:
    """Each new token's cache slot and position, entry by entry."""
    slots, positions = [], []
    for table, start, count in zip(block_tables, starts, counts, strict=True):
        for pos in range(start, start + count):
            slots.append(table[pos // block_size] * block_size + pos % block_size)
            positions.append(pos)
    return slots, positions


def table_tensor(block_tables: list[list[int]], dtype: torch.dtype) -> torch.Tensor:
    """[entries, longest table] on the host, padded with block 0; a ``NULL_BLOCK`` (-1) entry
    (a block wholly before a sliding window, given back) becomes block 0 too: window attention
    never reads it, and an index into the cache stays valid."""
    width = max(len(t) for t in block_tables)
    return torch.tensor([t + [0] * (width - len(t)) for t in block_tables],
                        dtype=dtype).clamp_(min=0)


class TorchBackend(Backend):
    name = "torch"

    def build_metadata(self, block_tables: list[list[int]], starts: list[int],
                       counts: list[int], block_size: int, num_queries_per_kv: int,
                       dtype: torch.dtype) -> GroupedMetadata:
        """The decodes are attended in groups of ``DECODE_GROUP_SIZE``, each padded to its own
        longest context: with decodes sorted by context length, little of the padding is
        computed."""
        num_decode = num_leading_decodes(counts)
        if any(n == 1 for n in counts[num_decode:]):
            raise ValueError("entries must be ordered with single-token entries first")
        slots, positions = slots_and_positions(block_tables, starts, counts, block_size)
        table = table_tensor(block_tables, torch.int64)
        start_t = torch.tensor(starts, dtype=torch.int64)
        new_t = torch.tensor(counts, dtype=torch.int64)
        groups = []
        token_start = 0
        ranges = [(lo, min(lo + DECODE_GROUP_SIZE, num_decode))
                  for lo in range(0, num_decode, DECODE_GROUP_SIZE)]
        if num_decode < len(counts):
            ranges += _prefill_ranges(starts, counts, num_decode)
        for lo, hi in ranges:
            g_tab, g_start, g_new = table[lo:hi], start_t[lo:hi], new_t[lo:hi]
            batch, max_q = hi - lo, int(g_new.max())
            ctx = g_start + g_new
            num_blocks = (int(ctx.max()) + block_size - 1) // block_size
            key_pos = torch.arange(num_blocks * block_size)[None, :]
            q_off = torch.arange(max_q)[None, :]
            q_valid = q_off < g_new[:, None]  # [B, Q]
            q_pos = torch.where(q_valid, g_start[:, None] + q_off, 0)
            mask = key_pos[:, None, :] <= q_pos[:, :, None]  # causal, [B, Q, C]; covers padding
            mask = mask.repeat_interleave(num_queries_per_kv, dim=1)[:, None]
            mask = torch.zeros(mask.shape, dtype=dtype).masked_fill_(~mask, float("-inf"))
            n_tok = int(g_new.sum())
            first = token_start + torch.cumsum(g_new, 0) - g_new
            query_tokens = torch.where(q_valid, first[:, None] + q_off, token_start)
            real_slots = (torch.arange(batch)[:, None] * max_q + q_off)[q_valid]
            device = self.device
            groups.append(AttentionGroup(batch, max_q, token_start, n_tok,
                                         g_tab[:, :num_blocks].contiguous().to(device),
                                         mask.to(device), query_tokens.to(device),
                                         real_slots.to(device), g_start, g_new, g_tab,
                                         block_size, num_queries_per_kv))
            token_start += n_tok
        return GroupedMetadata(torch.tensor(slots, device=self.device),
                               torch.tensor(positions, device=self.device), groups)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None,
                 out: torch.Tensor | None = None) -> torch.Tensor:
        if residual is not None:
            x = residual.add_(x)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        return weight * x.to(dtype)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def gelu_tanh_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up

    def rotary(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               out: torch.Tensor | None = None) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  k_cache: torch.Tensor, v_cache: torch.Tensor, meta: GroupedMetadata,
                  out: torch.Tensor | None = None, window: int | None = None,
                  scale: float | None = None) -> torch.Tensor:
        """Each group is gathered straight into SDPA's [B, kv_heads, Q * g, head_dim] layout,
        and its output straight into its rows of the result: one copy each way, with
        ``index_select`` (whole head_dim rows; advanced indexing would go element by
        element)."""
        num_tokens, num_heads, head_dim = q.shape
        kv_heads = k.shape[1]
        g = num_heads // kv_heads
        flat_k = k_cache.view(-1, kv_heads, head_dim)
        flat_v = v_cache.view(-1, kv_heads, head_dim)
        flat_k.index_copy_(0, meta.slot_mapping, k.to(k_cache.dtype))  # .to: no-op unless a
        flat_v.index_copy_(0, meta.slot_mapping, v.to(v_cache.dtype))  # bf16 cache under fp32
        if not packed_heads(q) or q.stride(0) % head_dim:  # rows of whole heads, for q_rows
            q = q.contiguous()
        rows_per_token = q.stride(0) // head_dim
        q_rows = q.as_strided(((num_tokens - 1) * rows_per_token + num_heads, head_dim),
                              (head_dim, 1))
        out = output_buffer(out, (num_tokens, num_heads * head_dim), q)
        for grp in meta.groups:
            b, nq = grp.batch, grp.max_query_len
            qg = q_rows.index_select(0, grp.query_rows(rows_per_token, kv_heads, g))
            table, mask = (grp.block_table, grp.mask) if window is None else grp.window_view(window)
            blocks = table.reshape(-1)
            keys = k_cache.index_select(0, blocks).view(b, -1, kv_heads, head_dim).transpose(1, 2)
            values = v_cache.index_select(0, blocks).view(b, -1, kv_heads, head_dim).transpose(1, 2)
            keys, values = keys.to(q.dtype), values.to(q.dtype)
            o = F.scaled_dot_product_attention(qg.view(b, kv_heads, nq * g, head_dim), keys,
                                               values, attn_mask=mask, scale=scale)
            rows = out[grp.token_start: grp.token_start + grp.num_tokens].view(-1, head_dim)
            torch.index_select(o.reshape(-1, head_dim), 0, grp.output_rows(kv_heads, g), out=rows)
        return out


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
