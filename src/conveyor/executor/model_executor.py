"""ModelExecutor: the engine's executor over a real model. It resolves the device and dtypes,
loads the model into this process's ``ModelRunner`` and, with ``tensor_parallel_size`` N > 1,
starts or meets the other ranks (``conveyor.distributed``): this process is then rank 0 of N,
holds one shard of the model and its KV heads' cache, ships each step to the other ranks,
runs its own shard of the same forward, and samples from the logits gathered onto it.

With KV offload (``start_kv_offload``) or blocks handed over by a prefill engine
(``start_kv_inbound``) it also runs the KV connector's runner half (``kv_offload_worker.py``):
each step's connector ops start before the step's block operations, and the step's output
carries what the connector finished. ``read_kv_blocks`` copies blocks out for a handoff.
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Mapping
from typing import Any

import torch

from conveyor.core.kv_cache_spec import KVCacheGroup, layers_per_group
from conveyor.core.kv_connector.keys import BlockRecord
from conveyor.core.scheduler_output import ExecutorOutput, SchedulerOutput
from conveyor.core.spec_decode.config import SpeculativeConfig
from conveyor.distributed.group import ParallelConfig
from conveyor.distributed.step import ENABLE_LORA, INIT_CACHE, StepMessage, lora_slot_message
from conveyor.executor.kv_inbound_store import InboundStore
from conveyor.executor.kv_offload_worker import KVOffloadWorker
from conveyor.executor.kv_tier_store import TierStore
from conveyor.executor.model_fingerprint import model_fingerprint
from conveyor.executor.model_runner import ModelRunner
from conveyor.executor.proposer import Proposer
from conveyor.lora.adapter import LoRAAdapter, module_shapes
from conveyor.model.config import ModelConfig
from conveyor.model.device import (
    configure_cpu_allocator,
    dtype_name,
    resolve_device,
    resolve_dtype,
    resolve_kv_cache_dtype,
    resolve_weight_compute,
)
from conveyor.model.kv_cache import KVCache
from conveyor.model.layers.parallel import TensorParallel, check_tensor_parallel
from conveyor.model.loader import load_model, model_path, read_model_config


class ModelExecutor:
    def __init__(self, model: str | None = None, dtype: str = "auto", device: str = "auto",
                 seed: int = 0, kv_cache_dtype: str = "auto", weight_compute: str = "auto",
                 parallel: ParallelConfig | None = None, max_num_seqs: int = 64,
                 enforce_eager: bool = False, deterministic: bool = True) -> None:
        self.model_name = model  # as given (None: the embedded default)
        self.kv_connector: KVOffloadWorker | None = None  # start_kv_offload
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        self.kv_cache_dtype = resolve_kv_cache_dtype(kv_cache_dtype, self.dtype)
        # before torch's first allocation (and before workers inherit the environment)
        trim = self.device.type == "cpu" and configure_cpu_allocator()
        self.parallel = parallel or ParallelConfig()
        self.workers = None
        self.tp: TensorParallel | None = None
        # "auto" resolved here, by the device alone: every rank and every tensor-parallel size
        # computes the same way (the ranks then take whole sums: docs/parallelism.md)
        weight_compute = resolve_weight_compute(weight_compute, self.device)
        if self.parallel.tensor_parallel_size > 1:
            self._start_workers(model, weight_compute, deterministic)
        torch.manual_seed(seed)
        try:
            loaded = load_model(model, self.dtype, self.device, weight_compute,
                                self.kv_cache_dtype, deterministic=deterministic, tp=self.tp)
        except Exception as e:
            if self.workers is None:
                raise
            self.workers.check_loaded(f"{type(e).__name__}: {e}")
        if self.workers is not None:
            self.workers.check_loaded(None)
        self.model_config: ModelConfig = loaded.config
        self.tokenizer = loaded.tokenizer
        self.weight_compute = loaded.weight_compute  # what "auto" became
        self.deterministic = loaded.kernels.deterministic  # see docs/determinism.md
        self.runner = ModelRunner(loaded, self.device, seed, max_num_seqs,
                                  cuda_graphs=not enforce_eager and self.workers is None,
                                  trim_after_long_steps=trim)
        self.model = self.runner.model
        # The KV-cache groups the scheduler allocates for (the engine's CacheConfig), from the
        # model's attention windows (``model_kv_cache_groups``); every rank's runner derives
        # the same from the same model config.
        self.kv_cache_groups: tuple[KVCacheGroup, ...] = self.runner.kv_cache_groups

    def _start_workers(self, model: str | None, weight_compute: str,
                       deterministic: bool) -> None:
        """Check the split before any process starts, then start or meet the other ranks."""
        from conveyor.distributed.workers import TensorParallelWorkers, threads_per_rank
        from conveyor.executor.tp_worker import worker_process

        size = self.parallel.tensor_parallel_size
        tp = TensorParallel.of(0, size, weight_compute, deterministic)
        check_tensor_parallel(read_model_config(model), size, tp.whole_sums)
        self._threads_before = torch.get_num_threads()
        torch.set_num_threads(threads_per_rank(self.parallel))
        self.workers = TensorParallelWorkers(self.parallel, {
            "model": model, "device": self.device.type, "dtype": dtype_name(self.dtype),
            "kv_cache_dtype": dtype_name(self.kv_cache_dtype),
            "deterministic": deterministic, "weight_compute": weight_compute}, worker_process)
        self.tp = tp

    def __copy__(self) -> ModelExecutor:
        """A second executor over the same loaded model, with a KV cache of its own once
        ``initialize_cache`` runs (tests and benchmarks share one load this way)."""
        other = object.__new__(ModelExecutor)
        other.__dict__.update(self.__dict__)
        other.runner = copy.copy(self.runner)
        other.kv_connector = None
        return other

    @property
    def kv_cache(self) -> KVCache | None:
        return self.runner.kv_cache

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers and the KV offload worker (finishing its writes)."""
        if self.kv_connector is not None:
            self.kv_connector.shutdown()
        if self.workers is not None:
            self.workers.shutdown()
            self.workers = None
            torch.set_num_threads(self._threads_before)

    def enable_lora(self, num_slots: int, max_rank: int, slot_of: Mapping[int, int]) -> None:
        """Hold up to ``num_slots`` LoRA adapters of rank up to ``max_rank`` in the model;
        ``slot_of``: which slot each adapter sits in (the engine's ``LoRAPool`` keeps it)."""
        if self.workers is not None:
            self.workers.send(StepMessage(kind=ENABLE_LORA, extra=[num_slots, max_rank]))
        self.runner.enable_lora(num_slots, max_rank, slot_of)

    def set_lora_slot(self, slot: int, adapter: LoRAAdapter) -> None:
        """Put ``adapter`` (its weights as ``conveyor.lora.adapter`` reads them) in ``slot``,
        in place of what the slot held."""
        if self.workers is not None:
            msg, payload = lora_slot_message(slot, adapter.weights, adapter.scale,
                                             list(module_shapes(self.runner.config)))
            self.workers.send(msg)
            self.workers.send_tensor(payload)
        self.runner.set_lora_slot(slot, adapter.weights, adapter.scale)

    def use_structured_outputs(self, manager: Any) -> None:
        """Sample under ``manager``'s grammar masks (``conveyor.structured_outputs``)."""
        self.runner.structured_outputs = manager

    def use_proposer(self, speculative: SpeculativeConfig, proposer: Proposer) -> None:
        """Propose tokens after each step for the scheduler to verify in the next."""
        self.runner.use_proposer(speculative, proposer)

    def kv_cache_bytes_per_block(self, block_size: int) -> int:
        """Bytes of one block on this rank (its KV heads): ``layers_per_group`` layers' K/V."""
        c = self.model_config
        return KVCache.bytes_per_block(layers_per_group(self.kv_cache_groups, c.num_layers),
                                       self.runner.num_kv_heads, c.head_dim, block_size,
                                       self.kv_cache_dtype)

    def kv_identity(self, block_size: int) -> str:
        """What the KV contents of a block depend on besides its tokens: the model's weights, the
        dtypes, the weight computation and the block's layout (``engine/kv_offload.py`` keys
        stored blocks by it)."""
        c = self.model_config
        return "|".join(map(str, (
            model_fingerprint(model_path(self.model_name)).hex(), dtype_name(self.dtype),
            dtype_name(self.kv_cache_dtype), self.weight_compute, self.deterministic,
            layers_per_group(self.kv_cache_groups, c.num_layers), self.runner.num_kv_heads,
            c.head_dim, block_size, self.kv_cache_bytes_per_block(block_size))))

    def start_kv_offload(self, namespace: bytes, block_size: int,
                         disk_dir: str | None) -> list[BlockRecord]:
        """Start the KV connector's runner half over this executor's (initialized) cache, its
        disk tier in ``disk_dir`` (None: none); returns the blocks that directory holds already,
        least recently written first."""
        if self.kv_connector is not None:
            self.kv_connector.shutdown()
        store = TierStore(namespace, self.kv_cache_bytes_per_block(block_size), block_size,
                          disk_dir)
        found = store.scan()
        self.kv_connector = worker = KVOffloadWorker(self.runner, store)
        weakref.finalize(self, worker.shutdown)
        return found

    def start_kv_inbound(self, namespace: bytes, block_size: int) -> InboundStore:
        """Start the KV connector's runner half over this executor's (initialized) cache for
        blocks another engine computed; returns the store they are put in."""
        if self.kv_connector is not None:
            self.kv_connector.shutdown()
        store = InboundStore(namespace, self.kv_cache_bytes_per_block(block_size))
        self.kv_connector = worker = KVOffloadWorker(self.runner, store)
        weakref.finalize(self, worker.shutdown)
        return store

    def read_kv_blocks(self, blocks: list[int]) -> list[Any]:
        """Copies of pool blocks' bytes (every layer's K and V, as one block is laid out), as
        NumPy uint8 arrays; call it between steps (the engine's thread)."""
        cache = self.runner.kv_cache.cache
        return [cache[:, :, b].contiguous().view(torch.uint8).reshape(-1).cpu().numpy()
                for b in blocks]

    def initialize_cache(self, block_size: int, num_gpu_blocks: int, num_cpu_blocks: int = 0) -> None:
        if self.workers is not None:
            self.workers.send(StepMessage(kind=INIT_CACHE,
                                          extra=[block_size, num_gpu_blocks, num_cpu_blocks]))
        self.runner.init_cache(block_size, num_gpu_blocks, num_cpu_blocks, self.kv_cache_dtype)

    @torch.inference_mode()
    def execute(self, scheduler_output: SchedulerOutput) -> ExecutorOutput:
        connector = self.kv_connector
        if connector is not None:  # its saves read their blocks before the step writes any
            connector.start_step(scheduler_output.kv_connector_metadata)
        step = self.runner.prepare(scheduler_output)
        if self.workers is not None:
            self.workers.send(StepMessage(step=step.input))
        try:
            result = self.runner.forward(step.input, step.hidden_rows or None)
        except RuntimeError as e:
            if self.workers is None:
                raise
            raise self.workers.failure(e) from e
        out = self.runner.sample(scheduler_output, step, result)
        out.draft_token_ids = self.runner.propose(scheduler_output, step, out.sampled_token_ids)
        if connector is not None:
            out.kv_connector_output = connector.finished(wait=scheduler_output.is_empty)
        return out
