"""`conveyor bench serve --endpoint embeddings`: embedding throughput of the server against
sentence-transformers on the same model, in one run.

The workload's prompts are decoded to text once; the server gets each text as one
``/v1/embeddings`` request (sent at each ``--request-rate``, at most ``--max-concurrency`` in
flight), and sentence-transformers (``--compare sentence-transformers``) encodes the same texts
in batches of ``--embed-batch-size`` in this process after the server has stopped, so the two
never share the cores. Both sides tokenize the text themselves; tokens/s counts each side's own
tokens. The peer is the same weights (a GGUF file as transformers loads it, computed in
float32) with the model's pooling: its sentence-transformers modules, or last-token pooling
and normalization.
"""

from __future__ import annotations

import argparse
import inspect
import os
import statistics
import time
from typing import Any

from conveyor.bench.report import percentiles

EMBEDDING_PEERS = ("sentence-transformers",)


def workload_texts(token_lists: list[list[int]], model: str | None) -> list[str]:
    """The workload's prompts as text, through the model's tokenizer."""
    from conveyor.model.loader import model_path
    from conveyor.model.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(model_path(model))
    return [tokenizer.decode(ids, skip_special_tokens=True) for ids in token_lists]


def sentence_transformer(model: str | None, dtype: str) -> Any:
    """The same model as a SentenceTransformer on the CPU, pooled as the engine pools it."""
    import torch
    from sentence_transformers import SentenceTransformer, models

    from conveyor.model.loader import model_path, read_model_config
    from conveyor.model.pooling_config import read_pooling_config

    path = model_path(model)
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    if os.path.isdir(path) and os.path.exists(os.path.join(path, "modules.json")):
        return SentenceTransformer(path, device="cpu", model_kwargs={"dtype": torch_dtype})
    hidden_size = read_model_config(path).hidden_size
    config = read_pooling_config(path, hidden_size)
    if os.path.isdir(path):
        directory, gguf = path, {}
    else:  # transformers computes a GGUF's packed weights in float32, its fastest dtype
        directory, gguf = os.path.dirname(path), {"gguf_file": os.path.basename(path)}
        torch_dtype = torch.float32
    # sentence-transformers 5 renamed the keyword arguments
    names = (("model_kwargs", "processor_kwargs", "config_kwargs")
             if "model_kwargs" in inspect.signature(models.Transformer).parameters
             else ("model_args", "tokenizer_args", "config_args"))
    encoder = models.Transformer(directory, **dict(zip(names, ({**gguf, "dtype": torch_dtype},
                                                              gguf, gguf), strict=True)))
    if encoder.tokenizer.pad_token is None:
        encoder.tokenizer.pad_token = encoder.tokenizer.eos_token
    mode = {"last": "lasttoken", "mean": "mean", "cls": "cls"}[config.method]
    modules = [encoder, models.Pooling(hidden_size, mode)]
    if config.normalize:
        modules.append(models.Normalize())
    return SentenceTransformer(modules=modules, device="cpu")


def run_sentence_transformers(args: argparse.Namespace, texts: list[str]) -> dict[str, Any]:
    """Encode ``texts`` (one warm-up batch, then ``--repeats`` timed passes over all of them);
    the run's summary in the serving runs' shape (its latencies are whole passes')."""
    from conveyor.engine.args import from_cli_args
    from conveyor.model.device import dtype_name, resolve_device, resolve_dtype

    ea = from_cli_args(args)
    dtype = dtype_name(resolve_dtype(ea.dtype, resolve_device("cpu")))
    st = sentence_transformer(ea.model, dtype)
    tokens = sum(len(ids) for ids in st.tokenizer(texts)["input_ids"])
    batch = args.embed_batch_size
    st.encode(texts[:batch], batch_size=batch)
    times = []
    for _ in range(args.repeats):  # encode sorts the texts by length: batches pad little
        start = time.perf_counter()
        st.encode(texts, batch_size=batch)
        times.append(time.perf_counter() - start)
    duration = statistics.median(times)
    return {"label": "sentence-transformers", "sent": len(texts), "completed": len(texts),
            "failed": 0, "errors": [], "duration_s": duration, "durations_s": times,
            "request_throughput": len(texts) / duration, "output_throughput": 0.0,
            "total_token_throughput": tokens / duration, "goodput": len(texts) / duration,
            "slo": {}, "ttft": percentiles(times), "tpot": percentiles([]),
            "itl": percentiles([]), "e2e": percentiles(times), "request_rate": None,
            "burstiness": None, "max_concurrency": None, "preemptions": None,
            "batch_size": batch, "dtype": dtype}


def format_embedding_table(runs: list[dict[str, Any]]) -> str:
    """One row per run: inputs/s, tokens/s, latency; the last column is each run's inputs/s
    over the first run's."""
    header = ["label", "rate req/s", "done/sent", "inputs/s", "tokens/s",
              "latency ms p50 / p99", "inputs/s vs first"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    base = runs[0]["request_throughput"] if runs else 0.0
    for run in runs:
        rate = run.get("request_rate")
        e2e = run["e2e"]
        cells = [run.get("label", ""),
                 "-" if rate is None else "inf" if rate == float("inf") else f"{rate:g}",
                 f"{run['completed']}/{run['sent']}", f"{run['request_throughput']:.2f}",
                 f"{run['total_token_throughput']:.0f}",
                 f"{e2e['p50'] * 1000:.0f} / {e2e['p99'] * 1000:.0f}",
                 f"{run['request_throughput'] / base:.2f}x" if base else "-"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
