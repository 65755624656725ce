"""SchedulerConfig and CacheConfig: the scheduler's limits, validated on construction.

Every invalid value raises ``ValueError`` whose message names the field and says what to change.
"""

from __future__ import annotations

from dataclasses import dataclass

POLICIES = ("prefill_first", "chunked")
QUEUES = ("fcfs", "priority")
PREEMPTION_MODES = ("recompute", "swap")


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _require_int(owner: str, name: str, value: object, minimum: int) -> None:
    if not _is_int(value) or value < minimum:
        raise ValueError(f"{owner}.{name} must be an integer >= {minimum}, got {value!r}")


def _require_choice(owner: str, name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{owner}.{name} must be one of {', '.join(map(repr, choices))}, got {value!r}")


@dataclass(frozen=True)
class SchedulerConfig:
    """Batch limits and policy choices (see docs/scheduler.md).

    ``policy``: ``prefill_first`` (steps are all-prefill or all-decode, nano-vllm) or ``chunked``
    (decodes and prefill chunks share one token budget, vLLM v1). ``queue``: ``fcfs`` or
    ``priority`` (lower value first). ``preemption_mode``: ``recompute`` or ``swap``.
    ``long_prefill_token_threshold`` caps one request's prefill chunk per step (chunked; 0: no cap);
    ``max_num_partial_prefills`` caps how many requests may be part-way through their prompt.
    ``max_loras`` caps the distinct LoRA adapters of the running requests: a request of another
    adapter waits, letting the requests behind it by, until one of them has drained
    (``core/lora_admission.py``).
    """

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    policy: str = "prefill_first"
    queue: str = "fcfs"
    preemption_mode: str = "recompute"
    long_prefill_token_threshold: int = 0
    max_num_partial_prefills: int = 1
    max_loras: int = 0  # most distinct LoRA adapters running at once; 0: no limit (no LoRA)

    def __post_init__(self) -> None:
        owner = "SchedulerConfig"
        _require_int(owner, "max_num_seqs", self.max_num_seqs, 1)
        _require_int(owner, "max_num_batched_tokens", self.max_num_batched_tokens, 1)
        _require_int(owner, "max_model_len", self.max_model_len, 1)
        _require_choice(owner, "policy", self.policy, POLICIES)
        _require_choice(owner, "queue", self.queue, QUEUES)
        _require_choice(owner, "preemption_mode", self.preemption_mode, PREEMPTION_MODES)
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
        """Longest sequence (prompt + output) the policy can ever (re)compute.

        ``prefill_first`` computes a whole prompt in one step, so a sequence is also bounded by
        the step's token budget (a recomputed sequence re-prefills prompt + output at once).
        """
        if self.policy == "prefill_first":
            return min(self.max_model_len, self.max_num_batched_tokens)
        return self.max_model_len


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache: ``num_gpu_blocks`` blocks of ``block_size`` tokens (+ a CPU swap pool)."""

    block_size: int
    num_gpu_blocks: int
    num_cpu_blocks: int = 0
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        owner = "CacheConfig"
        _require_int(owner, "block_size", self.block_size, 1)
        _require_int(owner, "num_gpu_blocks", self.num_gpu_blocks, 1)
        _require_int(owner, "num_cpu_blocks", self.num_cpu_blocks, 0)
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(f"{owner}.enable_prefix_caching must be a bool, "
                             f"got {self.enable_prefix_caching!r}")
