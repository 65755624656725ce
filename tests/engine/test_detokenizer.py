"""Incremental detokenization equals decoding the whole, for multi-byte UTF-8 and split characters."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conveyor.engine.detokenizer import IncrementalDetokenizer

TEXTS = [
    "Hello 👋 world 🎉🎉!",
    "你好，世界。今天天气很好。",
    "ünïcödé — naïve café, 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 and 🧑‍🤝‍🧑 family",
    "Mixed: 日本語のテキスト 😀 and code `x = 1`",
]


def _stream(tokenizer, prompt_ids, output_ids, skip_special_tokens=True):
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens)
    deltas = [detok.add_token(t) for t in output_ids]
    return deltas, "".join(deltas) + detok.flush()


@pytest.mark.parametrize("text", TEXTS)
def test_multibyte_text_equals_whole_decode(tokenizer, text):
    prompt_ids = tokenizer.encode("Say something:")
    output_ids = tokenizer.encode(text)
    # the test is only meaningful if some character really is split across tokens
    assert any("\ufffd" in tokenizer.decode([t]) for t in output_ids)
    deltas, streamed = _stream(tokenizer, prompt_ids, output_ids)
    assert streamed == tokenizer.decode(output_ids) == text
    assert not any("\ufffd" in d for d in deltas)


def test_special_tokens_skipped_or_kept(tokenizer):
    ids = tokenizer.encode("Hi 🎉") + [tokenizer.eos_token_id] + tokenizer.encode(" there")
    assert _stream(tokenizer, [], ids, True)[1] == tokenizer.decode(ids, skip_special_tokens=True)
    assert _stream(tokenizer, [], ids, False)[1] == tokenizer.decode(ids, skip_special_tokens=False)


def test_unfinished_character_is_held_then_flushed(tokenizer):
    ids = tokenizer.encode("ok 🎉")
    deltas, streamed = _stream(tokenizer, [], ids[:-1])
    assert "".join(deltas) == "ok"
    assert streamed == tokenizer.decode(ids[:-1])  # the flush shows what is there, U+FFFD included


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=40),
       st.text(max_size=10))
def test_any_text_round_trips(tokenizer, text, prompt):
    output_ids = tokenizer.encode(text)
    assert _stream(tokenizer, tokenizer.encode(prompt), output_ids)[1] == tokenizer.decode(output_ids)


@pytest.fixture(scope="module")
def byte_fallback_tokenizer():
    """A tiny SentencePiece-style tokenizer (▁ for spaces) whose unknown characters fall back to
    <0xNN> byte tokens, like Llama 2's: an emoji is four tokens that decode alone to U+FFFD."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    for ch in "▁abcdefghijklmnopqrstuvwxyz,.!":
        vocab[ch] = len(vocab)
    merges = [("▁", "h"), ("e", "l"), ("el", "l"), ("▁h", "ell")]
    vocab.update({a + b: len(vocab) + i for i, (a, b) in enumerate(merges)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")


@pytest.mark.parametrize("text", ["hello 🎉 wörld 你好", "a 😀😀 b", "你好 hello"])
def test_byte_fallback_tokens(byte_fallback_tokenizer, text):
    tok = byte_fallback_tokenizer
    ids = tok.encode(text, add_special_tokens=False)
    assert any(t.startswith("<0x") for t in tok.convert_ids_to_tokens(ids))
    deltas, streamed = _stream(tok, [], ids)
    assert streamed == tok.decode(ids) == text
    assert not any("\ufffd" in d for d in deltas)
    # after a prompt, the first word keeps its leading space (decoded in context, as in vLLM)
    prompt = tok.encode("hello", add_special_tokens=False)
    assert _stream(tok, prompt, ids)[1] == " " + text


def test_wordpiece_text_is_cleaned_up_as_transformers_decode_cleans_it():
    """A WordPiece tokenizer with clean_up_tokenization_spaces: the text goes through
    transformers' decode (which joins "word ." into "word."), not the Rust backend's alone."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["[UNK]", "[SEP]", "hello", "world", "fine", ".", ",", "!"]
    tok = Tokenizer(models.WordPiece({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece(cleanup=False)  # the clean-up left to transformers
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", sep_token="[SEP]",
                                   clean_up_tokenization_spaces=True)
    ids = fast.encode("hello, world! fine.", add_special_tokens=False)
    assert fast.backend_tokenizer.decode(ids) != fast.decode(ids)  # the clean-up matters here
    assert _stream(fast, [], ids)[1] == fast.decode(ids) == "hello, world! fine."
