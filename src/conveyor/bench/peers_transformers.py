"""Peer: Hugging Face transformers on the same GGUF weights, dequantized to Conveyor's dtype.

Two settings: ``generate()`` over static batches of ``job.setting`` left-padded prompts (its
strongest CPU setting found), and ``generate_batch()`` (transformers' own continuous batching).
Greedy, every request generates exactly its ``max_tokens`` (EOS suppressed).
"""

from __future__ import annotations

import time
from pathlib import Path

from conveyor.bench.peers import WARMUP_SEED_OFFSET, PeerJob, peak_rss_mb, timed_repeats
from conveyor.bench.report import Measurement, SystemResult
from conveyor.bench.workloads import Workload, is_single_stream, make_workload, warmup_workload

PAD_ID = 0


def load_model(model_path: str, dtype: str):
    import torch
    from transformers import AutoModelForCausalLM

    path = Path(model_path)
    kwargs = {"dtype": getattr(torch, dtype)}
    try:  # transformers >= 5 can keep GGUF weights packed; we compare dense weights
        from transformers import GgufConfig

        kwargs["quantization_config"] = GgufConfig(dequantize=True)
    except ImportError:
        pass
    if path.suffix == ".gguf":
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                     **kwargs)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=kwargs["dtype"])
    return model.eval()


def _generate_static(model, prompts: list[list[int]], max_new_tokens: int) -> int:
    """One left-padded batch through generate(); returns the number of tokens generated."""
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), PAD_ID, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    ids, mask = ids.to(model.device), mask.to(model.device)
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                             max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                             pad_token_id=PAD_ID)
    return int(out.shape[0] * (out.shape[1] - width))


def run_static(model, workload: Workload, batch_size: int) -> int:
    generated = 0
    reqs = workload.requests
    for start in range(0, len(reqs), batch_size):
        batch = reqs[start:start + batch_size]
        generated += _generate_static(model, [r.prompt_token_ids for r in batch],
                                      max(r.max_tokens for r in batch))
    return generated


def run_continuous(model, workload: Workload) -> int:
    from transformers import GenerationConfig

    max_tokens = max(r.max_tokens for r in workload.requests)
    config = GenerationConfig(max_new_tokens=max_tokens, do_sample=False, eos_token_id=None,
                              pad_token_id=PAD_ID)
    outputs = model.generate_batch(inputs=[r.prompt_token_ids for r in workload.requests],
                                   generation_config=config, progress_bar=False)
    return sum(len(o.generated_tokens) for o in outputs.values())


def run_single_stream(model, workload: Workload) -> Measurement:
    """The workload's first request; a streamer timestamps each token (TTFT, decode rate)."""
    import torch
    from transformers.generation.streamers import BaseStreamer

    class Clock(BaseStreamer):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.calls = 0

        def put(self, value) -> None:
            self.calls += 1
            if self.calls > 1:  # the first put() is the prompt
                self.times.append(time.perf_counter())

        def end(self) -> None:
            pass

    req = workload.requests[0]
    clock = Clock()
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=torch.tensor([req.prompt_token_ids], device=model.device),
                             do_sample=False,
                             max_new_tokens=req.max_tokens, min_new_tokens=req.max_tokens,
                             pad_token_id=PAD_ID, streamer=clock)
    wall = time.perf_counter() - t0
    n = out.shape[1] - len(req.prompt_token_ids)
    ttft = clock.times[0] - t0
    decode = (n - 1) / (clock.times[-1] - clock.times[0]) if n > 1 else float("nan")
    return Measurement(wall, len(req.prompt_token_ids), int(n), ttft, decode)


def run(job: PeerJob) -> SystemResult:
    import torch

    torch.set_num_threads(job.threads)
    t0 = time.perf_counter()
    model = load_model(job.model_path, job.dtype).to(job.device)
    load_s = time.perf_counter() - t0

    def build(k: int) -> Workload:
        return make_workload(job.workload, model.config.vocab_size, job.seed + k, job.num_requests)

    warmup = warmup_workload(build(WARMUP_SEED_OFFSET))
    label = job.dtype if job.device == "cpu" else f"{job.dtype} on {job.device}"
    if is_single_stream(job.workload):
        config = f"{label}, generate() streaming"
        run_once = lambda w: run_single_stream(model, w)  # noqa: E731
    elif job.system == "transformers-cb":
        config = f"{label}, generate_batch()"
        run_once = lambda w: run_continuous(model, w)  # noqa: E731
    else:
        batch = job.setting or len(warmup.requests)
        config = f"{label}, static batch {batch}"
        run_once = lambda w: run_static(model, w, batch)  # noqa: E731
    run_once(warmup)
    repeats = timed_repeats(build, job.repeats, run_once)
    return SystemResult(job.system, config, repeats, load_s=load_s, peak_rss_mb=peak_rss_mb())
