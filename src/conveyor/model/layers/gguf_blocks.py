"""A quantized weight as a GGUF file stores it: the one form the loader parses a tensor into,
from which every format packs its own layout (``layers/block_method.py``). The types: Q4_0,
Q4_1, Q8_0 (blocks of 32 weights, 4-bit or 8-bit codes, an fp16 scale, Q4_1 an fp16 minimum),
Q5_0 and Q5_1 (5-bit codes) and the K-quants Q4_K, Q5_K, Q6_K (super-blocks of 256 weights with
6-bit or 8-bit sub-block scales and fp16 super-scales), which Q4_K_M files are made of.

* ``GGUFBlocks``: a weight as the file stores it, one ``GGUFPart`` per run of rows of one type
  (a stacked projection may mix types: Q4_K_M files keep some V projections in Q6_K beside
  Q4_K queries and keys). ``dequantize`` equals gguf's, bit for bit; ``rows`` serves embedding
  lookups; ``int_blocks`` gives a Q4_0 / Q4_1 / Q8_0 weight's codes and scales to
  ``layers/quantized.py``'s layouts (``GGUFBlocks.of`` the way back).
* ``QuantPanels``: the same bytes repacked by panels of ``panel_width()`` outputs (none added
  where the outputs fill whole panels) for ``kernels/quant_panels.cpp``, which gives the panel
  GEMM's bits over the dequantized weight, whatever the number of rows: ``BlockMethod``'s small
  format for these types, in deterministic inference and out of it.

Every one of these types dequantizes, per sub-block of 16 or 32 weights, from an unsigned code
``u`` of at most 8 bits and float32 ``s``, ``m`` computed from the block's scale bytes as gguf
computes them: ``w = u s + m`` (Q4_1, Q5_1, Q4_K, Q5_K: ``u s`` is exact, so one rounding gives
gguf's weight) or ``w = (u - OFFSETS[type]) s`` (the others: exact, signed zeros included).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from conveyor.model.kernels.build import kernel_ops
from conveyor.model.kernels.panel_gemm import panel_gemm_available, panel_width
from conveyor.model.layers.quantized import BF16_MAX_TOKENS, GROUP, Int4Blocks, Int8Blocks

# GGUF's type ids (GGMLQuantizationType).
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K = 2, 3, 6, 7, 8, 12, 13, 14
NAMES = {Q4_0: "Q4_0", Q4_1: "Q4_1", Q5_0: "Q5_0", Q5_1: "Q5_1", Q8_0: "Q8_0", Q4_K: "Q4_K",
         Q5_K: "Q5_K", Q6_K: "Q6_K"}
# The code each type's zero sits at, where it has no minimum.
OFFSETS = {Q4_0: 8, Q5_0: 16, Q8_0: 128, Q6_K: 32}


@dataclass(frozen=True)
class Layout:
    block: int  # weights per block along K
    sub: int  # weights per sub-block (one s, one m)
    block_bytes: int  # the file's bytes per block
    header: tuple[int, int]  # the block's scale bytes [start, stop)
    bits: int  # code bits per weight


LAYOUTS = {
    Q4_0: Layout(32, 32, 18, (0, 2), 4),
    Q4_1: Layout(32, 32, 20, (0, 4), 4),
    Q5_0: Layout(32, 32, 22, (0, 2), 5),
    Q5_1: Layout(32, 32, 24, (0, 4), 5),
    Q8_0: Layout(32, 32, 34, (0, 2), 8),
    Q4_K: Layout(256, 32, 144, (0, 16), 4),
    Q5_K: Layout(256, 32, 176, (0, 16), 5),
    Q6_K: Layout(256, 16, 210, (192, 210), 6),
}


def _split_header(blocks: torch.Tensor, layout: Layout) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., block bytes] -> a block's scale bytes and the rest (its codes)."""
    start, stop = layout.header
    codes = blocks[..., :start] if start else blocks[..., stop:]
    return blocks[..., start:stop], codes


