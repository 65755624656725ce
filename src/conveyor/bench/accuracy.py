"""`conveyor bench accuracy`: how far a weight method's next-token distributions are from float
compute on the same file, over a fixed text; with ``--compare llamacpp``, llama.cpp's too.

The text (``bench/texts/``, written into the repository, public domain) is cut into windows of
``--window`` tokens; each window is one prefill from position 0 and every position's logits are
kept (the window's last token has no next one). For the method and for float: perplexity of the
text (exp of the mean negative log-likelihood of each next token); against float: the mean
KL divergence KL(float || method) of the next-token distributions and the top-1 agreement (the
share of positions whose argmax is float's). Both models are loaded from the same file with the
same dtype; only ``weight_compute`` differs.

llama.cpp (``--compare llamacpp``) runs in an environment of its own (``peers_llamacpp``), over
the same windows of the same token ids: float's log-probabilities of each window are written to
a float32 ``.npy`` file in a temporary folder (a window is ``[window - 1, vocab]``, half a GB at
Gemma 3's 262k vocabulary), which llama.cpp's driver memory-maps and compares its own
distributions with, some rows at a time. Its row: perplexity, KL(float || llama.cpp) and top-1
agreement, as the method's.
"""

from __future__ import annotations

import argparse
import math
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
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


class ReferenceFiles:
    """Float's next-token log-probabilities of each window, one float32 ``.npy`` file per window
    (``[len(window) - 1, vocab]``) in ``folder``: what llama.cpp's driver, another process,
    compares its own with, memory-mapped. ``windows``: each one's token ids and file."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.windows: list[dict[str, Any]] = []

    def add(self, window: list[int], log_probs: torch.Tensor) -> None:
        path = self.folder / f"window-{len(self.windows):04d}.npy"
        np.save(path, log_probs.float().numpy())
        self.windows.append({"token_ids": window, "reference": str(path)})


def windows(ids: list[int], window: int) -> list[list[int]]:
    """``ids`` in consecutive windows of ``window`` tokens (the last one shorter; none of one)."""
    return [w for w in (ids[i:i + window] for i in range(0, len(ids), window)) if len(w) > 1]


def compare(reference: Any, model: Any, ids: list[int], window: int, method: str,
            keep: ReferenceFiles | None = None) -> Accuracy:
    """``model`` against ``reference`` (float compute) over ``ids``; ``keep`` gets float's
    log-probabilities of each window."""
    n, kl, agree, nll, float_nll = 0, 0.0, 0, 0.0, 0.0
    for w in windows(ids, window):
        p, q = window_log_probs(reference, w)[:-1], window_log_probs(model, w)[:-1]
        if keep is not None:
            keep.add(w, p)
        nxt = torch.tensor(w[1:])
        kl += float((p.exp() * (p - q)).sum())
        agree += int((p.argmax(-1) == q.argmax(-1)).sum())
        nll -= float(q.gather(1, nxt[:, None]).sum())
        float_nll -= float(p.gather(1, nxt[:, None]).sum())
        n += len(w) - 1
    return Accuracy(method, n, math.exp(nll / n), math.exp(float_nll / n), kl / n, agree / n)


def measure(model_path: str | None, dtype: torch.dtype, text: str, method: str = "int8",
            window: int = 512, max_tokens: int | None = None,
            keep: ReferenceFiles | None = None) -> Accuracy:
    """Loads the file twice (float and ``method`` compute) and compares them over ``text``;
    ``keep`` gets float's log-probabilities of each window."""
    from conveyor.model.loader import load_model

    cpu = torch.device("cpu")
    reference = load_model(model_path, dtype, cpu, weight_compute="float")
    ids = list(reference.tokenizer.encode(text))[:max_tokens]
    other = load_model(model_path, dtype, cpu, weight_compute=method, with_tokenizer=False)
    return compare(reference.model, other.model, ids, window, method, keep)


