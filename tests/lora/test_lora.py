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
from tiny_models import VOCAB, save_tiny_llama

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
ADAPTERS = {  # name -> peft LoraConfig arguments
    "qv8": {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]},
    "all16": {"r": 16, "lora_alpha": 8, "target_modules": ["q_proj", "k_proj", "v_proj",
                                                           "o_proj", "gate_proj", "up_proj",
                                                           "down_proj"]},
    "mlp8rs": {"r": 8, "lora_alpha": 16, "use_rslora": True,
               "target_modules": ["gate_proj", "up_proj", "down_proj"]},
    "ko4": {"r": 4, "lora_alpha": 32, "target_modules": ["k_proj", "o_proj"]},
}
ENGINE = {"dtype": "float32", "num_gpu_blocks": 64, "block_size": 8, "max_model_len": 128}


def _prompts(n: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(3, VOCAB, (int(k),), generator=gen).tolist()
            for k in torch.randint(4, 30, (n,), generator=gen)]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    """The base model, each adapter, and each adapter merged into a copy of the base."""
    from peft import LoraConfig, get_peft_model

    root = tmp_path_factory.mktemp("lora")
    paths = {"base": str(root / "base")}
    save_tiny_llama(paths["base"])
    from transformers import AutoModelForCausalLM

    for k, (name, config) in enumerate(ADAPTERS.items()):
        base = AutoModelForCausalLM.from_pretrained(paths["base"], dtype=torch.float32)
        peft_model = get_peft_model(base, LoraConfig(**config))
        torch.manual_seed(10 + k)
        with torch.no_grad():
            for pname, p in peft_model.named_parameters():
                if "lora_" in pname:  # peft starts B at zero: make every adapter matter
                    p.copy_(0.2 * torch.randn_like(p))
        paths[name] = str(root / name)
        peft_model.save_pretrained(paths[name])
        merged = peft_model.merge_and_unload()
        paths[name + "_merged"] = str(root / (name + "_merged"))
        merged.save_pretrained(paths[name + "_merged"])
        for f in ("tokenizer.json", "tokenizer_config.json"):
            with open(os.path.join(paths["base"], f)) as src, \
                    open(os.path.join(paths[name + "_merged"], f), "w") as dst:
                dst.write(src.read())
    return paths


def _tokens(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.mark.parametrize("max_loras", [4, 2])
def test_a_mixed_batch_equals_the_merged_models(models, max_loras: int) -> None:
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
    assert stats.num_free_blocks == stats.num_total_blocks


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
