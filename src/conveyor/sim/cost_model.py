"""Roofline cost of one engine step: how long a batch takes on given hardware.

A step computes ``T`` new tokens for ``B`` sequences (prefill chunks and decode tokens alike).
Per GPU, with tensor parallelism over ``tp`` GPUs dividing both work and bytes:

* compute: linear-layer FLOPs ``2 * T * linear_params`` plus the LM head for the ``S`` sampled
  positions (``2 * S * hidden * vocab``) at ``peak * matmul_efficiency``, plus attention FLOPs
  ``4 * layers * heads * head_dim`` per (query, key) pair at ``peak * attention_efficiency``.
  An entry with ``s`` cached tokens computing ``n`` new ones has ``n*s + n*(n+1)/2`` causal pairs.
* memory: all weights read once, KV read for every entry's context (cached + new tokens) and
  written for the new tokens, at ``bandwidth * memory_efficiency``.
* step time = max(compute, memory) + all-reduce (2 per layer over the interconnect: ring
  all-reduce of ``T * hidden`` bf16 activations) + KV swap over the host link
  + ``step_overhead`` + ``B * per_seq_overhead``.

Activation traffic, embedding lookups, norms and rotary are ignored (small next to the above).

KV memory follows the engine's layout (``core/kv_cache_spec.py``): a model with sliding-window
layers (Gemma 3) has KV-cache groups of ``layers_per_group`` layers over one pool, so a block
holds that many layers' K/V and ``num_gpu_blocks`` counts such blocks; the scheduler's block
manager then admits exactly as the engine's does. KV reads are priced as if every layer read the
whole context (window layers read at most their window: an upper bound for them).
"""

from __future__ import annotations

from dataclasses import dataclass

from conveyor.core.kv_cache_spec import KVCacheGroup, kv_cache_groups, layers_per_group
from conveyor.sim.specs import GB, HardwareSpec, ModelSpec

ACTIVATION_BYTES = 2  # bf16 activations in the all-reduce


@dataclass(frozen=True)
class StepBreakdown:
    flops: float
    bytes: float
    compute_s: float
    memory_s: float
    comm_s: float
    swap_s: float
    overhead_s: float

    @property
    def total_s(self) -> float:
        return max(self.compute_s, self.memory_s) + self.comm_s + self.swap_s + self.overhead_s

    @property
    def bound(self) -> str:
        return "compute" if self.compute_s >= self.memory_s else "memory"


def causal_pairs(num_cached: int, num_new: int) -> int:
    """(query, key) pairs of causal attention for ``num_new`` tokens after ``num_cached``."""
    return num_new * num_cached + num_new * (num_new + 1) // 2


