"""LLMEngine: the synchronous engine loop — add requests, ``step()``, abort.

It owns the Scheduler (what to compute), the ModelExecutor (the model and its KV cache), the
tokenizer, and the OutputProcessor (detokenization, stop strings, logprobs). One ``step()`` is
schedule -> execute (skipped when nothing is scheduled and the KV connector has nothing to do)
-> update -> outputs. With KV offload or KV events (``engine/kv_offload.py``) it also wires the
KV connector's two halves and publishes the step's KV events (``kv_events``) after each step.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any

from conveyor.core.config import CacheConfig, PreemptionMode, SchedulerConfig
from conveyor.core.kv_connector.events import KVEventBatch
from conveyor.core.kv_connector.inbound import InboundKVScheduler
from conveyor.core.kv_connector.offload import TieredOffloadScheduler
from conveyor.core.kv_connector.snapshot import snapshot_events
from conveyor.core.pooling_params import PoolingParams
from conveyor.core.sampling_params import SamplingParams
from conveyor.core.scheduler import Scheduler
from conveyor.core.scheduler_output import SchedulerOutput
from conveyor.core.sequence import Sequence, SequenceGroup, SequenceStatus
from conveyor.engine.args import EngineArgs
from conveyor.engine.kv_offload import setup_kv_connector
from conveyor.engine.kv_transfer import KVTransfer
from conveyor.engine.output_processor import OutputProcessor
from conveyor.engine.outputs import RequestOutput
from conveyor.engine.speculative import build_speculative
from conveyor.engine.stats import EngineStats
from conveyor.lora.adapter import LoRAAdapter, load_adapter
from conveyor.lora.pool import LoRAPool
from conveyor.lora.request import LoRARequest
from conveyor.model.pooling_config import PoolingConfig, read_pooling_config

if TYPE_CHECKING:
    import torch

    from conveyor.executor.base import EngineExecutor
    from conveyor.structured_outputs import StructuredOutputManager

DEFAULT_MAX_MODEL_LEN_CAP = 8192
DEFAULT_CPU_KV_CACHE_BYTES = 4 * 2**30  # as vLLM's CPU build
DEFAULT_CPU_KV_CACHE_FRACTION = 0.25
GRAMMAR_WAIT_S = 0.01  # an idle step waits this long for a compiling grammar
LORA_WAIT_S = 0.01  # an idle step waits this long for an adapter being read
# what a pooling request's group carries as sampling params: nothing is sampled from them
_POOLING_SAMPLING = SamplingParams(max_tokens=1)

Prompt = str | list[int] | dict[str, Any]

logger = logging.getLogger("conveyor.engine")


class LLMEngine:
    def __init__(self, engine_args: EngineArgs | None = None,
                 executor: EngineExecutor | None = None) -> None:
        """``executor``: an already loaded ModelExecutor-like object to use instead of loading
        ``engine_args.model`` (its KV cache is (re)initialized here)."""
        self.engine_args = args = engine_args or EngineArgs()
        loads_model = executor is None
        if executor is None:
            from conveyor.executor.model_executor import ModelExecutor

            executor = ModelExecutor(args.model, dtype=args.dtype, device=args.device,
                                     seed=args.seed, kv_cache_dtype=args.kv_cache_dtype,
                                     weight_compute=args.weight_compute,
                                     parallel=args.parallel_config(),
                                     max_num_seqs=args.max_num_seqs,
                                     enforce_eager=args.enforce_eager,
                                     deterministic=args.deterministic)
        self.executor = executor
        self.tokenizer = self.executor.tokenizer
        self.model_config = self.executor.model_config
        self.lora_pool: LoRAPool | None = None
        if args.enable_lora:  # its slots take memory before the KV cache is sized
            self.lora_pool = LoRAPool(args.max_loras, args.max_cpu_loras or args.max_loras,
                                      self.read_lora, self.executor.set_lora_slot)
            self.executor.enable_lora(args.max_loras, args.max_lora_rank,
                                      self.lora_pool.slot_of)
        self.max_model_len = _max_model_len(args, self.model_config.max_position_embeddings)
        self.num_gpu_blocks, self.num_cpu_blocks = _num_blocks(args, self.executor,
                                                               self.max_model_len)
        self.executor.initialize_cache(args.block_size, self.num_gpu_blocks, self.num_cpu_blocks)
        kv = setup_kv_connector(args, self.executor)
        # the KV events of each step (KVEventLog: drain, iterate or subscribe); None: off
        self.kv_events = kv.events
        self.kv_key_namespace = kv.namespace  # what content keys are computed in (keys.py)
        self._kv_offload = kv.connector if isinstance(kv.connector, TieredOffloadScheduler) \
            else None
        self._clock = time.monotonic
        speculative = build_speculative(args, self.executor, self.num_gpu_blocks,
                                        self.num_cpu_blocks)
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens,
                max_model_len=self.max_model_len,
                policy=args.policy,
                queue=args.queue,
                preemption_mode=args.preemption_mode,
                long_prefill_token_threshold=args.long_prefill_token_threshold,
                max_num_partial_prefills=args.max_num_partial_prefills,
                max_loras=args.max_loras if args.enable_lora else 0,
            ),
            CacheConfig(
                block_size=args.block_size,
                num_gpu_blocks=self.num_gpu_blocks,
                num_cpu_blocks=self.num_cpu_blocks,
                enable_prefix_caching=args.enable_prefix_caching,
                kv_cache_groups=self.executor.kv_cache_groups,
            ),
            eos_token_ids=tuple(self.model_config.eos_token_ids),
            clock=self._clock,
            speculative=speculative,
            kv_connector=kv.connector,
            kv_events=kv.events,
            kv_key_namespace=kv.namespace,
        )
        # prefill/decode disaggregation's handoff (engine/kv_transfer.py); None: off
        self.kv_transfer = KVTransfer(self, kv.inbound) if args.kv_transfer else None
        self._outputs = OutputProcessor(self.tokenizer, self.scheduler.finish_sequence, self._clock)
        self._grammar: StructuredOutputManager | None = None  # built with the first constraint
        self._grammar_lock = threading.Lock()
        self._pooling_config: PoolingConfig | None = None
        self._retiring_loras: set[int] = set()  # removed, their weights kept while they run
        if loads_model:
            self.pooling_config  # noqa: B018 - a model's bad pooling config fails the load
        self._num_steps = 0
        self._scheduled_seqs_total = 0
        self._scheduled_tokens_total = 0
        self._prompt_tokens_total = 0
        self._generation_tokens_total = 0

    def shutdown(self) -> None:
        """Stop the executor's tensor-parallel workers and the grammar compile workers, if any
        (also done at garbage collection and interpreter exit)."""
        if self._grammar is not None:
            self._grammar.compile_cache.shutdown()
        if self.lora_pool is not None:
            self.lora_pool.shutdown()
        self.executor.shutdown()

    # ------------------------------------------------------------------ requests

    def add_request(self, request_id: str, prompt: Prompt,
                    sampling_params: SamplingParams | PoolingParams | None = None,
                    priority: int = 0, arrival_time: float | None = None,
                    fairness_key: str | None = None,
                    lora_request: LoRARequest | None = None) -> None:
        """Queue a request. ``prompt`` is text, token ids, or ``{"prompt_token_ids", "prompt"}``.
        Requests sharing a ``fairness_key`` (one client's) are admitted round-robin with others.
        With ``PoolingParams`` it is a pooling request: its output's ``embedding`` is the pooled
        hidden state (resolved against ``pooling_config``), and nothing is generated.
        ``lora_request``: the LoRA adapter it runs under (loaded on first use; the engine must
        have ``enable_lora``).

        Raises ValueError (naming the field) on bad input; nothing is queued then.
        """
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        if request_id in self._outputs:
            raise ValueError(f"request_id {request_id!r} is already in use")
        pooling = None
        if isinstance(sampling_params, PoolingParams):
            pooling = self.pooling_config.resolve(sampling_params)
            sampling_params = _POOLING_SAMPLING
        if sampling_params is None:
            sampling_params = SamplingParams()
        if not isinstance(sampling_params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(sampling_params).__name__}")
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"priority must be an integer, got {priority!r}")
        vocab = self.model_config.vocab_size
        if sampling_params.logit_bias and max(sampling_params.logit_bias) >= vocab:
            raise ValueError(f"logit_bias: token ids must be in [0, {vocab}), got "
                             f"{[t for t in sampling_params.logit_bias if t >= vocab][:5]}")
        lora_id = self._lora_id(lora_request)
        text, token_ids = self._tokenize(prompt)
        constrained = sampling_params.structured_outputs is not None
        grammar = self.structured_outputs if constrained else None
        group = self.scheduler.add_request(request_id, token_ids, sampling_params, priority=priority,
                                           arrival_time=arrival_time, fairness_key=fairness_key,
                                           wait_for_grammar=constrained, pooling_params=pooling,
                                           lora_id=lora_id)
        self._outputs.add_request(group, text)
        if grammar is not None and not group.is_finished:
            grammar.add_request(group)

    def _lora_id(self, lora_request: LoRARequest | None) -> int:
        """The adapter's id, loading it the first time; ValueError for a bad adapter or one the
        engine cannot serve."""
        if lora_request is None:
            return 0
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got "
                             f"{type(lora_request).__name__}")
        if self._served_lora(lora_request.lora_int_id) != lora_request:
            self.add_lora(lora_request)
        return lora_request.lora_int_id

    def _served_lora(self, lora_int_id: int) -> LoRARequest | None:
        """The adapter served under ``lora_int_id`` (not one removed whose requests still
        run)."""
        pool = self.lora_pool
        if pool is None or lora_int_id in self._retiring_loras:
            return None
        return pool.known.get(lora_int_id)

    def read_lora(self, lora_request: LoRARequest) -> LoRAAdapter:
        """Read and check an adapter's files (any thread: it changes nothing)."""
        if not self.engine_args.enable_lora:
            raise ValueError("LoRA adapters need an engine started with enable_lora=True "
                             "(--enable-lora)")
        return load_adapter(lora_request.lora_name, lora_request.lora_path, self.model_config,
                            self.engine_args.max_lora_rank)

    def add_lora(self, lora_request: LoRARequest, adapter: LoRAAdapter | None = None) -> None:
        """Serve ``lora_request``'s adapter (``adapter``: its files as ``read_lora`` read them);
        ValueError for a bad adapter, or an id already serving another one."""
        known = self._served_lora(lora_request.lora_int_id)
        if known is not None and known != lora_request:
            raise ValueError(f"lora_int_id {lora_request.lora_int_id} is already "
                             f"{known.lora_name!r} at {known.lora_path}")
        if adapter is None:
            adapter = self.read_lora(lora_request)
        assert self.lora_pool is not None  # read_lora checked enable_lora
        self._retiring_loras.discard(lora_request.lora_int_id)
        self.lora_pool.add(lora_request, adapter, self._pinned_loras())

    def remove_lora(self, lora_int_id: int) -> bool:
        """Stop serving an adapter: new requests may no longer name it; its weights go once
        its running requests have finished (they finish under it). False if unknown."""
        if self._served_lora(lora_int_id) is None:
            return False
        self._retiring_loras.add(lora_int_id)
        self._retire_loras()
        return True

    def _retire_loras(self) -> None:
        busy = {g.lora_id for g in self.scheduler.unfinished_groups()}
        for lora_id in [i for i in self._retiring_loras if i not in busy]:
            self._retiring_loras.discard(lora_id)
            if self.lora_pool is not None:
                self.lora_pool.remove(lora_id)

    def _pinned_loras(self) -> set[int]:
        """The adapters of the requests holding a slot: their weights stay in host memory."""
        return set(self.scheduler.lora_holders())

    def _feed_loras(self, pool: LoRAPool) -> list[RequestOutput]:
        """Before scheduling: take in the adapters read since the last step, start reading the
        ones the queue needs next, and tell the scheduler which are loaded. Requests of an
        adapter whose files can no longer be read finish aborted (the error is logged)."""
        s = self.scheduler
        if len(pool.known) <= pool.max_host and not pool.loading:
            s.loaded_loras = None  # every adapter served stays read
            return []
        idle = not (s.running or s.prefilling or s.swapped)
        aborted = []
        for lora_id, error in pool.poll(LORA_WAIT_S if idle else 0.0).items():
            logger.error("LoRA adapter %d can no longer be read; its requests are aborted: %s",
                         lora_id, error)
            self._retiring_loras.discard(lora_id)
            pool.remove(lora_id)
            for group in list(s.unfinished_groups()):
                if group.lora_id == lora_id:
                    out = self.abort_request(group.request_id)
                    if out is not None:
                        aborted.append(out)
        wanted = dict.fromkeys(seq.group.lora_id for seq in s.waiting if seq.group.lora_id)
        pool.prefetch(wanted, self._pinned_loras())
        s.loaded_loras = set(pool.host)
        return aborted

    @property
    def pooling_config(self) -> PoolingConfig:
        """How this model pools embeddings by default (``--pooling`` or its own config)."""
        if self._pooling_config is None:
            from conveyor.model.loader import model_path

            self._pooling_config = read_pooling_config(
                model_path(self.engine_args.model), self.model_config.hidden_size,
                self.engine_args.pooling)
        return self._pooling_config

    @property
    def structured_outputs(self) -> StructuredOutputManager:
        """The grammar side of constrained requests (built on first use: it reads the whole
        vocabulary once). Its ``compile_cache`` may be used from any thread."""
        with self._grammar_lock:
            if self._grammar is None:
                from conveyor.structured_outputs import (
                    GrammarCompileCache,
                    StructuredOutputManager,
                    tokenizer_info,
                )

                vocab = self.model_config.vocab_size
                info = tokenizer_info(self.tokenizer, vocab, self.model_config.eos_token_ids)
                args = self.engine_args
                cache = GrammarCompileCache(info, args.structured_outputs_compile_timeout,
                                            args.structured_outputs_cache_bytes)
                self._grammar = StructuredOutputManager(cache, vocab)
                self.executor.use_structured_outputs(self._grammar)
            return self._grammar

    def _tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        text: str | None = None
        if isinstance(prompt, dict):
            text, token_ids = prompt.get("prompt"), prompt.get("prompt_token_ids")
            if token_ids is None:
                if not isinstance(text, str):
                    raise ValueError("prompt: a dict prompt needs 'prompt_token_ids' or a 'prompt' string")
                return self._tokenize(text)
        elif isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            text, token_ids = prompt, self.tokenizer.encode(prompt)
        else:
            token_ids = prompt
        if not isinstance(token_ids, (list, tuple)) or not token_ids:
            raise ValueError("prompt_token_ids must be a non-empty list of token ids")
        vocab = self.model_config.vocab_size
        bad = [t for t in token_ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt_token_ids must be integers in [0, {vocab}), got {bad[:5]!r}")
        return text, list(token_ids)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request wherever it is and free its blocks; its final output (None if unknown)."""
        group = self.scheduler.abort(request_id)
        if group is None:
            return None
        if self._grammar is not None:
            self._grammar.remove(request_id)
        if self._retiring_loras:
            self._retire_loras()
        return self._outputs.finish_aborted(group)

    def kv_events_snapshot(self) -> KVEventBatch:
        """Every KV block the pool and the offload tiers hold now, as one batch of KV events
        (``core/kv_connector/snapshot.py``), for a reader that missed batches; the log's queued
        batches, which it supersedes, are dropped. Call it between steps (the engine's thread).
        ValueError when KV events are off."""
        if self.kv_events is None:
            raise ValueError("KV events are off: start the engine with kv_events (--kv-events)")
        self.kv_events.drain()
        bm = self.scheduler.block_manager
        tiers = self._kv_offload.held() if self._kv_offload is not None else ()
        return KVEventBatch(time.time(), snapshot_events(self.kv_events.block_size,
                                                         bm.gpu.keyed_records(), bm.root_key,
                                                         tiers))

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or len(self._outputs) > 0

    # ------------------------------------------------------------------ the loop

    def step(self) -> list[RequestOutput]:
        """Run one engine iteration; one cumulative output per request that progressed or finished."""
        grammar = self._grammar
        failed = self._admit_compiled(grammar) if grammar is not None else []
        pool = self.lora_pool
        if pool is not None:
            failed += self._feed_loras(pool)
        scheduled = self.scheduler.schedule()
        if pool is not None:
            pool.place({seq.group.lora_id for seq in scheduled.seqs if seq.group.lora_id})
        num_samples = [scheduled.num_samples(i) for i in range(len(scheduled.seqs))]
        self._count_prompt_tokens(scheduled)
        drafts = None
        connector_output = None
        if scheduled.is_empty and scheduled.kv_connector_metadata is None \
                and not self.scheduler.loading:
            sampled, logprobs = [], None
        elif scheduled.is_empty:  # the KV connector's ops, or waiting for its loads
            sampled, logprobs = [], None
            connector_output = self.executor.execute(scheduled).kv_connector_output
        else:
            result = self.executor.execute(scheduled)
            connector_output = result.kv_connector_output
            drafts = result.draft_token_ids
            sampled, logprobs = result.sampled_token_ids, result.logprobs
            for i, (first, entries) in (result.prompt_logprobs or {}).items():
                self._outputs.add_prompt_logprobs(scheduled.seqs[i], first, entries)
            for i, vector in (result.pooled or {}).items():
                self._outputs.add_embedding(scheduled.seqs[i], vector)
            self._num_steps += 1
            self._scheduled_seqs_total += len(scheduled.seqs)
            self._scheduled_tokens_total += scheduled.num_batched_tokens
        self._generation_tokens_total += sum(len(tokens) for tokens in sampled)
        parents = list(scheduled.seqs)
        finished = self.scheduler.update(scheduled, sampled)
        if connector_output is not None:
            self.scheduler.update_kv_connector(connector_output)
        if drafts is not None:
            self.scheduler.update_draft_token_ids(scheduled, drafts)
        if grammar is not None:
            finished += self._finish_ended_grammars(grammar, parents)
        if logprobs is not None:
            self._record_logprobs(parents, num_samples, sampled, logprobs)
        groups = [seq.group for seq in parents] + list(finished)
        outputs = failed + self._outputs.process(groups)
        if self._retiring_loras and finished:
            self._retire_loras()
        if grammar is not None:
            for out in outputs:
                if out.finished:
                    grammar.remove(out.request_id)
        if self.kv_events is not None:
            self.kv_events.flush(time.time())
        return outputs

    def reset_prefix_cache(self) -> bool:
        """Forget every cached KV block, the pool's and the offload tiers' (their files too),
        when no request holds blocks; False (nothing forgotten) otherwise."""
        if not self.scheduler.clear_prefix_cache():
            return False
        connector = self.scheduler.kv_connector
        meta = connector.build_metadata() if connector is not None else None
        if meta is not None:  # the runner half clears its tiers now, not at the next step
            out = self.executor.execute(SchedulerOutput(kv_connector_metadata=meta))
            if out.kv_connector_output is not None:
                self.scheduler.update_kv_connector(out.kv_connector_output)
        if self.kv_events is not None:
            self.kv_events.flush(time.time())
        return True

    def _admit_compiled(self, grammar: StructuredOutputManager) -> list[RequestOutput]:
        """Queue the requests whose grammar compiled; finish those whose compile failed (only
        them: the rest of the batch runs on). Waits briefly when nothing else can run."""
        if not grammar.has_pending():
            return []
        s = self.scheduler
        idle = not (s.running or s.prefilling or s.waiting or s.swapped)
        ready, failed = grammar.poll(GRAMMAR_WAIT_S if idle else 0.0)
        for request_id in ready:
            s.grammar_ready(request_id)
        outputs = []
        for request_id, error in failed:
            group = s.abort(request_id)
            if group is not None:
                group.finish_message = error
                outputs.append(self._outputs.finish_aborted(group))
        return outputs

    def _finish_ended_grammars(self, grammar: StructuredOutputManager,
                               parents: list[Sequence]) -> list[SequenceGroup]:
        """A sequence whose grammar has ended stops (finish reason ``stop``) even where its
        last token was not a stop token for the scheduler (e.g. under ``ignore_eos``)."""
        finished = []
        for seq in grammar.advance(parents):
            group = self.scheduler.finish_sequence(seq, SequenceStatus.FINISHED_STOPPED)
            if group is not None:
                finished.append(group)
        return finished

    def _count_prompt_tokens(self, scheduled: SchedulerOutput) -> None:
        for seq, n_new in zip(scheduled.seqs, scheduled.num_new_tokens, strict=True):
            is_decode = n_new == 1 + len(seq.spec_token_ids) \
                and seq.num_computed_tokens == len(seq.token_ids) - 1 \
                and seq.num_computed_tokens >= seq.num_prompt_tokens
            if not is_decode:
                self._prompt_tokens_total += n_new

    def _record_logprobs(self, parents: list[Sequence], num_samples: list[int],
                         sampled: list[list[int]], logprobs: list[list[dict[int, float]]]) -> None:
        for i, seq in enumerate(parents):
            if num_samples[i] == 0 or not logprobs[i]:  # a verified proposal asks for none
                continue
            if num_samples[i] == 1:
                self._outputs.add_logprobs(seq, sampled[i][0], logprobs[i][0])
                continue
            by_index = {s.index: s for s in seq.group.seqs}  # the fork: sample k went to seq k
            for k, token_id in enumerate(sampled[i]):
                if k in by_index:
                    self._outputs.add_logprobs(by_index[k], token_id, logprobs[i][k])

    # ------------------------------------------------------------------ stats

    def get_stats(self) -> EngineStats:
        stats = EngineStats(self.scheduler.stats)
        stats.num_steps = self._num_steps
        stats.scheduled_seqs_total = self._scheduled_seqs_total
        stats.scheduled_tokens_total = self._scheduled_tokens_total
        stats.prompt_tokens_total = self._prompt_tokens_total
        stats.generation_tokens_total = self._generation_tokens_total
        stats.finished_by_reason = dict(self._outputs.finished_by_reason)
        if self._kv_offload is not None:
            stats.kv_offload = self._kv_offload.stats
        if isinstance(self.scheduler.kv_connector, InboundKVScheduler):
            stats.kv_transfer = self.scheduler.kv_connector.stats
        pool = self.lora_pool
        if pool is not None:
            stats.lora_adapters_in_memory = len(pool.host)
            stats.lora_slot_installs = pool.num_installs
            stats.lora_adapter_reads = pool.num_reads
            stats.max_loras = pool.max_slots
            running = self._pinned_loras()
            queued = {g.lora_id for g in self.scheduler.unfinished_groups() if g.lora_id}

            def name(i: int) -> str:
                return pool.known[i].lora_name if i in pool.known else str(i)

            stats.lora_running_adapters = sorted(map(name, running))
            stats.lora_waiting_adapters = sorted(map(name, queued - running))
        return stats


def _max_model_len(args: EngineArgs, max_positions: int) -> int:
    """The context length the engine promises: the model's (capped at 8192 by default), and
    never more than the policy can run (``SchedulingPolicy.seq_len_cap``): by default the
    context shrinks to that, and an explicit larger ``max_model_len`` is refused rather than
    cutting requests short."""
    policy_cap = args.policy.seq_len_cap(args.max_num_batched_tokens)
    if args.max_model_len is None:
        limit = min(max_positions, DEFAULT_MAX_MODEL_LEN_CAP)
        return limit if policy_cap is None else min(limit, policy_cap)
    if not 1 <= args.max_model_len <= max_positions:
        raise ValueError(f"max_model_len must be in [1, {max_positions}] for this model, "
                         f"got {args.max_model_len}")
    if policy_cap is not None and args.max_model_len > policy_cap:
        raise ValueError(f"max_model_len={args.max_model_len} is more than policy 'prefill_first' "
                         f"can run: it computes a whole sequence in one step of at most "
                         f"max_num_batched_tokens={policy_cap} tokens; raise "
                         f"--max-num-batched-tokens to {args.max_model_len}, lower "
                         "--max-model-len, or use --policy chunked")
    return args.max_model_len


def _num_blocks(args: EngineArgs, executor: EngineExecutor, max_model_len: int | None = None
                ) -> tuple[int, int]:
    """(GPU-pool blocks, CPU swap-pool blocks) from the memory budgets in ``args``
    (``bytes_per_block``: on one rank, for its share of the KV heads). Without a budget, on the
    CPU: room for ``max_num_seqs`` sequences of ``max_model_len`` tokens, at most
    ``DEFAULT_CPU_KV_CACHE_BYTES`` and a quarter of the available memory."""
    bytes_per_block = executor.kv_cache_bytes_per_block(args.block_size)
    local_ranks = executor.parallel.local_ranks
    on_cuda = executor.device.type == "cuda"
    budget = args.kv_cache_memory
    if args.num_gpu_blocks is not None:
        if args.num_gpu_blocks < 1:
            raise ValueError(f"num_gpu_blocks must be >= 1, got {args.num_gpu_blocks}")
        num_gpu = args.num_gpu_blocks
        why = "--num-gpu-blocks"
    elif on_cuda and (budget is None or budget <= 1):
        from conveyor.executor.gpu_memory import cuda_kv_cache_blocks

        num_gpu = cuda_kv_cache_blocks(executor, args.block_size, args.gpu_memory_utilization,
                                       args.max_num_batched_tokens, args.max_num_seqs)
        why = f"--gpu-memory-utilization {args.gpu_memory_utilization}"
    else:
        if budget is not None and budget <= 0:
            raise ValueError(f"kv_cache_memory must be > 0, got {budget}")
        available = None if budget is not None and budget > 1 \
            else _available_memory(executor.device)
        if budget is None:
            budget = min(DEFAULT_CPU_KV_CACHE_BYTES, DEFAULT_CPU_KV_CACHE_FRACTION * available)
            why = (f"default: at most {DEFAULT_CPU_KV_CACHE_BYTES / 2**30:g} GiB and "
                   f"{DEFAULT_CPU_KV_CACHE_FRACTION:.0%} of available memory "
                   "(--kv-cache-memory)")
        else:
            why = f"--kv-cache-memory {args.kv_cache_memory:g}"
            if budget <= 1:
                budget *= available
        if not on_cuda:
            budget /= local_ranks  # one machine's memory, shared by its ranks
        num_gpu = int(budget // bytes_per_block)
        if num_gpu < 1:
            raise ValueError(f"kv_cache_memory ({args.kv_cache_memory}) holds no KV block of "
                             f"{bytes_per_block} bytes")
        if args.kv_cache_memory is None and max_model_len is not None:
            # every KV-cache group's blocks (a block holds one group's layers)
            groups = max(1, len(executor.kv_cache_groups))
            needed = args.max_num_seqs * -(-max_model_len // args.block_size) * groups
            if needed < num_gpu:
                num_gpu = needed
                why = (f"default: room for --max-num-seqs {args.max_num_seqs} sequences of "
                       f"{max_model_len} tokens (--kv-cache-memory)")
    logger.info("KV cache: %d blocks of %d tokens (%d tokens, %.2f GiB per rank); %s",
                num_gpu, args.block_size, num_gpu * args.block_size,
                num_gpu * bytes_per_block / 2**30, why)
    return num_gpu, _num_cpu_blocks(args, bytes_per_block, local_ranks)


def _num_cpu_blocks(args: EngineArgs, bytes_per_block: int, local_ranks: int = 1) -> int:
    if args.preemption_mode is not PreemptionMode.SWAP:
        return 0
    if args.swap_space < 0:
        raise ValueError(f"swap_space must be >= 0, got {args.swap_space}")
    return int(args.swap_space * 2**30 / local_ranks // bytes_per_block)


def _available_memory(device: torch.device) -> int:
    """Free bytes on the KV cache's device (GPU memory, or the host's available RAM)."""
    if str(device).startswith("cuda"):
        import torch

        free, _total = torch.cuda.mem_get_info(device)
        return free
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    import os

    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
