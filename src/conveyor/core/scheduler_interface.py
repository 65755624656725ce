"""SchedulerInterface: the part of the Scheduler that a scheduling policy reads and drives.

The policies (``prefill_first``, ``chunked``) and the decode phase they share (``decode``) are
typed against this protocol rather than the Scheduler class, so that the scheduler module can
import them without a circle. ``Scheduler`` implements it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from conveyor.core.scheduler_output import SchedulerOutput

if TYPE_CHECKING:
    from conveyor.core.block_manager import BlockManager
    from conveyor.core.config import SchedulerConfig
    from conveyor.core.kv_connector.interface import KVConnectorScheduler
    from conveyor.core.lora_admission import LoRAAdmission
    from conveyor.core.request_queue import RequestQueue
    from conveyor.core.sequence import Sequence
    from conveyor.core.spec_decode.config import SpeculativeConfig


@runtime_checkable
class SchedulerInterface(Protocol):
    config: SchedulerConfig
    block_manager: BlockManager
    clock: Callable[[], float]
    priority_queue: bool  # queue is QueueOrder.PRIORITY: victims and admission follow priority_key
    waiting: RequestQueue
    swapped: RequestQueue
    running: list[Sequence]  # decoding sequences, sorted by running_stamp
    prefilling: list[Sequence]  # chunked only: admitted, prompt not fully computed yet
    seqs_needing_block: list[Sequence]  # running sequences whose next slot needs a new block
    preempted_this_step: bool
    speculative: SpeculativeConfig | None  # None: no lookahead slots (core/lookahead.py)
    kv_connector: KVConnectorScheduler | None  # None: no KV connector (core/kv_loading.py)
    loading: dict[int, Sequence]  # seq_id -> sequence whose prefix the connector is loading

    def admit(self, seq: Sequence, hits: list[list[int]], num_tokens: int,
              now: float) -> None: ...

    def join_running(self, seq: Sequence) -> None: ...

    def start_load(self, seq: Sequence, hits: list[list[int]]) -> bool: ...

    def preempt(self, seq: Sequence) -> None: ...

    def swap_in(self, seq: Sequence) -> None: ...

    def blocks_to_swap_in(self, seq: Sequence) -> int: ...

    def is_decoding(self, seq: Sequence) -> bool: ...

    def lowest_priority(self, candidates: list[Sequence]) -> Sequence | None: ...

    def lora_admission(self) -> LoRAAdmission | None: ...

    def next_waiting(self, admission: LoRAAdmission | None) -> Sequence | None: ...

    def set_next_check_len(self, seq: Sequence) -> None: ...


Policy = Callable[[SchedulerInterface], SchedulerOutput]
