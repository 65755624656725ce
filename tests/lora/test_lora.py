"""LoRA adapters made by peft on a tiny random Llama: a batch mixing four adapters and the base
model gives each request the greedy tokens of the model with its adapter merged into the
weights; adapters never share prefix-cache blocks; bad adapters are refused with a message and
change nothing."""

from __future__ import annotations

import json
import os

import pytest
import torch

from conveyor.core.sampling_params import SamplingParams
from conveyor.engine.llm import LLM
from conveyor.lora.request import LoRARequest
from conveyor.model.layers.parallel import WholeSumLinear
from tiny_models import LORA_ADAPTERS as ADAPTERS
from tiny_models import VOCAB, save_lora_models

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
ENGINE = {"dtype": "float32", "num_gpu_blocks": 64, "block_size": 8, "max_model_len": 128}


def _prompts(n: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(3, VOCAB, (int(k),), generator=gen).tolist()
            for k in torch.randint(4, 30, (n,), generator=gen)]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    return save_lora_models(str(tmp_path_factory.mktemp("lora")))


def _tokens(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.mark.parametrize("max_loras", [4, 2])
def test_a_mixed_batch_equals_the_merged_models(models, max_loras: int) -> None:
    """With 2 slots and 2 adapters in host memory (the default), the four adapters take turns
    and are read again from their files: the pool swaps, the tokens stay the merged models'."""
    prompts = _prompts(15)
    names = [None, *ADAPTERS]  # prompt i runs under names[i % 5]
    expected = {}
    for name in names:
        path = models["base"] if name is None else models[name + "_merged"]
        expected[name] = _tokens(LLM(path, **ENGINE).generate(prompts, GREEDY, use_tqdm=False))
    llm = LLM(models["base"], enable_lora=True, max_loras=max_loras, max_lora_rank=16, **ENGINE)
    requests = {name: LoRARequest(name, k + 1, models[name]) for k, name in enumerate(ADAPTERS)}
    loras = [None if names[i % 5] is None else requests[names[i % 5]] for i in range(15)]
    got = _tokens(llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras))
    for i in range(15):
        assert got[i] == expected[names[i % 5]][i], (i, names[i % 5])
    assert len(set(map(tuple, (expected[n][0] for n in names)))) == 5  # every adapter matters
    stats = llm.llm_engine.get_stats()
    assert stats.scheduler.num_free_blocks == stats.scheduler.num_total_blocks
    pool = llm.llm_engine.lora_pool
    assert len(pool.host) <= max_loras and len(pool.slot_of) <= max_loras
    assert (pool.num_reads > 0) == (max_loras < len(ADAPTERS))
    assert pool.num_installs >= len(ADAPTERS)


def test_adapters_never_share_prefix_cache_blocks(models) -> None:
    llm = LLM(models["base"], enable_lora=True, max_loras=2, **ENGINE)
    prompt = list(range(3, 43))  # five full blocks
    one, two = (LoRARequest(n, k + 1, models[n]) for k, n in enumerate(("qv8", "ko4")))
    first = llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=one)[0]
    assert first.num_cached_tokens == 0
    assert llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=one)[0] \
        .num_cached_tokens > 0
    assert llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=two)[0] \
        .num_cached_tokens == 0
    assert llm.generate([prompt], GREEDY, use_tqdm=False)[0].num_cached_tokens == 0


def _broken(tmp_path, models, name: str, edit) -> str:
    path = tmp_path / name
    os.makedirs(path)
    for f in os.listdir(models["qv8"]):
        with open(os.path.join(models["qv8"], f), "rb") as src:
            (path / f).write_bytes(src.read())
    edit(path)
    return str(path)


def test_bad_adapters_are_refused_and_change_nothing(models, tmp_path) -> None:
    llm = LLM(models["base"], enable_lora=True, max_lora_rank=8, **ENGINE)
    prompt = _prompts(1)
    before = _tokens(llm.generate(prompt, GREEDY, use_tqdm=False))

    def config(path, **changes):
        cfg = json.loads((path / "adapter_config.json").read_text())
        cfg.update(changes)
        (path / "adapter_config.json").write_text(json.dumps(cfg))

    cases = [
        (models["all16"], "rank 16, more than max_lora_rank=8"),
        (str(tmp_path / "nowhere"), "adapter_config.json is missing"),
        (_broken(tmp_path, models, "nocfg", lambda p: os.remove(p / "adapter_config.json")),
         "adapter_config.json is missing"),
        (_broken(tmp_path, models, "dora", lambda p: config(p, use_dora=True)),
         "use_dora=True is not supported"),
        (_broken(tmp_path, models, "shape", lambda p: config(p, r=4)),
         r"needs lora_A \(4, 64\)"),
    ]
    for k, (path, message) in enumerate(cases):
        with pytest.raises(ValueError, match=message):
            llm.generate(prompt, GREEDY, use_tqdm=False,
                         lora_request=LoRARequest(f"bad{k}", 10 + k, path))
    assert _tokens(llm.generate(prompt, GREEDY, use_tqdm=False)) == before
    assert not llm.llm_engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="lora_int_id must be"):
        LoRARequest("x", 0, models["qv8"])
    plain = LLM(models["base"], **ENGINE)
    with pytest.raises(ValueError, match="enable_lora"):
        plain.generate(prompt, GREEDY, use_tqdm=False,
                       lora_request=LoRARequest("qv8", 1, models["qv8"]))


