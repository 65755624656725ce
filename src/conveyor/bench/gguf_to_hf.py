"""Dequantizes a GGUF model into an HF safetensors directory (bf16) with its tokenizer.

``python gguf_to_hf.py MODEL.gguf OUT_DIR``, run with a Python that has torch, transformers,
gguf and accelerate (the vLLM peer's environment): imports nothing from Conveyor. transformers
loads the GGUF dequantized; a GGUF-loaded model refuses ``save_pretrained``, so a fresh model is
built from its config and given its state dict, then saved.
"""

from __future__ import annotations

import sys
from pathlib import Path


def convert(gguf: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    loaded = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.bfloat16,
        quantization_config=GgufConfig(dequantize=True))
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    fresh.load_state_dict(loaded.state_dict())
    fresh.save_pretrained(out)
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(out)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python gguf_to_hf.py MODEL.gguf OUT_DIR")
    convert(Path(sys.argv[1]), Path(sys.argv[2]))