def _half(b: torch.Tensor) -> torch.Tensor:
    """[..., 2] little-endian fp16 bytes -> [...] float32."""
    return b.contiguous().view(torch.float16)[..., 0].float()


def _nibbles(b: torch.Tensor) -> torch.Tensor:
    """[..., n] bytes -> [..., 2n]: the low nibbles, then the high ones."""
    return torch.cat([b & 0xF, b >> 4], dim=-1)


def _bits(b: torch.Tensor, width: int, count: int) -> torch.Tensor:
    """[..., n] bytes -> [..., count, n]: field j (``width`` bits) of each byte, j < count."""
    shifts = torch.arange(0, width * count, width, dtype=torch.uint8)
    return (b[..., None, :] >> shifts[:, None]) & ((1 << width) - 1)


def _k_scales(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K: the 8 6-bit scales and minima packed in 12 bytes [..., 12] -> two [..., 8]."""
    d, m, md = h[..., 0:4], h[..., 4:8], h[..., 8:12]
    sc = torch.cat([d & 63, (md & 0xF) | ((d >> 6) << 4)], dim=-1)
    mn = torch.cat([m & 63, (md >> 4) | ((m >> 6) << 4)], dim=-1)
    return sc, mn


def _decode(kind: int, raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A type's blocks [R, nb, block_bytes] -> codes u [R, nb * block] uint8 and s, m
    [R, nb, block / sub] float32 (m None for the types of ``OFFSETS``)."""
    rows, nb, _ = raw.shape
    if kind in (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0):
        d = _half(raw[..., 0:2])[..., None]
        if kind == Q8_0:
            u = (raw[..., 2:].view(torch.int8).to(torch.int16) + 128).to(torch.uint8)
            return u.reshape(rows, -1), d, None
        head = 4 if kind in (Q4_1, Q5_1) else 2
        u = _nibbles(raw[..., -16:])
        if kind in (Q5_0, Q5_1):
            u = u | (_bits(raw[..., head:head + 4], 1, 8).transpose(-1, -2).reshape(rows, nb, 32) << 4)
        return u.reshape(rows, -1), d, _half(raw[..., 2:4])[..., None] if head == 4 else None
    if kind in (Q4_K, Q5_K):
        d, dmin = _half(raw[..., 0:2])[..., None], _half(raw[..., 2:4])[..., None]
        sc, mn = _k_scales(raw[..., 4:16])
        qs = raw[..., -128:].reshape(rows, nb, 4, 32)
        u = torch.stack([qs & 0xF, qs >> 4], dim=3).reshape(rows, nb, 8, 32)
        if kind == Q5_K:
            u = u | (_bits(raw[..., 16:48], 1, 8) << 4)
        return u.reshape(rows, -1), d * sc.float(), -(dmin * mn.float())
    if kind == Q6_K:
        ql = raw[..., 0:128].reshape(rows, nb, 2, 64)
        low = torch.stack([ql & 0xF, ql >> 4], dim=3).reshape(rows, nb, 256)
        high = _bits(raw[..., 128:192].reshape(rows, nb, 2, 32), 2, 4).reshape(rows, nb, 256)
        s = _half(raw[..., 208:210])[..., None] * raw[..., 192:208].view(torch.int8).float()
        return (low | (high << 4)).reshape(rows, -1), s, None
    raise ValueError(f"no GGUF blocks of type {kind}")


@dataclass
class GGUFPart:
    """Rows of a weight in one GGUF type: the file's bytes, [rows, K / block * block_bytes]."""
    kind: int
    data: torch.Tensor  # uint8

    @property
    def layout(self) -> Layout:
        return LAYOUTS[self.kind]

    @property
    def in_features(self) -> int:
        return self.data.shape[1] // self.layout.block_bytes * self.layout.block

    def blocks(self) -> torch.Tensor:
        return self.data.view(self.data.shape[0], -1, self.layout.block_bytes)

    def lane_panels(self, lanes: int) -> torch.Tensor:
        """The bytes by panels of ``lanes`` outputs for ``kernels/int8_blocks.cpp`` (its header
        describes the layout): [rows rounded up to whole panels, the same bytes per row], each
        panel's blocks in turn, per block the scale bytes as [units of 2][lanes][2], then the
        code bytes as [groups of 4][lanes][4]. A permutation of the file's bytes (the last panel
        padded with zeros); ``from_lane_panels`` inverts it."""
        layout, rows = self.layout, self.data.shape[0]
        blocks = F.pad(self.blocks(), (0, 0, 0, 0, 0, -rows % lanes))
        panels, nb = blocks.shape[0] // lanes, blocks.shape[1]
        blocks = blocks.view(panels, lanes, nb, layout.block_bytes).transpose(1, 2)
        header, codes = _split_header(blocks, layout)
        header = header.reshape(panels, nb, lanes, -1, 2).transpose(2, 3)
        codes = codes.reshape(panels, nb, lanes, -1, 4).transpose(2, 3)
        out = torch.cat([header.reshape(panels, nb, -1), codes.reshape(panels, nb, -1)], dim=-1)
        return out.reshape(panels * lanes, -1).contiguous()

    @staticmethod
    def from_lane_panels(kind: int, packed: torch.Tensor, rows: int, lanes: int) -> GGUFPart:
        layout = LAYOUTS[kind]
        panels = packed.shape[0] // lanes
        out = packed.view(panels, -1, lanes * layout.block_bytes)
        nb = out.shape[1]
        start, stop = layout.header
        split = (stop - start) * lanes
        header = out[..., :split].reshape(panels, nb, -1, lanes, 2).transpose(2, 3)
        codes = out[..., split:].reshape(panels, nb, -1, lanes, 4).transpose(2, 3)
        header = header.reshape(panels, nb, lanes, -1)
        codes = codes.reshape(panels, nb, lanes, -1)
        parts = [codes, header] if start else [header, codes]
        blocks = torch.cat(parts, dim=-1).transpose(1, 2).reshape(panels * lanes, -1)
        return GGUFPart(kind, blocks[:rows].contiguous())

    def dequantize(self) -> torch.Tensor:
        """[rows, K] float32, gguf's dequantization bit for bit."""
        u, s, m = _decode(self.kind, self.blocks())
        rows, nb, subs = s.shape
        u = u.view(rows, nb, subs, -1).float()
        w = (u - OFFSETS[self.kind]) * s[..., None] if m is None else u * s[..., None] + m[..., None]
        return w.view(rows, -1)


@dataclass
class GGUFBlocks:
    """A [N, K] weight in a GGUF file's bytes, its rows in runs of one type each."""
    parts: list[GGUFPart]

    @staticmethod
    def from_file(kind: int, data: torch.Tensor) -> GGUFBlocks:
        if kind not in LAYOUTS:
            raise ValueError(f"no GGUF blocks of type {kind}")
        if data.dtype != torch.uint8 or data.dim() != 2 or data.shape[1] % LAYOUTS[kind].block_bytes:
            raise ValueError(f"{NAMES[kind]} rows must be uint8 [rows, a multiple of "
                             f"{LAYOUTS[kind].block_bytes}] bytes, got {data.dtype} {list(data.shape)}")
        return GGUFBlocks([GGUFPart(kind, data.contiguous())])

    @staticmethod
    def of(blocks: Int4Blocks | Int8Blocks | GGUFBlocks) -> GGUFBlocks | None:
        """Q4_0 / Q4_1 / Q8_0 blocks back in the file's bytes (4-bit ones as Q4_0 where their
        minimum is -8 times their scale, else as Q4_1: the same weights), so that they stack
        with other types; None where a value is no fp16."""
        if isinstance(blocks, GGUFBlocks):
            return blocks
        n = blocks.codes.shape[0]
        if isinstance(blocks, Int8Blocks):
            codes, kind = blocks.codes.view(torch.uint8).view(n, -1, GROUP), Q8_0
            values = [blocks.scale]
        else:
            q = blocks.codes.view(n, -1, 2, GROUP // 2)
            codes = q[:, :, 0] | (q[:, :, 1] << 4)
            if torch.equal(blocks.min, -8 * blocks.scale):
                kind, values = Q4_0, [blocks.scale]
            else:
                kind, values = Q4_1, [blocks.scale, blocks.min]
        head = [v.half() for v in values]
        if any(not torch.equal(h.float(), v.float()) for h, v in zip(head, values, strict=True)):
            return None
        heads = [h.contiguous().view(torch.uint8).view(n, -1, 2) for h in head]
        return GGUFBlocks([GGUFPart(kind, torch.cat([*heads, codes], dim=-1).reshape(n, -1))])

    @staticmethod
    def cat(parts: list[GGUFBlocks]) -> GGUFBlocks:
        """Stack along the output axis; neighbouring rows of one type join one part."""
        out: list[GGUFPart] = []
        for p in (q for b in parts for q in b.parts):
            if out and out[-1].kind == p.kind:
                out[-1] = GGUFPart(p.kind, torch.cat([out[-1].data, p.data]))
            else:
                out.append(p)
        return GGUFBlocks(out)

    @property
    def out_features(self) -> int:
        return sum(p.data.shape[0] for p in self.parts)

    def check_shape(self, rows: int, columns: int) -> None:
        """ValueError unless the weight is [rows, columns] (a checkpoint tensor's slot)."""
        if (self.out_features, self.in_features) != (rows, columns):
            raise ValueError(f"got blocks of shape ({self.out_features}, {self.in_features}), "
                             f"expected ({rows}, {columns})")

    @property
    def in_features(self) -> int:
        return self.parts[0].in_features

    def dequantize(self) -> torch.Tensor:
        return torch.cat([p.dequantize() for p in self.parts])

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Dequantized rows ``ids`` (an embedding lookup): [len(ids), K] in ``dtype``."""
        if len(self.parts) == 1:
            p = self.parts[0]
            return GGUFPart(p.kind, p.data[ids.cpu()]).dequantize().to(ids.device, dtype)
        return self.dequantize()[ids.cpu()].to(ids.device, dtype)

    def nbytes(self) -> int:
        return sum(p.data.numel() for p in self.parts)


def stack_blocks(parts: list[GGUFBlocks | None]) -> GGUFBlocks | None:
    """A stacked projection's blocks from its parts' (None: not all of them have blocks)."""
    if not parts or any(p is None for p in parts):
        return None
    return GGUFBlocks.cat(parts)


def int_blocks(blocks: GGUFBlocks) -> Int4Blocks | Int8Blocks | None:
    """A weight of one 4-bit (Q4_0 / Q4_1) or 8-bit (Q8_0) type as codes and float32 scales
    (and minimums) for ``layers/quantized.py``'s layouts; None for other types and mixes."""
    if len(blocks.parts) != 1 or blocks.parts[0].kind not in (Q4_0, Q4_1, Q8_0):
        return None
    part = blocks.parts[0]
    raw = part.blocks()
    if part.kind == Q8_0:  # the codes are the file's bytes: one copy of them, nothing wider
        codes = raw[..., 2:].contiguous().view(torch.int8).view(raw.shape[0], -1)
        return Int8Blocks(codes, _half(raw[..., 0:2]))
    u, s, m = _decode(part.kind, raw)
    scale = s[..., 0].contiguous()
    return Int4Blocks(u, scale, (-8 * scale) if m is None else m[..., 0].contiguous())


def quant_panel_gemm(x: torch.Tensor, kind: int, codes: torch.Tensor, header: torch.Tensor,
                     n: int) -> torch.Tensor:
    """x [M, K] @ W^T -> [M, n] in x's dtype, W as one ``QuantPanels`` part holds it
    (``torch.ops.conveyor.quant_panel_gemm``)."""
    ops = kernel_ops()
    if ops is None:
        raise RuntimeError("the quant panel GEMM kernel is not available")
    return ops.quant_panel_gemm(x, kind, codes, header, n)


@dataclass
class PanelPart:
    """One ``GGUFPart`` by panels of ``width`` outputs: per panel, ``codes`` [P, K, width *
    bits / 8] (each k's outputs: a plane of nibbles, byte t = outputs t and width / 2 + t, then
    the bits above 4: a second plane for 8 bits, else each half's fields as a little-endian bit
    string) and ``header`` [P, K / block, width, header bytes] (the file's scale bytes)."""
    kind: int
    codes: torch.Tensor
    header: torch.Tensor
    n_out: int

    @staticmethod
    def pack(part: GGUFPart, width: int) -> PanelPart:
        layout, n = part.layout, part.data.shape[0]
        blocks = F.pad(part.blocks(), (0, 0, 0, 0, 0, -n % width))
        panels, nb = blocks.shape[0] // width, blocks.shape[1]
        u, _, _ = _decode(part.kind, blocks)
        u = u.view(panels, width, -1).transpose(1, 2)  # [P, K, width]
        half = width // 2
        planes = [(u[..., :half] & 0xF) | ((u[..., half:] & 0xF) << 4)]
        if layout.bits == 8:
            planes.append((u[..., :half] >> 4) | ((u[..., half:] >> 4) << 4))
        elif layout.bits > 4:
            h = layout.bits - 4
            shifts = torch.arange(0, half * h, h, dtype=torch.int64)
            for side in (u[..., :half], u[..., half:]):
                word = ((side >> 4).to(torch.int64) << shifts).sum(-1, keepdim=True)
                planes.append(((word >> torch.arange(0, half * h, 8)) & 0xFF).to(torch.uint8))
        start, stop = layout.header
        header = blocks[..., start:stop].view(panels, width, nb, -1).transpose(1, 2)
        return PanelPart(part.kind, torch.cat(planes, dim=-1).contiguous(), header.contiguous(), n)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return quant_panel_gemm(x, self.kind, self.codes, self.header, self.n_out)

    def nbytes(self) -> int:
        return self.codes.numel() + self.header.numel()


@dataclass
class QuantPanels:
    """``GGUFBlocks`` by panels for ``kernels/quant_panels.cpp``: each part's outputs in turn."""
    parts: list[PanelPart]
    # Rows up to which it serves, as BlockPanels (layers/quantized.py).
    max_tokens: int = 12

    @staticmethod
    def fits(dtype: torch.dtype) -> bool:
        """Whether its products equal the dense panels' for ``dtype``: float32 on every build,
        bf16 where the build targets AVX512-BF16 (elsewhere bf16 rows widen to float32)."""
        return panel_gemm_available(dtype)

    @staticmethod
    def pack(blocks: GGUFBlocks, dtype: torch.dtype, deterministic: bool = False,
             width: int | None = None) -> QuantPanels:
        """``deterministic``: serving no rows where its bits would not be the panels'
        (``pack_blocks``' rule). ``width``: the native build's ``panel_width()`` unless given."""
        if dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"block weights run with float32 or bf16 activations, not {dtype}")
        width = width or panel_width()
        packed = QuantPanels([PanelPart.pack(p, width) for p in blocks.parts])
        if deterministic and not QuantPanels.fits(dtype):
            packed.max_tokens = 0
        elif dtype == torch.bfloat16:
            packed.max_tokens = BF16_MAX_TOKENS
        return packed

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        ys = [p.matmul(x) for p in self.parts]
        return ys[0] if len(ys) == 1 else torch.cat(ys, dim=1)

    def nbytes(self) -> int:
        return sum(p.nbytes() for p in self.parts)