def test_an_adapter_whose_files_went_fails_its_requests_only(models, tmp_path) -> None:
    llm = LLM(models["base"], enable_lora=True, max_loras=1, **ENGINE)
    gone = _broken(tmp_path, models, "gone", lambda p: None)
    first, second = LoRARequest("gone", 1, gone), LoRARequest("ko4", 2, models["ko4"])
    prompts = _prompts(2)
    llm.generate(prompts[:1], GREEDY, use_tqdm=False, lora_request=first)
    llm.generate(prompts[:1], GREEDY, use_tqdm=False, lora_request=second)  # evicts "gone"
    for f in os.listdir(gone):
        os.remove(os.path.join(gone, f))
    outs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=[first, None])
    assert outs[0].outputs[0].finish_reason == "abort"
    assert len(outs[1].outputs[0].token_ids) == GREEDY.max_tokens
    stats = llm.llm_engine.get_stats()
    assert stats.scheduler.num_free_blocks == stats.scheduler.num_total_blocks
    with pytest.raises(ValueError, match="adapter_config.json is missing"):
        llm.generate(prompts[:1], GREEDY, use_tqdm=False, lora_request=first)
    with pytest.raises(ValueError, match="max_cpu_loras"):
        LLM(models["base"], enable_lora=True, max_loras=2, max_cpu_loras=1, **ENGINE)


@pytest.mark.slow
@pytest.mark.parametrize(("weight_compute", "deterministic"), [("float", False), ("int8", True)])
def test_tensor_parallel_adapters_equal_one_process(models, weight_compute, deterministic) -> None:
    """Two ranks over gloo, each holding its shard of every adapter (B's rows of q/k/v/gate/up,
    A's columns of o/down; under whole sums, which integer compute and deterministic float
    compute take, B's rows of o/down too: the safetensors model has no blocks to compute as
    integers, but its o/down projections split as integer compute splits them), with the pool
    swapping 4 adapters through 2 slots."""
    prompts = _prompts(10)
    requests = [None, *(LoRARequest(n, k + 1, models[n]) for k, n in enumerate(ADAPTERS))]
    loras = [requests[i % 5] for i in range(10)]
    one = LLM(models["base"], enable_lora=True, max_loras=2, deterministic=deterministic,
              **ENGINE)
    expected = _tokens(one.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras))
    tp = LLM(models["base"], enable_lora=True, max_loras=2, tensor_parallel_size=2,
             threads_per_rank=1, weight_compute=weight_compute, deterministic=deterministic,
             **ENGINE)
    try:
        o_proj = tp.llm_engine.executor.model.layers[0].o_proj
        assert isinstance(o_proj, WholeSumLinear) == deterministic
        assert _tokens(tp.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras)) \
            == expected
    finally:
        tp.llm_engine.shutdown()


def test_structured_outputs_under_an_adapter_follow_the_grammar(models) -> None:
    """A constrained request under an adapter picks what the merged model picks."""
    from conveyor.core.structured_outputs_params import StructuredOutputsParams

    params = SamplingParams(temperature=0.0, max_tokens=4, structured_outputs=(
        StructuredOutputsParams(choice=["w5", "w17", "w40"])))
    prompts = [" ".join(f"w{t}" for t in p) for p in _prompts(3)]
    merged = LLM(models["qv8_merged"], **ENGINE).generate(prompts, params, use_tqdm=False)
    llm = LLM(models["base"], enable_lora=True, **ENGINE)
    got = llm.generate(prompts, params, use_tqdm=False,
                       lora_request=LoRARequest("qv8", 1, models["qv8"]))
    texts = [o.outputs[0].text for o in got]
    assert all(t.strip() in ("w5", "w17", "w40") for t in texts), texts
    assert texts == [o.outputs[0].text for o in merged]


def test_stats_name_the_running_and_the_waiting_adapters(models) -> None:
    """One slot, two adapters (both kept in host memory): the first runs, the second waits its
    turn; EngineStats and /metrics' lora_requests_info (vLLM's gauge) name them."""
    from types import SimpleNamespace

    from prometheus_client import CollectorRegistry, generate_latest

    from conveyor.entrypoints.openai.metrics import _EngineStatsCollector

    llm = LLM(models["base"], enable_lora=True, max_loras=1, max_cpu_loras=2, **ENGINE)
    engine = llm.llm_engine
    for k, name in enumerate(("qv8", "ko4")):
        engine.add_request(f"r{k}", _prompts(1)[0], GREEDY,
                           lora_request=LoRARequest(name, k + 1, models[name]))
    engine.step()
    stats = engine.get_stats()
    assert (stats.max_loras, stats.lora_running_adapters, stats.lora_waiting_adapters) == \
        (1, ["qv8"], ["ko4"])
    registry = CollectorRegistry()
    registry.register(_EngineStatsCollector(SimpleNamespace(stats=stats), "m"))
    assert ('conveyor:lora_requests_info{max_lora="1",running_lora_adapters="qv8",'
            'waiting_lora_adapters="ko4"}') in generate_latest(registry).decode()
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.get_stats().lora_running_adapters == []


def test_speculative_decoding_under_adapters_keeps_their_tokens(models) -> None:
    """n-gram proposals verified under each request's adapter: greedy tokens unchanged."""
    prompts = [p * 3 for p in _prompts(5)]  # repeats give the n-gram proposer matches
    names = [None, *ADAPTERS]
    requests = {name: LoRARequest(name, k + 1, models[name]) for k, name in enumerate(ADAPTERS)}
    loras = [None if n is None else requests[n] for n in names]
    plain = LLM(models["base"], enable_lora=True, max_loras=4, **ENGINE)
    spec = LLM(models["base"], enable_lora=True, max_loras=4, speculative_method="ngram",
               num_speculative_tokens=3, speculative_disable_by_batch_size=0, **ENGINE)
    expected = _tokens(plain.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras))
    got = _tokens(spec.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras))
    assert got == expected
    assert spec.llm_engine.get_stats().scheduler.spec_draft_tokens > 0
