"""model_fingerprint: a short digest that tells one model's weights from another's, cheaply.

For each weight and config file of a model (a GGUF file, or an HF directory's ``*.safetensors``,
``*.bin``, ``*.gguf`` and ``*.json``): its name, size and 16 chunks of 64 KiB spread over it.
Fine-tunes of one architecture have equal sizes but different weights nearly everywhere, so the
samples tell them apart; the name of the file's directory does not count (the same model copied
elsewhere has the same fingerprint).
"""

from __future__ import annotations

import os
from hashlib import blake2b

_CHUNK = 64 * 1024
_SAMPLES = 16
_SUFFIXES = (".safetensors", ".bin", ".gguf", ".json")


def model_fingerprint(path: str) -> bytes:
    h = blake2b(digest_size=16)
    if os.path.isdir(path):
        files = sorted(n for n in os.listdir(path) if n.endswith(_SUFFIXES))
        paths = [os.path.join(path, n) for n in files]
    else:
        paths = [path]
    for p in paths:
        size = os.path.getsize(p)
        h.update(f"{os.path.basename(p)}\0{size}\0".encode())
        with open(p, "rb") as f:
            for i in range(_SAMPLES):
                f.seek(max(0, size - _CHUNK) * i // (_SAMPLES - 1))
                h.update(f.read(_CHUNK))
    return h.digest()
