"""SchedulerConfig and CacheConfig: the scheduler's limits, validated on construction; and the
scheduler's choices (policy, queue order, preemption mode) as enums.

Every invalid value raises ``ValueError`` whose message names the field and says what to change.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import TypeVar

from conveyor.core.kv_cache_spec import FullAttentionSpec, KVCacheGroup, KVCacheSpec, check_groups

ChoiceT = TypeVar("ChoiceT", bound="Choice")


class Choice(str, Enum):
    """An option spelled as its string value on the command line and in config files.

    ``parse`` turns that string into the member where it enters (a config's construction);
    a member still equals, prints and serializes (JSON) as its string.
    """

    def __str__(self) -> str:
        return self.value

    @classmethod
    def values(cls) -> list[str]:
        return [member.value for member in cls]

    @classmethod
    def parse(cls: type[ChoiceT], value: object, name: str) -> ChoiceT:
        """The member spelled ``value`` (or ``value`` itself); else ValueError naming ``name``
        and the valid spellings."""
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"{name} must be one of {', '.join(map(repr, cls.values()))}, "
                             f"got {value!r}") from None


class SchedulingPolicy(Choice):
    """How a step is filled (docs/scheduler.md)."""

    PREFILL_FIRST = "prefill_first"  # a step is all-prefill or all-decode (nano-vllm)
    CHUNKED = "chunked"  # decodes and prefill chunks share one token budget (vLLM v1)

    def seq_len_cap(self, max_num_batched_tokens: int) -> int | None:
        """The longest sequence (prompt + output) this policy can ever (re)compute, whatever
        the model's context; None: no bound of its own.

        ``prefill_first`` computes a whole prompt in one step, and a recomputed sequence its
        prompt and output at once, so the step's token budget bounds a sequence.
        """
        return max_num_batched_tokens if self is SchedulingPolicy.PREFILL_FIRST else None


class QueueOrder(Choice):
    FCFS = "fcfs"  # arrival order
    PRIORITY = "priority"  # lower priority value first, then arrival; victims the lowest


class PreemptionMode(Choice):
    RECOMPUTE = "recompute"  # free the blocks; re-prefill prompt + output later
    SWAP = "swap"  # copy the blocks to the CPU pool (recompute when it is full)


# The fields that hold a choice, named alike in SchedulerConfig, EngineArgs and the simulator's
# SimConfig.
CHOICE_FIELDS: dict[str, type[Choice]] = {
    "policy": SchedulingPolicy, "queue": QueueOrder, "preemption_mode": PreemptionMode}


def parse_choices(config: object, owner: str = "") -> None:
    """Turn ``config``'s ``CHOICE_FIELDS`` (members or strings) into members, in place (a frozen
    dataclass's too); a bad one is a ValueError naming ``owner`` + the field."""
    for name, choice in CHOICE_FIELDS.items():
        object.__setattr__(config, name, choice.parse(getattr(config, name), owner + name))


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _require_int(owner: str, name: str, value: object, minimum: int) -> None:
    if not _is_int(value) or value < minimum:
        raise ValueError(f"{owner}.{name} must be an integer >= {minimum}, got {value!r}")


@dataclass(frozen=True)
class SchedulerConfig:
    """Batch limits and policy choices (see docs/scheduler.md).

    ``policy``, ``queue`` and ``preemption_mode`` take a member of their enum or its string.
    ``long_prefill_token_threshold`` caps one request's prefill chunk per step (chunked; 0: no cap);
    ``max_num_partial_prefills`` caps how many requests may be part-way through their prompt.
    ``max_loras`` caps the distinct LoRA adapters of the running requests: a request of another
    adapter waits, letting the requests behind it by, until one of them has drained
    (``core/lora_admission.py``).
    """

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    policy: SchedulingPolicy = SchedulingPolicy.PREFILL_FIRST
    queue: QueueOrder = QueueOrder.FCFS
    preemption_mode: PreemptionMode = PreemptionMode.RECOMPUTE
    long_prefill_token_threshold: int = 0
    max_num_partial_prefills: int = 1
    max_loras: int = 0  # most distinct LoRA adapters running at once; 0: no limit (no LoRA)

    def __post_init__(self) -> None:
        owner = "SchedulerConfig"
        _require_int(owner, "max_num_seqs", self.max_num_seqs, 1)
        _require_int(owner, "max_num_batched_tokens", self.max_num_batched_tokens, 1)
        _require_int(owner, "max_model_len", self.max_model_len, 1)
        parse_choices(self, f"{owner}.")
        _require_int(owner, "long_prefill_token_threshold", self.long_prefill_token_threshold, 0)
        _require_int(owner, "max_num_partial_prefills", self.max_num_partial_prefills, 1)
        _require_int(owner, "max_loras", self.max_loras, 0)
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"{owner}.max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_num_seqs ({self.max_num_seqs}): every running sequence needs one token per "
                "decode step; raise max_num_batched_tokens or lower max_num_seqs")

    @property
    def max_seq_len(self) -> int:
        """Longest sequence (prompt + output) the model and the policy can ever (re)compute."""
        cap = self.policy.seq_len_cap(self.max_num_batched_tokens)
        return self.max_model_len if cap is None else min(self.max_model_len, cap)


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache: ``num_gpu_blocks`` blocks of ``block_size`` tokens (+ a CPU swap pool).

    ``kv_cache_groups``: the model's KV-cache groups (``core/kv_cache_spec.py``), which share the
    blocks; each sequence has one block table per group. ``()``: one full-attention group of
    every layer (a block then holds all layers' K/V).
    """

    block_size: int
    num_gpu_blocks: int
    num_cpu_blocks: int = 0
    enable_prefix_caching: bool = True
    kv_cache_groups: tuple[KVCacheGroup, ...] = ()

    def __post_init__(self) -> None:
        owner = "CacheConfig"
        _require_int(owner, "block_size", self.block_size, 1)
        _require_int(owner, "num_gpu_blocks", self.num_gpu_blocks, 1)
        _require_int(owner, "num_cpu_blocks", self.num_cpu_blocks, 0)
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(f"{owner}.enable_prefix_caching must be a bool, "
                             f"got {self.enable_prefix_caching!r}")
        if not isinstance(self.kv_cache_groups, tuple):
            raise ValueError(f"{owner}.kv_cache_groups must be a tuple of KVCacheGroup, "
                             f"got {self.kv_cache_groups!r}")
        check_groups(self.kv_cache_groups, owner)

    @property
    def specs(self) -> tuple[KVCacheSpec, ...]:
        """Each group's spec (one full-attention spec for the default layout)."""
        if not self.kv_cache_groups:
            return (FullAttentionSpec(),)
        return tuple(g.spec for g in self.kv_cache_groups)
