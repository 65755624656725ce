"""`conveyor bench accuracy`: how far a weight method's next-token distributions are from float
compute on the same file, over a fixed text.

The text (``bench/texts/``, written into the repository, public domain) is cut into windows of
``--window`` tokens; each window is one prefill from position 0 and every position's logits are
kept (the window's last token has no next one). For the method and for float: perplexity of the
text (exp of the mean negative log-likelihood of each next token); against float: the mean
KL divergence KL(float || method) of the next-token distributions and the top-1 agreement (the
share of positions whose argmax is float's). Both models are loaded from the same file with the
same dtype; only ``weight_compute`` differs.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

TEXTS = Path(__file__).parent / "texts"
DEFAULT_TEXT = TEXTS / "lighthouse.txt"


@dataclass
class Accuracy:
    """One method against float over ``tokens`` predicted positions."""
    method: str
    tokens: int
    perplexity: float
    float_perplexity: float
    kl_mean: float
    top1_agreement: float


@torch.inference_mode()
def window_log_probs(model: Any, ids: list[int], block_size: int = 16) -> torch.Tensor:
    """Log-probabilities [len(ids), vocab] (float64) after each token of ``ids``, one prefill
    from position 0 through a KV cache of its own (``model``: a ``LlamaForCausalLM``)."""
    cfg, dtype = model.config, model.dtype
    device = model.norm.weight.device
    blocks = -(-len(ids) // block_size)
    caches = [tuple(torch.zeros(blocks, block_size, cfg.num_kv_heads, cfg.head_dim, dtype=dtype,
                                device=device) for _ in range(2)) for _ in range(cfg.num_layers)]
    meta = model.backend.build_metadata([list(range(blocks))], [0], [len(ids)], block_size,
                                        cfg.num_heads // cfg.num_kv_heads, dtype)
    logits = model(torch.tensor(ids, device=device), meta.positions, caches, meta,
                   torch.arange(len(ids), device=device))
    return torch.log_softmax(logits.double(), dim=-1)


def windows(ids: list[int], window: int) -> list[list[int]]:
    """``ids`` in consecutive windows of ``window`` tokens (the last one shorter; none of one)."""
    return [w for w in (ids[i:i + window] for i in range(0, len(ids), window)) if len(w) > 1]


def compare(reference: Any, model: Any, ids: list[int], window: int, method: str) -> Accuracy:
    """``model`` against ``reference`` (float compute) over ``ids``."""
    n, kl, agree, nll, float_nll = 0, 0.0, 0, 0.0, 0.0
    for w in windows(ids, window):
        p, q = window_log_probs(reference, w)[:-1], window_log_probs(model, w)[:-1]
        nxt = torch.tensor(w[1:])
        kl += float((p.exp() * (p - q)).sum())
        agree += int((p.argmax(-1) == q.argmax(-1)).sum())
        nll -= float(q.gather(1, nxt[:, None]).sum())
        float_nll -= float(p.gather(1, nxt[:, None]).sum())
        n += len(w) - 1
    return Accuracy(method, n, math.exp(nll / n), math.exp(float_nll / n), kl / n, agree / n)


def measure(model_path: str | None, dtype: torch.dtype, text: str, method: str = "int8",
            window: int = 512, max_tokens: int | None = None) -> Accuracy:
    """Loads the file twice (float and ``method`` compute) and compares them over ``text``."""
    from conveyor.model.loader import load_model

    cpu = torch.device("cpu")
    reference = load_model(model_path, dtype, cpu)
    ids = list(reference.tokenizer.encode(text))[:max_tokens]
    other = load_model(model_path, dtype, cpu, weight_compute=method, with_tokenizer=False)
    return compare(reference.model, other.model, ids, window, method)


def main(args: argparse.Namespace) -> int:
    from conveyor.bench.report import write_result
    from conveyor.model.device import resolve_dtype

    dtype = resolve_dtype(args.dtype, torch.device("cpu"))
    text = Path(args.text).read_text()
    result = measure(args.model, dtype, text, args.method, args.window, args.max_tokens)
    print(f"{'weight compute':<16}{'tokens':>8}{'perplexity':>12}{'KL vs float':>13}"
          f"{'top-1 agreement':>17}")
    print(f"{'float':<16}{result.tokens:>8}{result.float_perplexity:>12.4f}{0:>13.5f}"
          f"{1:>17.4f}")
    print(f"{result.method:<16}{result.tokens:>8}{result.perplexity:>12.4f}"
          f"{result.kl_mean:>13.5f}{result.top1_agreement:>17.4f}")
    if args.json:
        write_result(args.json, {"model": args.model or "default", "dtype": args.dtype,
                                 "text": Path(args.text).name, "window": args.window,
                                 "results": [asdict(result)]})
    return 0


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("accuracy", help="a weight method against float compute: KL "
                              "divergence, top-1 agreement, perplexity over a fixed text",
                              description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="GGUF file (default: the embedded SmolLM2)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--method", default="int8", choices=["int8"],
                   help="the weight compute compared with float")
    p.add_argument("--text", default=str(DEFAULT_TEXT), help="the text (default: %(default)s)")
    p.add_argument("--window", type=int, default=512, help="tokens per prefill window")
    p.add_argument("--max-tokens", type=int, default=None, help="only the text's first tokens")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    p.set_defaults(func=main)
