"""The report that started deterministic inference: the same temperature-0 chat request twice
through ``LLM().chat`` with the prefix cache on (the second run's prompt comes from the cache, its
last token computed alone) gives two identical replies, with the default bf16 model."""

from __future__ import annotations

from conveyor.core.sampling_params import SamplingParams
from conveyor.engine.llm import LLM


def test_chat_twice_with_prefix_cache_gives_identical_replies() -> None:
    llm = LLM(num_gpu_blocks=64, max_model_len=256)
    assert llm.llm_engine.engine_args.enable_prefix_caching
    messages = [{"role": "user", "content": "Name three colours of the rainbow."}]
    params = SamplingParams(temperature=0, max_tokens=30, logprobs=0)
    first, second = (llm.chat(messages, params, use_tqdm=False)[0] for _ in range(2))
    assert second.num_cached_tokens > 0
    a, b = first.outputs[0], second.outputs[0]
    assert a.text == b.text and a.token_ids == b.token_ids
    assert [lp[t].logprob for t, lp in zip(a.token_ids, a.logprobs, strict=True)] == \
        [lp[t].logprob for t, lp in zip(b.token_ids, b.logprobs, strict=True)]
    assert "rainbow" in a.text
