"""EngineArgs: every knob of an engine in one dataclass, plus its command-line form.

``conveyor generate``, ``chat``, ``serve`` and ``bench`` all take these flags, so they are
declared once here (``add_cli_args`` / ``from_cli_args``).
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from conveyor.core.config import (
    CHOICE_FIELDS,
    PreemptionMode,
    QueueOrder,
    SchedulingPolicy,
    parse_choices,
)

if TYPE_CHECKING:
    from conveyor.core.sampling_params import SamplingParams

# `conveyor serve`'s scheduling defaults, where the offline engine's (prefill_first, a 4096-token
# budget: the best throughput) would stop every running stream for a long prompt's whole
# prefill: chunked prefill, at most SERVE_PREFILL_CHUNK tokens of one prompt a step and a budget
# of one token per running sequence plus that chunk, so a step stays short and a prompt still
# advances when every seat decodes (docs/server.md).
SERVE_POLICY = SchedulingPolicy.CHUNKED
SERVE_PREFILL_CHUNK = 64
# flags whose default `conveyor serve` resolves from the others (``add_cli_args(serve=True)``)
SERVE_RESOLVED = ("policy", "max_num_batched_tokens", "long_prefill_token_threshold")

@dataclass
class EngineArgs:
    model: str | None = None  # None: the embedded SmolLM2-135M-Instruct GGUF
    dtype: str = "auto"  # auto | bfloat16 | float32 | float16
    kv_cache_dtype: str = "auto"  # auto (the model's dtype) | bfloat16 | float32 | float16
    weight_compute: str = "auto"  # auto | float | int8: a GGUF model's quantized matmuls
    device: str = "auto"  # auto | cpu | cuda
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 4096
    max_model_len: int | None = None  # None: the model's context length, capped at 8192
    block_size: int = 16
    kv_cache_memory: float | None = None  # bytes, a fraction (<= 1) of available memory, or
    # None: on the CPU room for max_num_seqs full-length sequences, at most 4 GiB and a quarter
    # of available memory; on CUDA gpu_memory_utilization
    num_gpu_blocks: int | None = None  # overrides kv_cache_memory
    gpu_memory_utilization: float = 0.9  # CUDA: fraction of the card the engine may fill
    enforce_eager: bool = False  # CUDA: no CUDA graphs for decode steps
    swap_space: float = 0.5  # GiB of CPU swap pool for preemption_mode="swap"
    policy: SchedulingPolicy = SchedulingPolicy.PREFILL_FIRST  # a member or its string
    queue: QueueOrder = QueueOrder.FCFS
    preemption_mode: PreemptionMode = PreemptionMode.RECOMPUTE
    enable_prefix_caching: bool = True
    long_prefill_token_threshold: int = 0  # 0: no per-request chunk cap (chunked policy)
    max_num_partial_prefills: int = 1
    seed: int = 0
    tensor_parallel_size: int = 1  # ranks (processes) the model is split across
    nnodes: int = 1  # machines those ranks run on; the others start `conveyor worker`
    master_addr: str | None = None  # rendezvous host (rank 0's); None: this machine
    master_port: int | None = None  # rendezvous port; None: a free one (one machine)
    threads_per_rank: int | None = None  # None: this machine's cores / its ranks
    distributed_timeout: float = 120.0  # seconds a collective may wait on a rank
    deterministic: bool = True  # same bits whatever the batching (docs/determinism.md)
    structured_outputs_compile_timeout: float = 10.0  # seconds one grammar compile may take
    structured_outputs_cache_bytes: int = 256 * 2**20  # compiled grammars kept for reuse
    # speculative decoding (docs/speculative.md)
    speculative_method: str | None = None  # None: off | ngram | draft_model
    num_speculative_tokens: int = 4
    speculative_model: str | None = None  # draft_model: GGUF / HF directory (None: embedded)
    ngram_prompt_lookup_min: int = 1
    ngram_prompt_lookup_max: int = 4
    speculative_disable_by_batch_size: int = 4  # 0: never (crossover: docs/speculative.md)
    pooling: str | None = None  # embeddings: last | mean | cls; None: the model's own config
    enable_lora: bool = False  # serve LoRA adapters (docs/lora.md)
    max_loras: int = 1  # most distinct adapters running at once
    max_lora_rank: int = 16  # adapters of a higher rank are refused
    max_cpu_loras: int | None = None  # adapters kept read in host memory; None: max_loras
    # KV offload tiers and KV events (docs/kv_cache.md)
    kv_offload_cpu_bytes: int = 0  # host memory for blocks the pool evicts; 0: no such tier
    kv_offload_disk: str | None = None  # directory of the disk tier; None: no such tier
    kv_offload_disk_bytes: int = 0  # most bytes the disk tier's files take
    kv_events: bool = False  # publish the blocks stored and removed per tier (LLMEngine.kv_events)
    # prefill/decode disaggregation: None | producer (hands prompts' blocks over) | consumer
    kv_transfer: str | None = None

    def __post_init__(self) -> None:
        parse_choices(self)  # given as strings (flags, user code), held as enum members

    def parallel_config(self):
        """The ``ParallelConfig`` of these args (ValueError naming a bad field)."""
        from conveyor.distributed.group import ParallelConfig

        return ParallelConfig(self.tensor_parallel_size, self.nnodes, self.master_addr,
                              self.master_port, self.threads_per_rank, self.distributed_timeout)

    def replace(self, **changes: object) -> EngineArgs:
        return dataclasses.replace(self, **changes)


_HELP = {
    "model": "GGUF file or HF model directory (default: embedded SmolLM2-135M-Instruct)",
    "dtype": "weights/activations dtype: auto, bfloat16, float32, float16",
    "kv_cache_dtype": "KV cache dtype: auto (the model's) or another; bfloat16 under a float32 "
                      "model halves the cache's bytes (outputs then differ slightly)",
    "weight_compute": "how a GGUF model's quantized weights are multiplied: int8 (activations "
                      "rounded to 8 bits per block of 32, the file's blocks multiplied as "
                      "integers, as llama.cpp does; accuracy in docs/performance.md), float "
                      "(in the activations' dtype), or auto (int8 wherever the CPU kernels "
                      "are built, else float; the same at every --tensor-parallel-size)",
    "device": "auto, cpu or cuda",
    "max_num_seqs": "most sequences in one batch",
    "max_num_batched_tokens": "most tokens computed in one step",
    "max_model_len": "context length (prompt + output); default: the model's, at most 8192, "
                     "and under --policy prefill_first at most --max-num-batched-tokens",
    "block_size": "tokens per KV-cache block",
    "kv_cache_memory": "KV cache size: bytes, or a fraction (<=1) of available memory; on the "
                       "CPU, shared by this machine's tensor-parallel ranks (on CUDA only "
                       "bytes; see --gpu-memory-utilization); default: room for "
                       "--max-num-seqs sequences of --max-model-len tokens, at most 4 GiB and "
                       "a quarter of available memory",
    "num_gpu_blocks": "exact number of KV-cache blocks (overrides --kv-cache-memory)",
    "gpu_memory_utilization": "on CUDA, the fraction of the GPU's memory the engine may use "
                              "(weights, activations and KV cache; unless --kv-cache-memory "
                              "gives bytes)",
    "enforce_eager": "on CUDA, run decode steps eagerly instead of replaying CUDA graphs",
    "swap_space": "GiB of CPU memory for swapped-out KV blocks (shared by this machine's "
                  "tensor-parallel ranks)",
    "policy": "scheduling policy: %(choices)s",
    "queue": "queue order: %(choices)s",
    "preemption_mode": "what a preempted request's KV blocks do: %(choices)s",
    "enable_prefix_caching": "reuse KV blocks of shared prompt prefixes",
    "long_prefill_token_threshold": "cap on one request's prefill chunk per step (chunked; 0 = none)",
    "max_num_partial_prefills": "most requests partially prefilled at once (chunked)",
    "seed": "global random seed",
    "tensor_parallel_size": "split the model across this many processes (tensor parallelism)",
    "nnodes": "machines the tensor-parallel ranks run on (the others run `conveyor worker`)",
    "master_addr": "tensor-parallel rendezvous address: this machine's, reachable by the others",
    "master_port": "tensor-parallel rendezvous port",
    "threads_per_rank": "torch threads per tensor-parallel rank (default: cores / local ranks)",
    "distributed_timeout": "seconds a tensor-parallel collective waits for a rank before failing",
    "deterministic": "a request's tokens and logprobs are bit-identical however it is batched, "
                     "chunked, cached or preempted, and with any thread count; "
                     "--no-deterministic lets small steps multiply the GGUF blocks in file "
                     "order under float weight compute, and a bf16 model use oneDNN's AMX GEMM "
                     "(docs/determinism.md)",
    "structured_outputs_compile_timeout": "seconds a structured-output constraint (JSON schema, "
                                          "regex, grammar) may take to compile; a slower one "
                                          "fails its request (a 400 from the server)",
    "structured_outputs_cache_bytes": "bytes of compiled constraints kept for reuse (least "
                                      "recently used leave first); one constraint may take a "
                                      "quarter of it",
    "speculative_method": "speculative decoding: ngram proposes tokens by looking the "
                          "sequence's last tokens up in its own prompt and output, draft_model "
                          "by running --speculative-model; the model verifies them in one step "
                          "(docs/speculative.md; None: off)",
    "num_speculative_tokens": "most tokens proposed per sequence and step",
    "speculative_model": "draft_model: the drafting model, a GGUF file or HF directory sharing "
                         "the model's tokenizer (default: the embedded SmolLM2)",
    "ngram_prompt_lookup_min": "shortest n-gram the ngram proposer looks up",
    "ngram_prompt_lookup_max": "longest n-gram the ngram proposer looks up",
    "speculative_disable_by_batch_size": "propose nothing in steps with more decoding "
                                         "sequences than this: verifying k + 1 rows per "
                                         "sequence then costs more than it saves "
                                         "(0: never; docs/speculative.md)",
    "enable_lora": "serve LoRA adapters (PEFT format) on the base model: a request names "
                   "its adapter (LLM.generate(..., lora_request=...))",
    "max_loras": "with --enable-lora: most distinct adapters whose requests run at once; a "
                 "request of another adapter waits its turn",
    "max_lora_rank": "with --enable-lora: the highest adapter rank accepted",
    "max_cpu_loras": "with --enable-lora: most adapters kept read in host memory (least "
                     "recently used leave first and are read again when needed, off the "
                     "engine's loop); at least --max-loras (default: --max-loras)",
    "kv_offload_cpu_bytes": "bytes of host memory that keep KV blocks the cache evicts; a "
                            "prompt whose prefix is there loads it back instead of computing "
                            "it (0: no host-memory tier)",
    "kv_offload_disk": "directory of a disk tier below the host-memory one (blocks it evicts go "
                       "there; kept across runs: a later engine of the same model reads them)",
    "kv_offload_disk_bytes": "most bytes the disk tier's files may take (needed with "
                             "--kv-offload-disk)",
    "kv_events": "publish the KV blocks the engine stores and removes, per tier (pool, cpu, "
                 "disk), for a cache-aware router (LLMEngine.kv_events)",
    "kv_transfer": "prefill/decode disaggregation (docs/kv_cache.md): producer, an engine that "
                   "hands its prompts' KV blocks over; consumer, one that loads blocks handed to "
                   "it instead of computing them (`conveyor serve --pd` sets it per replica)",
    "pooling": "how embedding requests pool hidden states: last, mean or cls (default: the "
               "model's sentence-transformers pooling config, else last)",
}

_SERVE_HELP = {
    "policy": f"{SERVE_POLICY} for `conveyor serve`, prefill_first for the offline engine",
    "max_num_batched_tokens": f"under chunked --max-num-seqs + {SERVE_PREFILL_CHUNK}, under "
                              "prefill_first 4096",
    "long_prefill_token_threshold": f"{SERVE_PREFILL_CHUNK} under chunked",
}

def _choices() -> dict[str, list[str]]:
    """Each flag's values, from the module that owns them (imported here, not at the top:
    ``EngineArgs`` itself stays importable without torch)."""
    from conveyor.core.pooling_params import POOLING_METHODS
    from conveyor.core.spec_decode.config import METHODS
    from conveyor.engine.kv_transfer import KV_TRANSFER_ROLES
    from conveyor.model.device import DEVICES, DTYPES, KV_CACHE_DTYPES, WEIGHT_COMPUTE

    return {"dtype": list(DTYPES), "kv_cache_dtype": list(KV_CACHE_DTYPES),
            "weight_compute": list(WEIGHT_COMPUTE), "device": list(DEVICES),
            **{name: list(choice.values()) for name, choice in CHOICE_FIELDS.items()},
            "speculative_method": list(METHODS), "pooling": list(POOLING_METHODS),
            "kv_transfer": list(KV_TRANSFER_ROLES)}


def add_cli_args(parser: argparse.ArgumentParser, serve: bool = False) -> None:
    """The engine flags; ``serve``: with `conveyor serve`'s scheduling defaults (``SERVE_*``,
    resolved by ``from_cli_args``)."""
    group = parser.add_argument_group("engine")
    choices = _choices()
    defaults = EngineArgs()
    for f in dataclasses.fields(EngineArgs):
        flag = "--" + f.name.replace("_", "-")
        default = getattr(defaults, f.name)
        if serve and f.name in SERVE_RESOLVED:
            kind = int if f.name != "policy" else str
            group.add_argument(flag, type=kind, default=None, choices=choices.get(f.name),
                               help=f"{_HELP[f.name]} (default: {_SERVE_HELP[f.name]})")
            continue
        if isinstance(default, bool):
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=default,
                               help=_HELP[f.name])
            continue
        kind = {"int": int, "float": float}.get(type(default).__name__, str)
        if f.name in ("max_model_len", "num_gpu_blocks", "master_port", "threads_per_rank"):
            kind = int
        if f.name == "kv_cache_memory":
            kind = float
        group.add_argument(flag, type=kind, default=default, choices=choices.get(f.name),
                           help=f"{_HELP[f.name]} (default: {default})")


def from_cli_args(ns: argparse.Namespace) -> EngineArgs:
    given = {f.name: getattr(ns, f.name) for f in dataclasses.fields(EngineArgs)}
    if any(given[name] is None for name in SERVE_RESOLVED):  # `conveyor serve`'s flags
        given.update(serve_scheduling(given["policy"], given["max_num_batched_tokens"],
                                      given["long_prefill_token_threshold"],
                                      given["max_num_seqs"]))
    return EngineArgs(**given)


def serve_scheduling(policy: str | SchedulingPolicy | None, max_num_batched_tokens: int | None,
                     long_prefill_token_threshold: int | None,
                     max_num_seqs: int) -> dict[str, object]:
    """`conveyor serve`'s policy, budget and chunk cap: those given, the others its defaults
    (chunked; under it a budget of ``max_num_seqs + SERVE_PREFILL_CHUNK`` and chunks of at most
    ``SERVE_PREFILL_CHUNK`` tokens; under prefill_first the offline engine's)."""
    offline = EngineArgs()
    policy = SchedulingPolicy(policy) if policy is not None else SERVE_POLICY
    chunked = policy is SchedulingPolicy.CHUNKED
    if max_num_batched_tokens is None:
        max_num_batched_tokens = (max_num_seqs + SERVE_PREFILL_CHUNK if chunked
                                  else offline.max_num_batched_tokens)
    if long_prefill_token_threshold is None:
        long_prefill_token_threshold = (SERVE_PREFILL_CHUNK if chunked
                                        else offline.long_prefill_token_threshold)
    return {"policy": policy, "max_num_batched_tokens": max_num_batched_tokens,
            "long_prefill_token_threshold": long_prefill_token_threshold}


def add_sampling_cli_args(parser: argparse.ArgumentParser, max_tokens: int = 128,
                          temperature: float = 0.7, top_p: float = 0.9) -> None:
    """Sampling flags shared by ``conveyor generate`` and ``chat`` (the sampling seed is --seed)."""
    group = parser.add_argument_group("sampling")
    group.add_argument("--max-tokens", type=int, default=max_tokens,
                       help=f"most tokens to generate per reply (default: {max_tokens})")
    group.add_argument("--min-tokens", type=int, default=0,
                       help="tokens to generate before EOS or a stop string may end a reply (default: 0)")
    group.add_argument("--temperature", type=float, default=temperature,
                       help=f"sampling temperature; 0 is greedy (default: {temperature})")
    group.add_argument("--top-p", type=float, default=top_p,
                       help=f"nucleus sampling: keep the smallest set of tokens with this much "
                            f"probability (default: {top_p})")
    group.add_argument("--top-k", type=int, default=0,
                       help="keep only the k most likely tokens; 0 disables it (default: 0)")
    group.add_argument("--stop", action="append", default=[], metavar="STRING",
                       help="stop when this string is generated (repeatable; not included in the output)")


def sampling_params_from_cli_args(ns: argparse.Namespace, **overrides: object) -> SamplingParams:
    from conveyor.core.sampling_params import SamplingParams

    fields = dict(max_tokens=ns.max_tokens, min_tokens=ns.min_tokens, temperature=ns.temperature,
                  top_p=ns.top_p, top_k=ns.top_k, stop=list(ns.stop), seed=ns.seed)
    fields.update(overrides)
    return SamplingParams(**fields)
