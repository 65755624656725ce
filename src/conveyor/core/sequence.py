"""Requests as the scheduler sees them: SequenceGroup (one prompt) owning n Sequences.

Fields read by executors and the engine (the contract; keep their names and meaning):
``Sequence.seq_id, group, index, token_ids, num_prompt_tokens, num_computed_tokens,
block_tables, status, stop_reason`` (``block_tables[g]``: KV-cache group g's block table, see
core/scheduler_output.py) and ``SequenceGroup.request_id, prompt_token_ids,
sampling_params, pooling_params, lora_id, priority, arrival_time, seqs, metrics,
finish_message``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from conveyor.core.pooling_params import PoolingParams
from conveyor.core.sampling_params import SamplingParams


class SequenceStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    SWAPPED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH_CAPPED = 4
    FINISHED_ABORTED = 5
    FINISHED_IGNORED = 6
    WAITING_FOR_GRAMMAR = 7  # its structured-output grammar is still compiling (not queued yet)
    WAITING_FOR_KV = 8  # its prefix is being loaded by the KV connector (core/kv_loading.py)

    @property
    def is_finished(self) -> bool:
        return SequenceStatus.FINISHED_STOPPED <= self <= SequenceStatus.FINISHED_IGNORED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    SequenceStatus.FINISHED_STOPPED: "stop",
    SequenceStatus.FINISHED_LENGTH_CAPPED: "length",
    SequenceStatus.FINISHED_ABORTED: "abort",
    SequenceStatus.FINISHED_IGNORED: "ignored",
}


@dataclass(slots=True)
class RequestMetrics:
    """Timestamps come from the scheduler's clock (wall time live, virtual time in the simulator)."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    # speculative decoding: tokens proposed for this request and, of those, accepted
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


class Sequence:
    """One stream of tokens (prompt + generated) with its KV blocks."""

    __slots__ = (
        "seq_id",
        "group",
        "index",
        "token_ids",
        "num_prompt_tokens",
        "num_computed_tokens",
        "block_tables",
        "status",
        "stop_reason",
        # scheduler bookkeeping (not part of the executor contract)
        "max_len",
        "min_len",
        "stop_ids",
        "next_check_len",
        "block_hashes",
        "block_keys",
        "kv_load_tried",
        "num_registered_blocks",
        "cpu_block_tables",
        "running_stamp",
        "spec_token_ids",
        "draft_token_ids",
    )

    def __init__(self, seq_id: int, group: SequenceGroup, index: int, token_ids: list[int],
                 num_prompt_tokens: int) -> None:
        self.seq_id = seq_id
        self.group = group
        self.index = index  # which of the group's n samples
        self.token_ids = token_ids
        self.num_prompt_tokens = num_prompt_tokens
        self.num_computed_tokens = 0  # tokens whose K/V are in the cache
        # one block table per KV-cache group while it holds GPU blocks, else []
        self.block_tables: list[list[int]] = []
        self.status = SequenceStatus.WAITING
        self.stop_reason: int | str | None = None
        # Stop limits, precomputed so that update() does one or two comparisons per token:
        self.max_len = 1 << 62  # finished (length) once len(token_ids) reaches this
        self.min_len = 0  # stop tokens are ignored while len(token_ids) < min_len (min_tokens)
        self.stop_ids: frozenset[int] = frozenset()  # EOS (unless ignore_eos) + stop_token_ids
        # len(token_ids) at which update() must look closer: max_len, or the next decode
        # needing a new KV block (capacity of its block tables + 1).
        self.next_check_len = 0
        self.block_hashes: list[int] = []  # chained prefix hash of each full block of token_ids
        self.block_keys: list[bytes] = []  # content key of each, when keyed (core/kv_connector)
        self.kv_load_tried = False  # loaded from the KV connector since it was last admitted
        self.num_registered_blocks = 0  # leading block indices known to the prefix cache
        self.cpu_block_tables: list[list[int]] = []  # per group, while SWAPPED
        self.running_stamp = 0  # when it joined `running` (running stays sorted by it)
        # proposed tokens verified after the next token this step (core/lookahead.py)
        self.spec_token_ids: list[int] = []
        # the runner's proposal after the last step, continuing token_ids: the next step's
        # spec_token_ids where it speculates (Scheduler.update_draft_token_ids)
        self.draft_token_ids: list[int] = []

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, req={self.group.request_id!r}, len={len(self.token_ids)}, "
                f"computed={self.num_computed_tokens}, status={self.status.name})")


class SequenceGroup:
    """One request: a prompt and the n sequences sampled from it."""

    __slots__ = (
        "request_id",
        "prompt_token_ids",
        "sampling_params",
        "pooling_params",
        "lora_id",
        "priority",
        "arrival_time",
        "seqs",
        "metrics",
        "finish_message",
        "fairness_key",
    )

    def __init__(self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams,
                 priority: int, arrival_time: float, fairness_key: str | None = None,
                 pooling_params: PoolingParams | None = None, lora_id: int = 0) -> None:
        self.request_id = request_id
        # requests sharing a key (one client's) are admitted round-robin with other keys
        self.fairness_key = request_id if fairness_key is None else fairness_key
        self.prompt_token_ids = prompt_token_ids
        self.sampling_params = sampling_params
        # a pooling request (an embedding): prefilled, never sampled (core/pooling_params.py)
        self.pooling_params = pooling_params
        self.lora_id = lora_id  # the LoRA adapter it runs under (its int id); 0: the base model
        self.priority = priority
        self.arrival_time = arrival_time
        self.seqs: list[Sequence] = []
        self.metrics = RequestMetrics(arrival_time=arrival_time)
        self.finish_message: str | None = None  # why a request was ignored or aborted

    @property
    def is_finished(self) -> bool:
        return all(s.status.is_finished for s in self.seqs)

    def __repr__(self) -> str:
        return f"SequenceGroup({self.request_id!r}, n={len(self.seqs)}, priority={self.priority})"
