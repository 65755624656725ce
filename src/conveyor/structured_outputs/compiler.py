"""GrammarCompileCache: a request's constraint compiled by xgrammar against the tokenizer, off
the step loop.

Every compile runs on one worker thread; its ``Future`` is cached by the constraint's key
(``StructuredOutputsParams.key()``), so the same schema compiles once however many requests use
it, and a request whose constraint is cached starts without waiting. The least recently used
entries leave the cache beyond ``max_entries``.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import xgrammar as xgr

from conveyor.core.structured_outputs_params import StructuredOutputsParams

_SOURCE_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:[0-9]+: ")  # "[hh:mm:ss] file.cc:123: "


def tokenizer_info(tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> xgr.TokenizerInfo:
    """xgrammar's view of the vocabulary: the model's logits width (which may exceed the
    tokenizer's vocabulary) and the tokens that end a grammar."""
    return xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                              stop_token_ids=list(stop_token_ids))


def choice_grammar(choices: tuple[str, ...]) -> str:
    """EBNF accepting exactly one of ``choices`` (JSON string escapes are EBNF's too)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _compile(compiler: xgr.GrammarCompiler, params: StructuredOutputsParams) -> xgr.CompiledGrammar:
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


class GrammarCompileCache:
    def __init__(self, info: xgr.TokenizerInfo, max_entries: int = 256) -> None:
        self.info = info
        self._compiler = xgr.GrammarCompiler(info, cache_enabled=False)  # this class caches
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-compile")
        self._futures: OrderedDict[tuple[str, str], Future[xgr.CompiledGrammar]] = OrderedDict()
        self._lock = threading.Lock()
        self.max_entries = max_entries

    def submit(self, params: StructuredOutputsParams) -> Future[xgr.CompiledGrammar]:
        """The compiled grammar of ``params``, now or later. A failed compile's future raises
        ValueError with the compiler's message (a later submit compiles again)."""
        key = params.key()
        with self._lock:
            future = self._futures.get(key)
            if future is not None and not (future.done() and future.exception() is not None):
                self._futures.move_to_end(key)
                return future
            future = self._pool.submit(self._compile_or_explain, params)
            self._futures[key] = future
            while len(self._futures) > self.max_entries:
                self._futures.popitem(last=False)
        return future

    def compile(self, params: StructuredOutputsParams) -> xgr.CompiledGrammar:
        """Compile (or fetch) and wait; ValueError with the compiler's message on failure."""
        return self.submit(params).result()

    def _compile_or_explain(self, params: StructuredOutputsParams) -> xgr.CompiledGrammar:
        try:
            return _compile(self._compiler, params)
        except Exception as e:  # xgrammar raises RuntimeError / ValueError with its parser's text
            reason = _SOURCE_PREFIX.sub("", str(e).strip())
            raise ValueError(f"structured_outputs.{params.kind} cannot be compiled: {reason}") from e

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
