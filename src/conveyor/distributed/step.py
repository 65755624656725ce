"""The message rank 0 sends the other tensor-parallel ranks, and its transport.

A ``STEP`` message carries the ``StepInput`` rank 0's runner prepared (plain integers); it
travels as two int64 broadcasts, a fixed header of counts and one flat payload, so a worker
never sees a Python object of the scheduler's, and each rank's runner runs the ``StepInput`` it
unpacks. Other kinds set the cache up and hold LoRA adapters.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from conveyor.core.step_input import StepInput
from conveyor.distributed.group import LONG_WAIT_S, broadcast

STEP, INIT_CACHE, SHUTDOWN, ENABLE_LORA, LORA_SLOT = 0, 1, 2, 3, 4
# kind, tokens, entries, table width, logits rows, swap-out, swap-in, copy, extra, LoRA slots,
# further KV-cache groups
_HEADER = 11


@dataclass
class StepMessage:
    kind: int = STEP
    step: StepInput = field(default_factory=StepInput)  # STEP: what every rank runs
    # INIT_CACHE: block size, GPU blocks, CPU blocks; ENABLE_LORA: slots, max rank;
    # LORA_SLOT: slot, then (layer, module, rank) per LoRA weight pair (``lora_slot_message``)
    extra: list[int] = field(default_factory=list)

    def pack(self) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.step
        # a sequence's tables have the same length in every group
        width = max((len(t) for t in s.block_tables), default=0)
        header = [self.kind, len(s.input_ids), len(s.starts), width,
                  len(s.logits_indices), len(s.swap_out), len(s.swap_in),
                  len(s.copy), len(self.extra), len(s.lora_slots), len(s.group_tables)]
        flat = list(s.input_ids) + list(s.starts) + list(s.counts)
        for tables in (s.block_tables, *s.group_tables):
            for t in tables:
                flat += list(t) + [0] * (width - len(t))
        flat += list(s.logits_indices)
        for pairs in (s.swap_out, s.swap_in, s.copy):
            flat += [x for pair in pairs for x in pair]
        flat += list(self.extra) + list(s.lora_slots)
        return torch.tensor(header, dtype=torch.int64), torch.tensor(flat, dtype=torch.int64)

    @staticmethod
    def unpack(header: torch.Tensor, payload: torch.Tensor) -> StepMessage:
        (kind, n_tok, n_ent, width, n_log, n_out, n_in, n_copy, n_extra, n_lora,
         n_groups) = header.tolist()
        flat = payload.tolist()
        pos = 0

        def take(n: int) -> list[int]:
            nonlocal pos
            pos += n
            return flat[pos - n:pos]

        def pairs(n: int) -> list[tuple[int, int]]:
            v = take(2 * n)
            return list(zip(v[0::2], v[1::2], strict=True))

        ids, starts, counts = take(n_tok), take(n_ent), take(n_ent)
        tables = [take(width) for _ in range(n_ent)]
        group_tables = [[take(width) for _ in range(n_ent)] for _ in range(n_groups)]
        logits, swap_out, swap_in, copy = take(n_log), pairs(n_out), pairs(n_in), pairs(n_copy)
        extra = take(n_extra)
        step = StepInput(ids, starts, counts, tables, group_tables, logits, swap_out, swap_in,
                         copy, take(n_lora))
        return StepMessage(kind, step, extra)


def send_message(msg: StepMessage) -> None:
    """Rank 0: broadcast ``msg`` to every rank."""
    header, payload = msg.pack()
    broadcast(header, 0)
    broadcast(payload, 0)


def receive_message() -> StepMessage:
    """Other ranks: wait (as long as it takes: an idle server sends nothing) for rank 0's next
    message."""
    header = broadcast(torch.zeros(_HEADER, dtype=torch.int64), 0, LONG_WAIT_S)
    payload = broadcast(torch.zeros(sum(_payload_sizes(header.tolist())), dtype=torch.int64), 0)
    return StepMessage.unpack(header, payload)


def _payload_sizes(h: list[int]) -> list[int]:
    _kind, n_tok, n_ent, width, n_log, n_out, n_in, n_copy, n_extra, n_lora, n_groups = h
    return [n_tok, 2 * n_ent, (1 + n_groups) * n_ent * width, n_log,
            2 * (n_out + n_in + n_copy), n_extra, n_lora]


def lora_slot_message(slot: int, weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]],
                      scale: float, modules: list[str]) -> tuple[StepMessage, torch.Tensor]:
    """Rank 0: the message that puts an adapter in ``slot`` on every rank, and the float32
    payload broadcast after it (the scale, then each pair's whole A and B: every rank takes
    its own shard, ``LlamaForCausalLM.set_lora_slot``); ``modules``: the model's LoRA targets
    (``lora.adapter.module_shapes``), a module sent as its index there."""
    extra, parts = [slot], [torch.tensor([scale])]
    for (layer, module), (a, b) in sorted(weights.items()):
        extra += [layer, modules.index(module), a.shape[0]]
        parts += [a.float().flatten(), b.float().flatten()]
    return StepMessage(kind=LORA_SLOT, extra=extra), torch.cat(parts)


def receive_lora_slot(msg: StepMessage, shapes: dict[str, tuple[int, int]]) -> tuple[
        int, dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]], float]:
    """Other ranks: the float payload of a LORA_SLOT message -> (slot, weights, scale);
    ``shapes``: each module's full (out, in) (``lora.adapter.module_shapes``)."""
    entries, modules = msg.extra[1:], list(shapes)
    pairs = [(layer, modules[m], r) for layer, m, r in zip(*[iter(entries)] * 3, strict=True)]
    size = 1 + sum(r * sum(shapes[module]) for _, module, r in pairs)
    flat = broadcast(torch.zeros(size), 0)
    scale, pos, weights = float(flat[0]), 1, {}
    for layer, module, r in pairs:
        out, inp = shapes[module]
        a = flat[pos:pos + r * inp].view(r, inp)
        b = flat[pos + r * inp:pos + r * (inp + out)].view(out, r)
        pos += r * (inp + out)
        weights[(layer, module)] = (a, b)
    return msg.extra[0], weights, scale
