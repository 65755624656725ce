"""Structured outputs on xgrammar: constraint compile cache, per-sequence matchers, bitmasks.

The engine drives it (``LLMEngine``: compile on add, advance after update); the executor's
runner has it build each step's bitmask before sampling (``ModelRunner.sample``), and the
sampler applies the bitmasks (``model/token_bitmask.py``); the scheduler only holds a request as
WAITING_FOR_GRAMMAR until its grammar is compiled. See docs/structured_outputs.md.
"""

from conveyor.structured_outputs.compiler import GrammarCompileCache, tokenizer_info
from conveyor.structured_outputs.manager import GrammarBitmask, StructuredOutputManager

__all__ = ["GrammarBitmask", "GrammarCompileCache", "StructuredOutputManager", "tokenizer_info"]
