"""The executor interfaces. ``Executor``: ``execute`` turns the scheduler's ``SchedulerOutput``
into the step's ``ExecutorOutput`` (sampled tokens, logprobs, pooled vectors); the contract
itself is in ``core/scheduler_output.py``, and the simulator's executor is one. ``EngineExecutor``:
everything ``LLMEngine`` (and the engine-side parts it sets up: KV connectors, speculative
decoding, LoRA) uses of the executor that runs a real model, ``ModelExecutor``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

from conveyor.core.scheduler_output import ExecutorOutput, SchedulerOutput

if TYPE_CHECKING:
    import torch

    from conveyor.core.kv_cache_spec import KVCacheGroup
    from conveyor.core.kv_connector.keys import BlockRecord
    from conveyor.core.spec_decode.config import SpeculativeConfig
    from conveyor.distributed.group import ParallelConfig
    from conveyor.executor.kv_inbound_store import InboundStore
    from conveyor.executor.proposer import Proposer
    from conveyor.lora.adapter import LoRAAdapter
    from conveyor.model.config import ModelConfig


class Executor(Protocol):
    def execute(self, scheduler_output: SchedulerOutput) -> ExecutorOutput: ...


class EngineExecutor(Executor, Protocol):
    tokenizer: Any
    model_config: ModelConfig
    device: torch.device
    parallel: ParallelConfig
    kv_cache_groups: tuple[KVCacheGroup, ...]

    def initialize_cache(self, block_size: int, num_gpu_blocks: int,
                         num_cpu_blocks: int = 0) -> None: ...

    def kv_cache_bytes_per_block(self, block_size: int) -> int: ...

    def enable_lora(self, num_slots: int, max_rank: int, slot_of: Mapping[int, int]) -> None: ...

    def set_lora_slot(self, slot: int, adapter: LoRAAdapter) -> None: ...

    def use_structured_outputs(self, manager: Any) -> None: ...

    def use_proposer(self, speculative: SpeculativeConfig, proposer: Proposer) -> None: ...

    def kv_identity(self, block_size: int) -> str: ...

    def start_kv_offload(self, namespace: bytes, block_size: int,
                         disk_dir: str | None) -> list[BlockRecord]: ...

    def start_kv_inbound(self, namespace: bytes, block_size: int) -> InboundStore: ...

    def read_kv_blocks(self, blocks: list[int]) -> list[Any]: ...

    def shutdown(self) -> None: ...