def llama_cpp_accuracy(model_path: str, keep: ReferenceFiles,
                       float_perplexity: float) -> tuple[Accuracy, dict[str, Any]]:
    """llama.cpp over the windows ``keep`` holds, against float: its row and the driver's
    result (llama-cpp-python's version, its system info)."""
    from conveyor.bench import peers_llamacpp

    r = peers_llamacpp.accuracy(model_path, keep.windows)
    n = r["tokens"]
    expected = sum(len(w["token_ids"]) - 1 for w in keep.windows)
    if n != expected:
        raise RuntimeError(f"llama.cpp compared {n} positions, the windows hold {expected}")
    return Accuracy("llama.cpp", n, math.exp(r["nll_sum"] / n), float_perplexity,
                    r["kl_sum"] / n, r["agree"] / n), r


def main(args: argparse.Namespace) -> int:
    from conveyor.bench import peers_llamacpp
    from conveyor.bench.report import write_result
    from conveyor.model.device import resolve_dtype
    from conveyor.model.loader import model_path

    peers = [c.strip() for c in args.compare.split(",") if c.strip()]
    if set(peers) - {"llamacpp"}:
        raise SystemExit(f"conveyor bench accuracy: --compare: unknown peer "
                         f"{sorted(set(peers) - {'llamacpp'})[0]!r}; known: llamacpp")
    dtype = resolve_dtype(args.dtype, torch.device("cpu"))
    text = Path(args.text).read_text()
    path = model_path(args.model)
    # llama.cpp's environment is built (or found unbuildable) before the long float run
    skipped = (peers_llamacpp.model_reason(path) or peers_llamacpp.skip_reason()) if peers \
        else None
    rows: list[dict[str, Any]] = []
    versions: dict[str, str | None] = {}
    with tempfile.TemporaryDirectory(prefix="conveyor-accuracy-") as tmp:
        keep = ReferenceFiles(Path(tmp)) if peers and skipped is None else None
        result = measure(path, dtype, text, args.method, args.window, args.max_tokens, keep)
        rows.append(asdict(result))
        if peers and skipped is None:
            try:
                peer, info = llama_cpp_accuracy(path, keep, result.float_perplexity)
                rows.append(asdict(peer))
                versions["llama-cpp-python"] = info["llama_cpp_python_version"]
            except RuntimeError as e:
                skipped = f"failed ({e})"
        if skipped:
            rows.append({"method": "llama.cpp", "skipped": skipped})
    print(f"{'weight compute':<16}{'tokens':>8}{'perplexity':>12}{'KL vs float':>13}"
          f"{'top-1 agreement':>17}")
    print(f"{'float':<16}{result.tokens:>8}{result.float_perplexity:>12.4f}{0:>13.5f}"
          f"{1:>17.4f}")
    for row in rows:
        if "skipped" in row:
            print(f"{row['method']:<16}{row['skipped']}")
        else:
            print(f"{row['method']:<16}{row['tokens']:>8}{row['perplexity']:>12.4f}"
                  f"{row['kl_mean']:>13.5f}{row['top1_agreement']:>17.4f}")
    if args.json:
        write_result(args.json, {"model": args.model or "default", "dtype": args.dtype,
                                 "text": Path(args.text).name, "window": args.window,
                                 "results": rows}, versions)
    return 0


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("accuracy", help="a weight method (and llama.cpp) against float "
                              "compute: KL divergence, top-1 agreement, perplexity over a fixed "
                              "text",
                              description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="GGUF file (default: the embedded SmolLM2)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--method", default="int8", choices=["int8"],
                   help="the weight compute compared with float")
    p.add_argument("--text", default=str(DEFAULT_TEXT), help="the text (default: %(default)s)")
    p.add_argument("--window", type=int, default=512, help="tokens per prefill window")
    p.add_argument("--max-tokens", type=int, default=None, help="only the text's first tokens")
    p.add_argument("--compare", default="", help="llamacpp: llama.cpp on the same file and "
                   "windows too (its environment is built on first use)")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    p.set_defaults(func=main)
