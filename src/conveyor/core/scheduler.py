"""Scheduler: requests in, SchedulerOutputs out — queues, admission, preemption, postprocessing.

The scheduler owns the queues (``waiting``, ``running``, ``prefilling``, ``swapped``) and the
BlockManager; a policy module decides each step (``prefill_first`` or ``chunked``, see
docs/scheduler.md). ``update()`` appends the sampled tokens, forks n>1 groups, applies the stop
rules (EOS, stop_token_ids, max_tokens, max_model_len, min_tokens) and frees finished sequences.

Queues:
* ``waiting``: sequences to (re)prefill (fcfs deque or priority heap; preempted ones in front);
* ``running``: decoding sequences (and, under prefill_first, the ones admitted this step), in
  the order the policy keeps them; finished ones are dropped lazily at the next schedule();
* ``prefilling``: chunked only — admitted sequences whose prompt is not fully computed yet;
* ``swapped``: sequences whose KV blocks sit in the CPU pool;
* ``waiting_for_grammar``: requests added with ``wait_for_grammar`` (status
  WAITING_FOR_GRAMMAR) until ``grammar_ready()`` queues them; the policies never see them;
* ``loading``: with a KV connector, sequences (status WAITING_FOR_KV) whose prefix it is loading,
  back to ``waiting`` when it reports the load finished (``core/kv_loading.py``).

The decode fast path: a sequence whose next token still fits its last block needs no
block-manager call. ``update()`` compares ``len(token_ids)`` with one precomputed number per
sequence (``next_check_len``: the length cap or the next block boundary) and checks stop ids in
a frozenset; sequences crossing a block boundary go to ``seqs_needing_block`` and get their
block in the next schedule().
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections import Counter
from collections.abc import Callable
from operator import attrgetter

from conveyor.core.block_manager import BlockManager
from conveyor.core.chunked import schedule_chunked
from conveyor.core.config import (
    CacheConfig,
    PreemptionMode,
    QueueOrder,
    SchedulerConfig,
    SchedulingPolicy,
)
from conveyor.core.kv_connector.events import KVEventLog
from conveyor.core.kv_connector.interface import KVConnectorOutput, KVConnectorScheduler
from conveyor.core.kv_connector.pool_observer import PoolObserver
from conveyor.core.kv_loading import finish_loads, start_load
from conveyor.core.lookahead import release_lookahead
from conveyor.core.lora_admission import LoRAAdmission
from conveyor.core.pooling_params import PoolingParams
from conveyor.core.prefill_first import schedule_prefill_first
from conveyor.core.request_queue import make_queue, priority_key
from conveyor.core.sampling_params import SamplingParams
from conveyor.core.scheduler_interface import Policy
from conveyor.core.scheduler_output import SchedulerOutput
from conveyor.core.sequence import Sequence, SequenceGroup, SequenceStatus
from conveyor.core.spec_decode.config import SpeculativeConfig
from conveyor.core.stats import SchedulerStats

WAITING = SequenceStatus.WAITING
RUNNING = SequenceStatus.RUNNING
SWAPPED = SequenceStatus.SWAPPED
FINISHED_STOPPED = SequenceStatus.FINISHED_STOPPED
FINISHED_LENGTH_CAPPED = SequenceStatus.FINISHED_LENGTH_CAPPED
FINISHED_ABORTED = SequenceStatus.FINISHED_ABORTED
FINISHED_IGNORED = SequenceStatus.FINISHED_IGNORED
WAITING_FOR_GRAMMAR = SequenceStatus.WAITING_FOR_GRAMMAR
WAITING_FOR_KV = SequenceStatus.WAITING_FOR_KV


_running_stamp = attrgetter("running_stamp")


class Scheduler:
    """Implements SchedulerInterface, the part the policies drive."""

    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig,
                 eos_token_ids: tuple[int, ...] | list[int] = (),
                 clock: Callable[[], float] = time.monotonic,
                 speculative: SpeculativeConfig | None = None,
                 kv_connector: KVConnectorScheduler | None = None,
                 kv_events: KVEventLog | None = None,
                 kv_key_namespace: bytes | None = None) -> None:
        """``speculative``: decodes take lookahead slots for the tokens the executor proposed
        after the last step (``update_draft_token_ids``, core/lookahead.py).
        ``kv_connector``: its scheduler half (``core/kv_connector``), which loads prefixes from
        outside the pool and is told what the pool evicts; ``kv_events``: where the pool's
        stored and removed blocks are recorded. Either keys blocks by content in
        ``kv_key_namespace`` (the model and KV layout's identity)."""
        if scheduler_config.preemption_mode is PreemptionMode.SWAP \
                and cache_config.num_cpu_blocks == 0:
            raise ValueError("preemption_mode='swap' needs a CPU swap pool: set "
                             "CacheConfig.num_cpu_blocks > 0 (swap_space) or use "
                             "preemption_mode='recompute'")
        self.config = scheduler_config
        self.cache_config = cache_config
        keyed = kv_connector is not None or kv_events is not None
        if keyed and kv_key_namespace is None:
            raise ValueError("a KV connector or KV events need a kv_key_namespace")
        self.block_manager = BlockManager(cache_config, kv_key_namespace if keyed else None)
        bm = self.block_manager
        if kv_connector is not None and (bm.num_groups != 1 or not bm.enable_prefix_caching):
            raise ValueError("a KV connector needs prefix caching on and one KV-cache group "
                             f"(this cache has {bm.num_groups}, prefix caching "
                             f"{'on' if bm.enable_prefix_caching else 'off'})")
        if keyed:
            bm.gpu.observer = PoolObserver(kv_events, kv_connector, bm.root_key)
        self.kv_connector = kv_connector
        self.kv_events = kv_events
        self.loading: dict[int, Sequence] = {}
        self.block_size = cache_config.block_size
        self.eos_token_ids = frozenset(eos_token_ids)
        self.clock = clock
        self.waiting = make_queue(scheduler_config.queue, WAITING)
        self.swapped = make_queue(scheduler_config.queue, SWAPPED)
        self.running: list[Sequence] = []
        self.prefilling: list[Sequence] = []
        self.waiting_for_grammar: dict[str, Sequence] = {}
        # LoRA adapters whose weights are loaded (the engine's LoRAPool); None: all of them
        self.loaded_loras: set[int] | None = None
        self.seqs_needing_block: list[Sequence] = []  # running ones whose next slot needs a block
        # sequences that stopped running (finished or aborted) since the last schedule(); those
        # still in `running` are dropped from it lazily
        self._stopped_running: list[Sequence] = []
        self.swap_mode = scheduler_config.preemption_mode is PreemptionMode.SWAP
        self.priority_queue = scheduler_config.queue is QueueOrder.PRIORITY
        self.chunked = scheduler_config.policy is SchedulingPolicy.CHUNKED
        # the longest sequence that can ever be (re)computed: model, policy and whole cache
        # (prefill_first recomputes a preempted sequence in one step)
        self.max_seq_len = min(scheduler_config.max_seq_len,
                               self.block_manager.max_tokens(one_step=not self.chunked))
        self._groups: dict[str, SequenceGroup] = {}
        self._finished: list[SequenceGroup] = []  # reported by the next update()
        self._next_seq_id = 0
        self._running_stamp = 0
        self._detached_since_schedule = False  # abort/finish_sequence since the last schedule()
        # per-step block operations, handed to the SchedulerOutput
        self.step_swap_out: list[tuple[int, int]] = []
        self.step_swap_in: list[tuple[int, int]] = []
        self.preempted_this_step = False
        self.num_preemptions = 0
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.speculative = speculative
        self.spec_draft_tokens = 0  # proposed tokens verified
        self.spec_accepted_tokens = 0  # of those, accepted
        self.spec_verifications = 0  # decodes that verified a proposal
        self._policy: Policy = schedule_chunked if self.chunked else schedule_prefill_first

    # ------------------------------------------------------------------ requests

    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    sampling_params: SamplingParams, priority: int = 0,
                    arrival_time: float | None = None,
                    fairness_key: str | None = None,
                    wait_for_grammar: bool = False,
                    pooling_params: PoolingParams | None = None,
                    lora_id: int = 0) -> SequenceGroup:
        """Queue a request; ValueError (naming the field) on bad input, nothing queued then.
        Requests sharing a ``fairness_key`` are admitted round-robin with other keys' requests
        of their priority (``request_queue``); None: the request id.

        ``wait_for_grammar``: hold it as WAITING_FOR_GRAMMAR until ``grammar_ready()``.
        ``pooling_params``: a pooling request; it finishes (FINISHED_STOPPED) in the step that
        computes its last prompt token, sampling nothing. ``lora_id``: the LoRA adapter it runs
        under (0: none); it keys its prefix-cache blocks and counts toward ``max_loras``.

        A prompt that can never run (longer than max_model_len, or needing more KV blocks than
        the whole cache) finishes at once as FINISHED_IGNORED with ``group.finish_message``;
        the next update() reports it.
        """
        if request_id in self._groups:
            raise ValueError(f"request_id {request_id!r} is already in use by an unfinished request")
        if not isinstance(prompt_token_ids, (list, tuple)) or not prompt_token_ids:
            raise ValueError("prompt_token_ids must be a non-empty list of token ids")
        if set(map(type, prompt_token_ids)) != {int} or min(prompt_token_ids) < 0:
            raise ValueError("prompt_token_ids must contain only integers >= 0")
        if not isinstance(sampling_params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, "
                             f"got {type(sampling_params).__name__}")
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"priority must be an integer, got {priority!r}")
        if pooling_params is not None and not isinstance(pooling_params, PoolingParams):
            raise ValueError(f"pooling_params must be a PoolingParams or None, "
                             f"got {type(pooling_params).__name__}")
        if not isinstance(lora_id, int) or isinstance(lora_id, bool) or lora_id < 0:
            raise ValueError(f"lora_id must be an integer >= 0, got {lora_id!r}")
        now = self.clock()
        if arrival_time is None:
            arrival_time = now
        prompt = list(prompt_token_ids)
        group = SequenceGroup(request_id, prompt, sampling_params, priority, arrival_time,
                              fairness_key, pooling_params, lora_id)
        seq = Sequence(self._new_seq_id(), group, 0, list(prompt), len(prompt))
        self._set_stop_limits(seq)
        group.seqs.append(seq)
        reason = self._ignore_reason(len(prompt))
        if reason is not None:
            seq.status = FINISHED_IGNORED
            group.finish_message = reason
            group.metrics.finished_time = now
            self._finished.append(group)
            return group
        self._groups[request_id] = group
        if wait_for_grammar:
            seq.status = WAITING_FOR_GRAMMAR
            self.waiting_for_grammar[request_id] = seq
        else:
            self.waiting.append(seq)
        return group

    def grammar_ready(self, request_id: str) -> None:
        """A request's grammar compiled: it joins the back of ``waiting`` (no-op if gone)."""
        seq = self.waiting_for_grammar.pop(request_id, None)
        if seq is not None:
            seq.status = WAITING
            self.waiting.append(seq)

    def _new_seq_id(self) -> int:
        self._next_seq_id += 1
        return self._next_seq_id - 1

    def _ignore_reason(self, prompt_len: int) -> str | None:
        cfg = self.config
        if prompt_len > cfg.max_model_len:
            return (f"prompt has {prompt_len} tokens, more than max_model_len={cfg.max_model_len}; "
                    "shorten the prompt or raise max_model_len")
        if prompt_len > cfg.max_seq_len:
            return (f"prompt has {prompt_len} tokens but policy 'prefill_first' computes a whole "
                    f"prompt in one step of at most max_num_batched_tokens="
                    f"{cfg.max_num_batched_tokens} tokens; raise max_num_batched_tokens or use "
                    "policy 'chunked'")
        blocks = self.block_manager.blocks_to_compute(prompt_len, one_step=not self.chunked)
        total = self.cache_config.num_gpu_blocks
        if blocks > total:
            return (f"prompt needs {blocks} KV-cache blocks of {self.block_size} tokens but the "
                    f"whole cache has {total}; shorten the prompt or give the KV cache more memory")
        return None

    def _set_stop_limits(self, seq: Sequence) -> None:
        sp = seq.group.sampling_params
        n = seq.num_prompt_tokens
        max_len = self.max_seq_len
        if sp.max_tokens is not None:
            max_len = min(max_len, n + sp.max_tokens)
        seq.max_len = max(max_len, n)
        seq.min_len = n + sp.min_tokens
        stop = set(sp.stop_token_ids)
        if not sp.ignore_eos:
            stop |= self.eos_token_ids
        seq.stop_ids = frozenset(stop)

    def has_unfinished_requests(self) -> bool:
        """Also while an aborted request's load is in flight (its blocks are still held)."""
        return bool(self._groups) or bool(self._finished) or bool(self.loading)

    # ------------------------------------------------------------------ schedule

    def schedule(self) -> SchedulerOutput:
        """Decide this step's work (see the policy modules); call update() after it."""
        if self._stopped_running:
            self._drop_stopped_running()
        self._detached_since_schedule = False
        self.preempted_this_step = False
        out = self._policy(self)
        if (not out.seqs and (self.running or self.prefilling or self.waiting or self.swapped)
                and not self.loading and not self._waits_for_loras()):
            # Every policy admits a request that fits the empty cache (anything larger was
            # ignored at add_request), so this is a scheduler bug: say so rather than spin.
            raise RuntimeError(f"scheduler made no progress with work queued: {self.stats}")
        bm = self.block_manager
        if bm.blocks_to_copy:
            out.blocks_to_copy = bm.blocks_to_copy
            bm.blocks_to_copy = []
        if self.step_swap_out:
            out.blocks_to_swap_out = self.step_swap_out
            self.step_swap_out = []
        if self.step_swap_in:
            out.blocks_to_swap_in = self.step_swap_in
            self.step_swap_in = []
            bm.end_step()
        if self.kv_connector is not None:
            out.kv_connector_metadata = self.kv_connector.build_metadata()
        return out

    def _waits_for_loras(self) -> bool:
        """Every waiting request waits for its LoRA adapter's weights (the engine is loading
        them): an empty step is no scheduler bug then."""
        admission = self.lora_admission()
        return (admission is not None and not (self.running or self.prefilling or self.swapped)
                and self.next_waiting(admission) is None and admission.skipped_unloaded)

    def _stopped_positions(self) -> list[int] | None:
        """Where the sequences of ``_stopped_running`` sit in ``running``, highest first (some
        never joined it); None when there are too many to look up one by one."""
        running = self.running
        stopped = self._stopped_running
        if len(stopped) * 8 >= len(running):
            return None
        positions = []
        for seq in stopped:  # running is sorted by stamp: a bisection finds each
            k = bisect_left(running, seq.running_stamp, key=_running_stamp)
            if k < len(running) and running[k] is seq:
                positions.append(k)
        positions.sort(reverse=True)
        return positions

    def _drop_stopped_running(self) -> None:
        positions = self._stopped_positions()
        if positions is None:
            self.running = [s for s in self.running if s.status is RUNNING]
        else:
            running = self.running
            for k in positions:
                del running[k]
        self._stopped_running.clear()

    def join_running(self, seq: Sequence) -> None:
        """Append to ``running``, which stays sorted by join order (stamps)."""
        self._running_stamp += 1
        seq.running_stamp = self._running_stamp
        self.running.append(seq)

    def set_next_check_len(self, seq: Sequence) -> None:
        cap = len(seq.block_tables[0]) * self.block_size + 1
        seq.next_check_len = cap if cap < seq.max_len else seq.max_len

    def admit(self, seq: Sequence, hits: list[list[int]], num_tokens: int, now: float) -> None:
        """Waiting -> computed: blocks for ``num_tokens`` (with ``hits``, per group, reused)."""
        self.block_manager.admit(seq, hits, num_tokens)
        seq.status = RUNNING
        seq.kv_load_tried = False
        self.set_next_check_len(seq)
        cached = seq.num_computed_tokens
        if self.block_manager.enable_prefix_caching:
            self.prefix_cache_queries += len(seq.token_ids)
            self.prefix_cache_hits += cached
        metrics = seq.group.metrics
        if metrics.first_scheduled_time is None:
            metrics.first_scheduled_time = now
            metrics.num_cached_tokens = cached

    def start_load(self, seq: Sequence, hits: list[list[int]]) -> bool:
        """Waiting -> loading, when the KV connector holds ``seq``'s blocks past ``hits``
        (``core/kv_loading.py``); False: admit it as usual."""
        return start_load(self, seq, hits)

    def update_kv_connector(self, output: KVConnectorOutput) -> None:
        """The runner half's report after a step: finished loads, lost stored blocks."""
        finish_loads(self, output)
        if self.kv_connector is not None:
            self.kv_connector.update(output)

    def clear_prefix_cache(self) -> bool:
        """Forget every cached block, the pool's and the KV connector's, when no request holds
        blocks; False (nothing forgotten) otherwise."""
        if not self.block_manager.gpu.clear_cached():
            return False
        if self.kv_connector is not None:
            self.kv_connector.clear()
        return True

    def preempt(self, seq: Sequence) -> None:
        """Take ``seq``'s blocks away: swap them to the CPU pool, else recompute later.

        The caller removes ``seq`` from running / prefilling (or leaves it to the status filter).
        """
        self.num_preemptions += 1
        seq.group.metrics.num_preemptions += 1
        release_lookahead(self, seq)
        self.preempted_this_step = True
        bm = self.block_manager
        redirect = bm.void_copies(seq) if bm.blocks_to_copy else None
        if self.swap_mode and bm.can_swap_out(seq):
            self.step_swap_out.extend(bm.swap_out(seq, redirect))
            seq.status = SWAPPED
            self.swapped.push_front(seq)
        else:
            bm.free(seq)
            seq.num_computed_tokens = 0
            seq.status = WAITING
            self.waiting.push_front(seq)

    def is_decoding(self, seq: Sequence) -> bool:
        """Has sampled, and only its last token is left to compute."""
        n = len(seq.token_ids)
        return seq.num_computed_tokens == n - 1 and n > seq.num_prompt_tokens

    def _resume_tokens(self, seq: Sequence) -> int:
        """Slots a swapped sequence needs back: its computed tokens plus the next one (its
        decode, or one more prompt token), so that it can make progress in the step."""
        return seq.num_computed_tokens + 1

    def swap_in(self, seq: Sequence) -> None:
        """Swapped -> running: blocks back from the CPU pool; the caller checked free blocks."""
        self.step_swap_in.extend(self.block_manager.swap_in(seq, self._resume_tokens(seq)))
        seq.status = RUNNING
        self.set_next_check_len(seq)

    def blocks_to_swap_in(self, seq: Sequence) -> int:
        return self.block_manager.num_blocks_to_swap_in(seq, self._resume_tokens(seq))

    def lora_holders(self) -> Counter[int]:
        """Sequences per LoRA adapter that hold one of its slots: running, prefilling or
        swapped out."""
        return Counter(s.group.lora_id for s in (*self.running, *self.prefilling, *self.swapped)
                       if s.group.lora_id and not s.status.is_finished)

    def lora_admission(self) -> LoRAAdmission | None:
        """This step's gate on waiting requests by LoRA adapter (core/lora_admission.py);
        None when adapters limit nothing."""
        if not self.config.max_loras and self.loaded_loras is None:
            return None
        running = self.lora_holders()
        return LoRAAdmission(self.config.max_loras or len(running) + 1, running,
                             self.loaded_loras)

    def next_waiting(self, admission: LoRAAdmission | None) -> Sequence | None:
        """The first waiting sequence that may start: the queue's head, or under
        ``admission`` the first in queue order whose adapter it allows."""
        head = self.waiting.peek()
        if admission is None or head is None or admission.allows(head):
            return head
        return next((s for s in self.waiting if s is not head and admission.allows(s)), None)

    def lowest_priority(self, candidates: list[Sequence]) -> Sequence | None:
        best = None
        best_key = None
        for s in candidates:
            if s.status is RUNNING:
                k = priority_key(s)
                if best_key is None or k > best_key:
                    best, best_key = s, k
        return best

    # ------------------------------------------------------------------ update

    def update(self, scheduler_output: SchedulerOutput,
               sampled_token_ids: list[list[int]]) -> list[SequenceGroup]:
        """Apply one step's sampled tokens; returns the groups finished since the last update
        (including ignored ones). ``sampled_token_ids[i]`` holds ``num_samples(i)`` tokens."""
        seqs = scheduler_output.seqs
        if len(sampled_token_ids) != len(seqs):
            raise ValueError(f"sampled_token_ids has {len(sampled_token_ids)} entries for "
                             f"{len(seqs)} scheduled sequences")
        num_decodes = 0 if self._detached_since_schedule else scheduler_output.num_decodes
        spec = self.speculative
        if scheduler_output.num_spec_tokens or (spec is not None and spec.drafting_slots):
            num_decodes = scheduler_output.num_decodes
            self._update_speculative(seqs[:num_decodes], sampled_token_ids)
        elif num_decodes:
            needing_block = self.seqs_needing_block
            check_decode = self._check_decode
            if num_decodes == len(seqs):
                pairs = zip(seqs, sampled_token_ids, strict=True)
            else:
                pairs = zip(seqs[:num_decodes], sampled_token_ids, strict=False)
            for seq, toks in pairs:
                tids = seq.token_ids
                tok = toks[0]
                tids.append(tok)
                seq.num_computed_tokens += 1
                if len(tids) >= seq.next_check_len or tok in seq.stop_ids:
                    check_decode(seq, tok, needing_block)
        if num_decodes < len(seqs):
            self._update_generic(scheduler_output, sampled_token_ids, num_decodes)
        finished = self._finished
        self._finished = []
        return finished

    def update_draft_token_ids(self, scheduler_output: SchedulerOutput,
                               draft_token_ids: list[list[int]]) -> None:
        """The executor's proposals after a step (after ``update``): entry i's sequence may
        verify ``draft_token_ids[i]`` in its next decode (an empty list: no proposal)."""
        for seq, drafts in zip(scheduler_output.seqs, draft_token_ids, strict=True):
            if seq.status is RUNNING:
                seq.draft_token_ids = drafts

    def _update_speculative(self, seqs: list[Sequence], sampled: list[list[int]]) -> None:
        """Decodes of a step that verified proposals (or held slots for drafting): each gets its
        accepted tokens and the next one, stopping at the first that ends it; the lookahead slots
        past them are given back."""
        bm = self.block_manager
        for seq, toks in zip(seqs, sampled, strict=False):
            if seq.status is not RUNNING:  # aborted or finished between schedule and update
                continue
            drafts = seq.spec_token_ids
            if drafts:
                seq.spec_token_ids = []
                accepted = len(toks) - 1
                metrics = seq.group.metrics
                metrics.num_draft_tokens += len(drafts)
                metrics.num_accepted_tokens += accepted
                self.spec_draft_tokens += len(drafts)
                self.spec_accepted_tokens += accepted
                self.spec_verifications += 1
            tids = seq.token_ids
            stopped = False
            for tok in toks:
                tids.append(tok)
                seq.num_computed_tokens += 1  # the token before it (accepted) is computed
                if self._check_stop(seq, tok):
                    stopped = True
                    break
            if stopped:
                continue
            bm.trim(seq, len(tids))
            if bm.window_groups:  # several tokens at once may leave window blocks behind
                bm.release_skipped(seq)
            self.set_next_check_len(seq)
            if bm.slot_needs_block(seq):
                self.mark_needs_block(seq)

    def _check_decode(self, seq: Sequence, tok: int, needing_block: list[Sequence]) -> None:
        """The fast path's slow case: ``tok`` may stop ``seq``, or its next slot needs a block."""
        if (not self._check_stop(seq, tok)
                and len(seq.token_ids) > len(seq.block_tables[0]) * self.block_size):
            needing_block.append(seq)  # next_check_len <= len(token_ids) already

    def mark_needs_block(self, seq: Sequence) -> None:
        """``seq``'s next slot needs a block (boundary or copy-on-write): queue it for the next
        schedule(), and make ``len(token_ids) >= next_check_len`` flag it until then."""
        seq.next_check_len = 0
        self.seqs_needing_block.append(seq)

    def _check_stop(self, seq: Sequence, tok: int) -> bool:
        """Finish ``seq`` if ``tok`` (just appended) ends it; True when it did."""
        n = len(seq.token_ids)
        if tok in seq.stop_ids and n >= seq.min_len:
            sp = seq.group.sampling_params
            eos = not sp.ignore_eos and tok in self.eos_token_ids
            self._finish(seq, FINISHED_STOPPED, None if eos else tok)
            return True
        if n >= seq.max_len:
            self._finish(seq, FINISHED_LENGTH_CAPPED, None)
            return True
        return False

    def _update_generic(self, out: SchedulerOutput, sampled: list[list[int]], start: int) -> None:
        seqs = out.seqs
        num_new = out.num_new_tokens
        bm = self.block_manager
        windows = bool(bm.window_groups)
        now = None
        completed: list[Sequence] = []
        for i in range(start, len(seqs)):
            seq = seqs[i]
            if seq.status is not RUNNING:  # aborted or finished between schedule and update
                continue
            seq.num_computed_tokens += num_new[i]
            if windows:  # the chunk is computed: its window blocks left behind go back
                bm.release_skipped(seq)
            toks = sampled[i]
            if not toks and (seq.group.pooling_params is None
                             or seq.num_computed_tokens < len(seq.token_ids)):
                continue  # a prefill chunk short of the end
            metrics = seq.group.metrics
            if metrics.first_token_time is None:
                if now is None:
                    now = self.clock()
                metrics.first_token_time = now
            if not toks:  # a pooling request's prompt is computed: its result is ready
                self._finish(seq, FINISHED_STOPPED, None)
                if self.chunked:
                    completed.append(seq)
                continue
            # chunked: a completed prefill leaves `prefilling` for `running`; fork children
            # join `running` (at its end) under both policies
            joins = self.chunked and i >= out.num_decodes
            family = self._fork(seq, len(toks)) if len(toks) > 1 else [seq]
            for s, tok in zip(family, toks, strict=True):
                s.token_ids.append(tok)
                if self._check_stop(s, tok):
                    continue
                self.set_next_check_len(s)
                if joins or s is not seq:
                    self.join_running(s)
                if bm.slot_needs_block(s):
                    self.mark_needs_block(s)
            if joins:
                completed.append(seq)
        if completed:
            done = set(completed)
            self.prefilling = [s for s in self.prefilling if s not in done]

    def _fork(self, parent: Sequence, n: int) -> list[Sequence]:
        """The prompt is computed and n tokens were sampled: n-1 children share its blocks."""
        group = parent.group
        bm = self.block_manager
        family = [parent]
        for k in range(1, n):
            child = Sequence(self._new_seq_id(), group, k, list(parent.token_ids),
                             parent.num_prompt_tokens)
            child.num_computed_tokens = parent.num_computed_tokens
            child.max_len, child.min_len, child.stop_ids = parent.max_len, parent.min_len, parent.stop_ids
            bm.fork(parent, child)
            child.status = RUNNING
            group.seqs.append(child)
            family.append(child)
        return family

    # ------------------------------------------------------------------ finishing

    def _finish(self, seq: Sequence, status: SequenceStatus, stop_reason: int | str | None) -> None:
        """A running sequence ends (stop rule): free it; report the group once all seqs ended."""
        seq.status = status
        seq.stop_reason = stop_reason
        self.block_manager.free(seq)
        self._stopped_running.append(seq)
        group = seq.group
        if group.is_finished:
            group.metrics.finished_time = self.clock()
            self._groups.pop(group.request_id, None)
            self._finished.append(group)

    def _detach(self, seq: Sequence, status: SequenceStatus) -> None:
        """Take ``seq`` out of whatever queue holds it, set ``status`` and free its blocks."""
        old = seq.status
        seq.status = status
        if old is RUNNING:
            if seq in self.prefilling:
                self.prefilling.remove(seq)
            else:
                self._stopped_running.append(seq)
        elif old is WAITING:
            self.waiting.remove(seq)
        elif old is SWAPPED:
            self.swapped.remove(seq)
        elif old is WAITING_FOR_GRAMMAR:
            del self.waiting_for_grammar[seq.group.request_id]
        elif old is WAITING_FOR_KV:
            self._detached_since_schedule = True
            return  # its blocks go once its load is reported finished (kv_loading)
        self.block_manager.free(seq)
        self._detached_since_schedule = True

    def finish_sequence(self, seq: Sequence, status: SequenceStatus,
                        stop_reason: int | str | None = None) -> SequenceGroup | None:
        """Finish ``seq`` from outside (engine-side stop strings) and free its blocks.

        Returns its group when this finished the whole group (not reported again by update()).
        """
        if seq.status.is_finished:
            return None
        if not status.is_finished:
            raise ValueError(f"finish_sequence needs a FINISHED_* status, got {status.name}")
        self._detach(seq, status)
        seq.stop_reason = stop_reason
        group = seq.group
        if group.is_finished:
            group.metrics.finished_time = self.clock()
            self._groups.pop(group.request_id, None)
            return group
        return None

    def abort(self, request_id: str) -> SequenceGroup | None:
        """Abort a request in any queue, freeing every block; None if unknown or finished."""
        group = self._groups.pop(request_id, None)
        if group is None:
            return None
        for seq in group.seqs:
            if not seq.status.is_finished:
                self._detach(seq, FINISHED_ABORTED)
        group.finish_message = group.finish_message or "aborted"
        group.metrics.finished_time = self.clock()
        return group

    # ------------------------------------------------------------------ stats

    @property
    def stats(self) -> SchedulerStats:
        """A snapshot; reading it changes nothing."""
        num_running = len(self.running)
        if self._stopped_running:
            positions = self._stopped_positions()
            if positions is None:
                num_running = sum(s.status is RUNNING for s in self.running)
            else:
                num_running -= len(positions)
        gpu = self.block_manager.gpu
        total = gpu.num_blocks
        free = gpu.num_free
        return SchedulerStats(
            num_running=num_running + len(self.prefilling),
            num_waiting=len(self.waiting) + len(self.waiting_for_grammar)
            + sum(1 for s in self.loading.values() if s.status is WAITING_FOR_KV),
            num_swapped=len(self.swapped),
            num_free_blocks=free,
            num_total_blocks=total,
            kv_usage=(total - free) / total,
            num_preemptions=self.num_preemptions,
            prefix_cache_queries=self.prefix_cache_queries,
            prefix_cache_hits=self.prefix_cache_hits,
            spec_draft_tokens=self.spec_draft_tokens,
            spec_accepted_tokens=self.spec_accepted_tokens,
            spec_verifications=self.spec_verifications,
        )

    def unfinished_groups(self) -> list[SequenceGroup]:
        return list(self._groups.values())
