"""LLM.generate / LLM.chat on the real SmolLM2."""

import copy

import pytest

from conveyor.core.sampling_params import RequestOutputKind, SamplingParams

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "1, 2, 3, 4,"]


def _direct_run(engine, prompt_token_ids, max_tokens):
    """The same model driven by hand: a fresh Scheduler, and the engine's ModelExecutor with a KV
    cache of its own (so the engine's prefix cache is not disturbed)."""
    from conveyor.core.config import CacheConfig, SchedulerConfig
    from conveyor.core.scheduler import Scheduler

    args = engine.engine_args
    executor = copy.copy(engine.executor)  # same model weights, new cache below
    executor.initialize_cache(args.block_size, engine.num_gpu_blocks, 0)
    scheduler = Scheduler(
        SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                        max_model_len=engine.max_model_len),
        CacheConfig(block_size=args.block_size, num_gpu_blocks=engine.num_gpu_blocks),
        eos_token_ids=tuple(engine.model_config.eos_token_ids))
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    groups = [scheduler.add_request(str(i), ids, params) for i, ids in enumerate(prompt_token_ids)]
    while scheduler.has_unfinished_requests():
        step = scheduler.schedule()
        sampled = [] if step.is_empty else executor.execute(step).sampled_token_ids
        scheduler.update(step, sampled)
    return [g.seqs[0].output_token_ids for g in groups]


def test_greedy_generate_equals_direct_executor_run(llm, engine, tokenizer):
    params = SamplingParams(temperature=0.0, max_tokens=8)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert params.output_kind == RequestOutputKind.CUMULATIVE  # generate asked for FINAL_ONLY on a copy
    assert [o.prompt for o in outputs] == PROMPTS  # input order kept
    direct = _direct_run(engine, [tokenizer.encode(p) for p in PROMPTS], 8)
    assert [o.outputs[0].token_ids for o in outputs] == direct
    assert "Paris" in outputs[0].outputs[0].text


def test_token_id_prompts_and_per_prompt_params(llm, engine, tokenizer):
    ids = tokenizer.encode(PROMPTS[0])
    outs = llm.generate([ids, PROMPTS[0], {"prompt_token_ids": ids}],
                        [SamplingParams(temperature=0.0, max_tokens=n) for n in (2, 3, 4)])
    assert [len(o.outputs[0].token_ids) for o in outs] == [2, 3, 4]
    assert outs[0].prompt is None and outs[0].prompt_token_ids == ids
    assert outs[1].outputs[0].token_ids[:2] == outs[0].outputs[0].token_ids
    single = llm.generate(ids, SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
    assert len(single) == 1 and single[0].outputs[0].token_ids == outs[0].outputs[0].token_ids


def test_bad_input_in_a_batch_adds_nothing(llm, engine):
    with pytest.raises(ValueError, match="prompt"):
        llm.generate(["fine", ""], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate(["a", "b"], [SamplingParams()])
    assert not engine.has_unfinished_requests()
    assert len(llm.generate("fine", SamplingParams(max_tokens=2, ignore_eos=True))[0].outputs[0].token_ids) == 2


def test_chat_applies_the_template(llm, engine, tokenizer):
    question = [{"role": "user", "content": "Name three primary colors."}]
    outs = llm.chat([question, [{"role": "user", "content": "Say hi."}]],
                    SamplingParams(temperature=0.0, max_tokens=10), use_tqdm=False)
    out = outs[0]
    expected = tokenizer.apply_chat_template(question, tokenize=False, add_generation_prompt=True)
    assert out.prompt == expected and out.prompt.endswith("<|im_start|>assistant\n")
    assert out.prompt_token_ids == tokenizer.encode(expected, add_special_tokens=False)
    assert "primary colors" in out.outputs[0].text  # an answer to the user's message
    assert len(outs) == 2 and outs[1].prompt.count("<|im_start|>user\nSay hi.") == 1
    with pytest.raises(ValueError, match="messages"):
        llm.chat([{"role": "user"}], SamplingParams())