class CostModel:
    """Step times for one model on ``tp`` GPUs of one hardware spec."""

    def __init__(self, model: ModelSpec, hardware: HardwareSpec, tp: int = 1,
                 block_size: int = 16) -> None:
        if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
            raise ValueError(f"tp must be an integer >= 1, got {tp!r}")
        if tp > hardware.max_tp:
            raise ValueError(f"tp={tp} exceeds {hardware.name}'s max_tp ({hardware.max_tp})")
        if tp > 1 and hardware.interconnect_bandwidth_gbs <= 0:
            raise ValueError(f"tp={tp} needs an interconnect: {hardware.name} has "
                             "interconnect_bandwidth_gbs 0")
        if model.num_heads % tp:
            raise ValueError(f"tp={tp} must divide {model.name}'s num_heads ({model.num_heads})")
        if model.num_kv_heads % tp and tp % model.num_kv_heads:
            raise ValueError(f"tp={tp} must divide or be a multiple of {model.name}'s "
                             f"num_kv_heads ({model.num_kv_heads})")
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be an integer >= 1, got {block_size!r}")
        self.model, self.hardware, self.tp, self.block_size = model, hardware, tp, block_size
        m, hw = model, hardware
        peak = hw.peak_matrix_tflops * 1e12
        self._matmul_rate = peak * hw.matmul_efficiency
        self._attention_rate = peak * hw.attention_efficiency
        self._bandwidth = hw.memory_bandwidth_gbs * GB * hw.memory_efficiency
        self.linear_flops_per_token = m.linear_flops_per_token / tp
        self.lm_head_flops_per_sample = m.lm_head_flops / tp
        self.attention_flops_per_pair = m.attention_flops_per_pair / tp
        self.weight_bytes_per_step = m.matmul_params * m.weight_bytes / tp
        self._low_bit_max_tokens = hw.low_bit_max_tokens if hw.low_bit_weight_bytes > 0 else 0
        layer_params = m.num_layers * m.linear_params_per_layer
        self._low_bit_weight_bytes_per_step = (
            layer_params * hw.low_bit_weight_bytes + m.lm_head_params * m.weight_bytes) / tp
        kv_shards = min(tp, m.num_kv_heads)  # KV heads replicate once tp exceeds them
        self.kv_bytes_per_token = m.kv_bytes_per_token / kv_shards  # per GPU
        self.step_overhead_s = hw.step_overhead_ms / 1e3
        self.per_seq_overhead_s = hw.per_seq_overhead_us / 1e6
        if tp > 1:
            link = hw.interconnect_bandwidth_gbs * GB
            per_token = 2 * (tp - 1) / tp * m.hidden_size * ACTIVATION_BYTES / link
            self._allreduce_per_token = 2 * m.num_layers * per_token
            self._allreduce_fixed = 2 * m.num_layers * hw.interconnect_latency_us / 1e6
        else:
            self._allreduce_per_token = self._allreduce_fixed = 0.0
        groups = kv_cache_groups(m.attention_windows)
        # the scheduler's CacheConfig.kv_cache_groups (the default layout for one group)
        self.kv_cache_groups: tuple[KVCacheGroup, ...] = groups if len(groups) > 1 else ()
        self.block_bytes = (self.kv_bytes_per_token * block_size
                            * layers_per_group(groups, m.num_layers) / m.num_layers)
        self._swap_per_block = self.block_bytes / (hw.host_link_bandwidth_gbs * GB)

    # -- memory ------------------------------------------------------------------------------
    @property
    def kv_cache_bytes(self) -> float:
        """KV memory per GPU: usable memory minus weights and the activation reserve."""
        hw = self.hardware
        usable = hw.memory_bytes * hw.memory_utilization - hw.activation_reserve_gb * GB
        return usable - self.model.weight_bytes_total / self.tp

    def num_gpu_blocks(self) -> int:
        """KV-cache blocks that fit next to the weights; ValueError when the model does not fit."""
        free = self.kv_cache_bytes
        if free < self.block_bytes:
            need = self.model.weight_bytes_total / self.tp / GB
            hw = self.hardware
            raise ValueError(
                f"{self.model.name} does not fit on {self.tp} x {hw.name}: {need:.1f} GB of weights "
                f"per GPU, {hw.memory_gb * hw.memory_utilization - hw.activation_reserve_gb:.1f} GB "
                f"usable ({hw.memory_gb} GB x memory_utilization {hw.memory_utilization} - "
                f"activation_reserve_gb {hw.activation_reserve_gb}); raise --tp or pick a bigger GPU")
        return int(free // self.block_bytes)

    def num_cpu_blocks(self, swap_space_gb: float) -> int:
        return int(swap_space_gb * GB // self.block_bytes)

    # -- time --------------------------------------------------------------------------------
    def weight_bytes(self, num_tokens: int) -> float:
        """Weight bytes a step of ``num_tokens`` tokens reads (see ``low_bit_max_tokens``)."""
        if 0 < num_tokens <= self._low_bit_max_tokens:
            return self._low_bit_weight_bytes_per_step
        return self.weight_bytes_per_step

    def breakdown(self, num_tokens: int, num_seqs: int, num_samples: int, attention_pairs: int,
                  context_tokens: int, num_swapped_blocks: int = 0,
                  num_copied_blocks: int = 0) -> StepBreakdown:
        """Cost of one step.

        ``context_tokens`` is the sum over entries of their already-cached tokens (KV read
        besides the new tokens'); ``num_swapped_blocks`` counts blocks moved in or out of the
        CPU pool, ``num_copied_blocks`` copy-on-write copies on the device.
        """
        linear = num_tokens * self.linear_flops_per_token + num_samples * self.lm_head_flops_per_sample
        attention = attention_pairs * self.attention_flops_per_pair
        kv_bytes = (context_tokens + 2 * num_tokens) * self.kv_bytes_per_token
        nbytes = self.weight_bytes(num_tokens) + kv_bytes + 2 * num_copied_blocks * self.block_bytes
        comm = self._allreduce_fixed + num_tokens * self._allreduce_per_token if num_tokens else 0.0
        return StepBreakdown(
            flops=linear + attention,
            bytes=nbytes,
            compute_s=linear / self._matmul_rate + attention / self._attention_rate,
            memory_s=nbytes / self._bandwidth,
            comm_s=comm,
            swap_s=num_swapped_blocks * self._swap_per_block,
            overhead_s=self.step_overhead_s + num_seqs * self.per_seq_overhead_s,
        )

    def step_time(self, num_tokens: int, num_seqs: int, num_samples: int, attention_pairs: int,
                  context_tokens: int, num_swapped_blocks: int = 0,
                  num_copied_blocks: int = 0) -> float:
        """``breakdown(...).total_s`` without building the breakdown (the simulator's hot path)."""
        compute = (num_tokens * self.linear_flops_per_token
                   + num_samples * self.lm_head_flops_per_sample) / self._matmul_rate \
            + attention_pairs * self.attention_flops_per_pair / self._attention_rate
        memory = (self.weight_bytes(num_tokens)
                  + (context_tokens + 2 * num_tokens) * self.kv_bytes_per_token
                  + 2 * num_copied_blocks * self.block_bytes) / self._bandwidth
        t = (compute if compute > memory else memory) + self.step_overhead_s \
            + num_seqs * self.per_seq_overhead_s
        if self._allreduce_per_token and num_tokens:
            t += self._allreduce_fixed + num_tokens * self._allreduce_per_token
        if num_swapped_blocks:
            t += num_swapped_blocks * self._swap_per_block
        return t
