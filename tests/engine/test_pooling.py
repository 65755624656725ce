"""Pooling requests (embeddings) on the real engine: the vectors equal transformers' hidden
states pooled the same way, whatever the chunking, caching or company in the batch, and a
sentence-transformers directory pools as sentence-transformers does."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from conveyor.core.pooling_params import PoolingParams
from conveyor.core.sampling_params import SamplingParams
from conveyor.engine.llm import LLM
from conveyor.model.loader import default_model_path
from engine_runs import run_to_end
from tiny_models import save_sentence_transformer

TEXTS = ["The capital of France is Paris, known for the Eiffel tower.",
         "Bananas are yellow and grow in bunches on large plants.",
         "Hello"]


def _cos(a: list[float], b: torch.Tensor) -> float:
    return F.cosine_similarity(torch.tensor(a), b, dim=0).item()


@pytest.mark.slow
def test_embeddings_equal_transformers_hidden_states_pooled(llm) -> None:
    from transformers import AutoModel

    path = default_model_path()
    ref = AutoModel.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                    dtype=torch.float32)
    tok = llm.get_tokenizer()
    # integer compute's 8-bit activations move a pooled vector by about 3e-4 in cosine
    least = 0.999 if llm.llm_engine.executor.weight_compute == "int8" else 0.9999
    for text in TEXTS:
        ids = tok.encode(text)
        with torch.no_grad():
            hidden = ref(torch.tensor([ids])).last_hidden_state[0]
        for method, expected in (("last", hidden[-1]), ("mean", hidden.mean(0)),
                                 ("cls", hidden[0])):
            raw = llm.embed(text, PoolingParams(method=method, normalize=False), use_tqdm=False)[0]
            assert _cos(raw, expected) >= least, (text, method)
            unit = llm.embed(text, PoolingParams(method=method), use_tqdm=False)[0]
            assert torch.tensor(unit).norm().item() == pytest.approx(1.0, abs=1e-5)
            assert torch.allclose(torch.tensor(unit), F.normalize(torch.tensor(raw), dim=0),
                                  atol=1e-5)


def test_default_pooling_is_last_token_normalized(llm, engine) -> None:
    assert engine.pooling_config.method == "last" and engine.pooling_config.normalize
    default = llm.embed(TEXTS[0], use_tqdm=False)[0]
    explicit = llm.embed(TEXTS[0], PoolingParams(method="last", normalize=True), use_tqdm=False)[0]
    assert default == explicit and len(default) == engine.model_config.hidden_size


def test_pooling_beside_generation_changes_neither(llm, engine) -> None:
    """Embeddings and completions in one batch: each equals its run alone, and the pooling
    requests finish after their prefill with nothing generated and every block freed."""
    greedy = SamplingParams(temperature=0.0, max_tokens=12)
    alone_text = llm.generate(TEXTS[1], greedy, use_tqdm=False)[0].outputs[0].token_ids
    alone_vecs = [llm.embed(t, PoolingParams(method="mean"), use_tqdm=False)[0] for t in TEXTS]
    *pooled, generated = run_to_end(
        engine, [(t, PoolingParams(method="mean")) for t in TEXTS] + [(TEXTS[1], greedy)])
    assert generated.outputs[0].token_ids == alone_text
    for i, out in enumerate(pooled):
        assert out.outputs[0].finish_reason == "stop" and out.outputs[0].token_ids == []
        assert _cos(out.embedding, torch.tensor(alone_vecs[i])) > 0.99999


def test_last_token_pooling_takes_prefix_cache_hits_mean_does_not(llm, engine) -> None:
    text = " ".join([TEXTS[0]] * 6)  # several full blocks
    (first,) = run_to_end(engine, [(text, PoolingParams(method="last"))], "a")
    (again,) = run_to_end(engine, [(text, PoolingParams(method="last"))], "b")
    assert again.num_cached_tokens > 0
    assert _cos(again.embedding, torch.tensor(first.embedding)) > 0.99999
    (mean,) = run_to_end(engine, [(text, PoolingParams(method="mean"))], "c")
    assert mean.num_cached_tokens == 0


def test_chunked_prefill_pools_across_chunks(llm) -> None:
    """A prompt computed 16 tokens at a time (beside a decoding stream) pools as one prefill."""
    whole = llm
    chunked = LLM(dtype="float32", max_model_len=256, num_gpu_blocks=64, max_num_seqs=4,
                  policy="chunked", max_num_batched_tokens=16)
    text = " ".join(TEXTS)
    engine = chunked.llm_engine
    for method in ("mean", "cls", "last"):
        params = PoolingParams(method=method, normalize=False)
        expected = torch.tensor(whole.embed(text, params, use_tqdm=False)[0])
        pooled, generated = run_to_end(
            engine, [(text, params), (TEXTS[2], SamplingParams(max_tokens=20, ignore_eos=True))])
        assert _cos(pooled.embedding, expected) > 0.99999, method
        assert len(generated.outputs[0].token_ids) == 20
    assert not engine.executor.runner.pooler._partial
    stats = engine.get_stats()
    assert stats.scheduler.num_free_blocks == stats.scheduler.num_total_blocks


def test_abort_mid_prompt_frees_everything() -> None:
    llm = LLM(dtype="float32", max_model_len=256, num_gpu_blocks=64, max_num_seqs=4,
              policy="chunked", max_num_batched_tokens=16)
    engine = llm.llm_engine
    engine.add_request("p", " ".join(TEXTS), PoolingParams(method="mean"))
    engine.step()  # the first chunk
    assert engine.executor.runner.pooler._partial
    out = engine.abort_request("p")
    assert out.finished and out.embedding is None and out.outputs[0].finish_reason == "abort"
    run_to_end(engine, [(TEXTS[2], PoolingParams(method="mean"))], "q")
    assert not engine.executor.runner.pooler._partial
    stats = engine.get_stats()
    assert stats.scheduler.num_free_blocks == stats.scheduler.num_total_blocks


def test_bad_pooling_requests_are_refused_with_a_message(llm, engine) -> None:
    with pytest.raises(ValueError, match="method"):
        PoolingParams(method="max")
    with pytest.raises(ValueError, match="dimensions"):
        PoolingParams(dimensions=0)
    with pytest.raises(ValueError, match="Matryoshka"):
        engine.add_request("d", "hi", PoolingParams(dimensions=32))
    too_long = list(range(10, 10 + engine.max_model_len + 1))
    with pytest.raises(ValueError, match="max_model_len"):
        llm.embed({"prompt_token_ids": too_long}, use_tqdm=False)


def test_score_is_cosine_similarity(llm) -> None:
    query = "What is the capital of France?"
    docs = ["Paris is the capital of France.", "Bananas are yellow."]
    vectors = [torch.tensor(v) for v in llm.embed([query, *docs], use_tqdm=False)]
    scores = llm.score(query, docs, use_tqdm=False)
    for s, v in zip(scores, vectors[1:], strict=True):
        assert s == pytest.approx(F.cosine_similarity(vectors[0], v, dim=0).item(), abs=1e-5)
    assert scores[0] > scores[1]
    with pytest.raises(ValueError, match="pairwise"):
        llm.score(["a", "b"], ["c", "d", "e"], use_tqdm=False)


@pytest.mark.parametrize(("mode", "normalize"), [("mean_tokens", True), ("lasttoken", False),
                                                 ("cls_token", True)])
def test_sentence_transformers_directory_pools_as_sentence_transformers(
        tmp_path, mode: str, normalize: bool) -> None:
    from sentence_transformers import SentenceTransformer

    save_sentence_transformer(str(tmp_path), mode, normalize, matryoshka_dimensions=[64, 32])
    texts = ["w5 w9 w17 w40", "w3", " ".join(f"w{i}" for i in range(3, 60))]
    expected = SentenceTransformer(str(tmp_path), device="cpu").encode(
        texts, convert_to_tensor=True, normalize_embeddings=False)
    llm = LLM(str(tmp_path), dtype="float32", max_model_len=128, num_gpu_blocks=32)
    method = {"mean_tokens": "mean", "lasttoken": "last", "cls_token": "cls"}[mode]
    assert llm.llm_engine.pooling_config.method == method
    assert llm.llm_engine.pooling_config.normalize is normalize
    got = llm.embed(texts, use_tqdm=False)
    for vec, ref in zip(got, expected, strict=True):
        assert _cos(vec, ref) >= 0.9999
        assert (torch.tensor(vec).norm().item() == pytest.approx(1.0, abs=1e-5)) is normalize
    short = llm.embed(texts[0], PoolingParams(dimensions=32, normalize=True), use_tqdm=False)[0]
    assert len(short) == 32
    assert _cos(short, F.normalize(expected[0][:32], dim=0)) >= 0.9999
    with pytest.raises(ValueError, match="<= 64"):
        llm.embed(texts[0], PoolingParams(dimensions=65), use_tqdm=False)


def test_unsupported_sentence_transformers_modules_fail_the_load(tmp_path) -> None:
    import json

    save_sentence_transformer(str(tmp_path), "max_tokens", True)
    with pytest.raises(ValueError, match="pooling modes"):
        LLM(str(tmp_path), dtype="float32", max_model_len=64, num_gpu_blocks=8)
    modules = json.loads((tmp_path / "modules.json").read_text())
    modules.append({"idx": 3, "name": "3", "path": "3_Dense",
                    "type": "sentence_transformers.models.Dense"})
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(ValueError, match="Dense"):
        LLM(str(tmp_path), dtype="float32", max_model_len=64, num_gpu_blocks=8)
