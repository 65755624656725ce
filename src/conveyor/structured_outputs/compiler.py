"""GrammarCompileCache: a request's constraint compiled by xgrammar against the tokenizer, off
the step loop, in a few worker processes (``CompilePool``) with a time limit.

A compile's ``Future`` is cached by the constraint's key (``StructuredOutputsParams.key()``), so
the same schema compiles once however many requests use it, and a request whose constraint is
cached starts without waiting; a failed compile is not kept. Each user of an entry holds it from
``submit`` to ``release``; a compile that nobody holds any more is cancelled (its process
killed). Compiled grammars stay cached while they fit in ``max_bytes``; beyond it the least
recently used leave.
"""

from __future__ import annotations

import json
import re
import threading
import weakref
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import xgrammar as xgr

from conveyor.core.structured_outputs_params import StructuredOutputsParams
from conveyor.structured_outputs.compile_pool import CompileJob, CompilePool

_SOURCE_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:[0-9]+: ")  # "[hh:mm:ss] file.cc:123: "

DEFAULT_COMPILE_TIMEOUT_S = 10.0
DEFAULT_CACHE_BYTES = 256 * 2**20
COMPILE_WORKERS = 2


def tokenizer_info(tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> xgr.TokenizerInfo:
    """xgrammar's view of the vocabulary: the model's logits width (which may exceed the
    tokenizer's vocabulary) and the tokens that end a grammar."""
    return xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                              stop_token_ids=list(stop_token_ids))


def choice_grammar(choices: tuple[str, ...]) -> str:
    """EBNF accepting exactly one of ``choices`` (JSON string escapes are EBNF's too)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def compile_params(compiler: xgr.GrammarCompiler,
                   params: StructuredOutputsParams) -> xgr.CompiledGrammar:
    kind = params.kind
    if kind == "json":
        # Compact JSON (no free whitespace): a small model cannot wander into endless newlines.
        return compiler.compile_json_schema(json.dumps(params.json), any_whitespace=False)
    if kind == "json_object":
        return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False,
                                            strict_mode=False)
    if kind == "regex":
        return compiler.compile_regex(params.regex)
    if kind == "choice":
        return compiler.compile_grammar(choice_grammar(params.choice))
    return compiler.compile_grammar(params.grammar)


def explain(params: StructuredOutputsParams, error: Exception) -> str:
    """The compiler's complaint about ``params``, without its source-file prefix."""
    reason = _SOURCE_PREFIX.sub("", str(error).strip())
    return f"structured_outputs.{params.kind} cannot be compiled: {reason}"


@dataclass
class _Entry:
    job: CompileJob
    holders: int = 0
    size: int = 0  # the compiled grammar's bytes, once done


class GrammarCompileCache:
    def __init__(self, info: xgr.TokenizerInfo, timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S,
                 max_bytes: int = DEFAULT_CACHE_BYTES, workers: int = COMPILE_WORKERS) -> None:
        self.info = info
        self.max_bytes = max_bytes
        self._pool = CompilePool(info, workers, timeout_s, max_grammar_bytes=max_bytes // 4)
        # the pool's threads outlive an engine dropped without shutdown(): stop them with it
        weakref.finalize(self, self._pool.shutdown)
        self._entries: OrderedDict[tuple[str, str], _Entry] = OrderedDict()
        self._keys: dict[Future[xgr.CompiledGrammar], tuple[str, str]] = {}
        self._lock = threading.RLock()  # a done callback may run inside submit
        self.num_bytes = 0  # of the compiled grammars cached

    def submit(self, params: StructuredOutputsParams) -> Future[xgr.CompiledGrammar]:
        """The compiled grammar of ``params``, now or later; held until ``release(future)``.
        A failed compile's future raises ValueError with the reason (a later submit compiles
        again)."""
        key = params.key()
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                entry = self._entries[key] = _Entry(self._pool.submit(params))
                self._keys[entry.job.future] = key
                entry.job.future.add_done_callback(lambda f, key=key: self._compiled(key, f))
            self._entries.move_to_end(key)
            entry.holders += 1
            return entry.job.future

    def release(self, future: Future[xgr.CompiledGrammar]) -> None:
        """One holder of ``future`` (as ``submit`` returned it) is done with it; an unfinished
        compile that nobody holds is cancelled."""
        with self._lock:
            key = self._keys.get(future)
            entry = self._entries.get(key) if key is not None else None
            if entry is None or entry.job.future is not future or entry.holders == 0:
                return
            entry.holders -= 1
            if entry.holders == 0 and not future.done():
                self._drop(key)
                entry.job.cancel()

    def compile(self, params: StructuredOutputsParams) -> xgr.CompiledGrammar:
        """Compile (or fetch) and wait; ValueError with the reason on failure."""
        future = self.submit(params)
        try:
            return future.result()
        finally:
            self.release(future)

    def _compiled(self, key: tuple[str, str], future: Future[xgr.CompiledGrammar]) -> None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or entry.job.future is not future:
                return
            if _failed(future):  # its holders have the future; the next submit compiles again
                self._drop(key)
                return
            entry.size = future.result().memory_size_bytes
            self.num_bytes += entry.size
            for old in list(self._entries):
                if self.num_bytes <= self.max_bytes:
                    break
                if old != key and self._entries[old].job.future.done():
                    self._drop(old)

    def _drop(self, key: tuple[str, str]) -> None:
        entry = self._entries.pop(key)
        self._keys.pop(entry.job.future, None)
        self.num_bytes -= entry.size

    def __len__(self) -> int:
        return len(self._entries)

    def shutdown(self) -> None:
        self._pool.shutdown()


def _failed(future: Future[Any]) -> bool:
    return future.done() and (future.cancelled() or future.exception() is not None)
