"""Stop strings found across arbitrary chunk boundaries, and the streaming hold-back."""

from hypothesis import assume, given
from hypothesis import strategies as st

from conveyor.engine.stop_strings import find_stop_string, partial_stop_len, truncate_at_stop


def _stream(chunks: list[str], stops: list[str], include: bool) -> tuple[str, str | None, list[str]]:
    text, visible = "", []
    for chunk in chunks:
        start = len(text)
        text += chunk
        hit = find_stop_string(text, start, stops)
        if hit:
            return truncate_at_stop(text, hit[0], hit[1], include), hit[1], visible
        visible.append(text[: len(text) - partial_stop_len(text, stops)])
    return text, None, visible


def test_stop_string_split_across_chunks():
    text, stop, visible = _stream(["Hello wo", "rl", "d! more"], ["world"], include=False)
    assert (text, stop) == ("Hello ", "world")
    assert visible == ["Hello ", "Hello "]  # "wo" and "world"'s prefix "worl" are held back


def test_include_stop_str_and_earliest_match_wins():
    text, stop, _ = _stream(["a STOP b END c"], ["END", "STOP"], include=True)
    assert (text, stop) == ("a STOP", "STOP")


def test_partial_stop_len():
    assert partial_stop_len("abc<|im", ["<|im_end|>"]) == 4
    assert partial_stop_len("abc", ["<|im_end|>"]) == 0
    assert partial_stop_len("ab", ["b", "bc"]) == 1  # a complete stop is not a *partial* one


alphabet = st.sampled_from("ab c")


@given(st.lists(st.text(alphabet, max_size=6), max_size=12),
       st.lists(st.text(alphabet, min_size=1, max_size=4), min_size=1, max_size=3),
       st.booleans())
def test_streaming_matches_whole_text_search(chunks, stops, include):
    # When one stop contains another, which one wins depends on where tokens split (as in vLLM).
    assume(not any(a != b and a in b for a in stops for b in stops))
    whole = "".join(chunks)
    text, stop, visible = _stream(chunks, stops, include)
    matches = [(whole.find(s), s) for s in stops if s in whole]
    if not matches:
        assert (text, stop) == (whole, None)
    else:
        index = min(i for i, _ in matches)
        assert text[:index] == whole[:index] and stop is not None
        assert whole[index:].startswith(stop)
        assert text == (whole[: index + len(stop)] if include else whole[:index])
    # what a streamer saw only ever grows and never shows anything the final text lacks
    for a, b in zip(visible, visible[1:], strict=False):
        assert b.startswith(a)
    for v in visible:
        assert text.startswith(v)
