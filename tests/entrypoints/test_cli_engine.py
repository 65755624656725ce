"""`conveyor generate`, `chat` and `demo` run as real subprocesses on the embedded model."""

import json
import os
import re
import subprocess
import sys

import pytest

SMALL = ["--num-gpu-blocks", "64", "--max-num-seqs", "4", "--max-model-len", "512"]


def conveyor(*args, stdin=None, timeout=300):
    env = dict(os.environ, PYTHONIOENCODING="utf-8")
    proc = subprocess.run([sys.executable, "-m", "conveyor.entrypoints.cli", *args], input=stdin,
                          capture_output=True, text=True, timeout=timeout, env=env)
    return proc


@pytest.mark.parametrize("command", ["generate", "chat", "demo"])
def test_help_is_complete(command):
    proc = conveyor(command, "--help", timeout=30)
    assert proc.returncode == 0, proc.stderr
    for flag in ["--model", "--max-tokens", "--temperature", "--max-num-seqs", "--kv-cache-memory",
                 "--num-gpu-blocks", "--policy", "--preemption-mode", "--seed"]:
        assert flag in proc.stdout, flag
    if command != "demo":
        assert "--top-p" in proc.stdout and "--stop" in proc.stdout


@pytest.mark.slow
def test_generate_json_several_prompts():
    proc = conveyor("generate", "The capital of France is", "1, 2, 3,", "--json", "--max-tokens", "6",
                    "--temperature", "0", *SMALL)
    assert proc.returncode == 0, proc.stderr
    results = json.loads(proc.stdout)
    assert [r["prompt"] for r in results] == ["The capital of France is", "1, 2, 3,"]
    for r in results:
        (out,) = r["outputs"]
        assert 1 <= len(out["token_ids"]) <= 6 and out["finish_reason"] in ("stop", "length")
    assert "Paris" in results[0]["outputs"][0]["text"]


def test_generate_bad_flag_value_is_a_clean_error():
    proc = conveyor("generate", "hi", "--top-p", "2", *SMALL)
    assert proc.returncode == 2 and "top_p" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow
def test_chat_through_stdin_keeps_history():
    stdin = "My name is Alice.\nWhat is my name?\n/exit\nthis line is never read\n"
    proc = conveyor("chat", "--temperature", "0", "--max-tokens", "12", "--stats", *SMALL, stdin=stdin)
    assert proc.returncode == 0, proc.stderr
    turns = re.findall(r"\[prompt (\d+) tokens, reply (\d+) tokens", proc.stderr)
    assert len(turns) == 2  # the line after /exit was not answered
    (p1, r1), (p2, _) = [(int(p), int(r)) for p, r in turns]
    assert p2 > p1 + r1  # the second prompt holds the first turn and its reply
    assert proc.stdout.strip()  # the replies were streamed to stdout


@pytest.mark.slow
def test_demo_runs_a_batch_and_reports_throughput():
    # float compute: its greedy answer to the first question names Paris (integer compute's,
    # like llama.cpp's on this file, does not)
    proc = conveyor("demo", "--num-prompts", "3", "--max-tokens", "8", "--weight-compute", "float",
                    *SMALL)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("Q: ") == 3 and proc.stdout.count("A: ") == 3
    assert "output tok/s" in proc.stdout and "Paris" in proc.stdout


def _tiny_hf_model(directory):
    """A random 2-layer Llama with a byte-level tokenizer, saved as an HF directory."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                            unk_token="<|endoftext|>").save_pretrained(directory)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(vocab), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         bos_token_id=1, eos_token_id=2, tie_word_embeddings=True)
    LlamaForCausalLM(config).save_pretrained(directory)


@pytest.mark.slow
def test_generate_with_an_hf_directory(tmp_path):
    _tiny_hf_model(tmp_path)
    proc = conveyor("generate", "Hello", "--model", str(tmp_path), "--json", "--max-tokens", "5",
                    "--temperature", "0", "--num-gpu-blocks", "16", "--max-model-len", "128")
    assert proc.returncode == 0, proc.stderr
    (result,) = json.loads(proc.stdout)
    assert result["num_prompt_tokens"] == 5  # one token per byte
    assert 1 <= len(result["outputs"][0]["token_ids"]) <= 5
    missing = conveyor("generate", "Hello", "--model", str(tmp_path / "nope"))
    assert missing.returncode == 2 and "not found" in missing.stderr and "Traceback" not in missing.stderr
