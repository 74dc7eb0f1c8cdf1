"""Property tests of the logprobs assembly over random multibyte text and random token cuts."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from probity.server.pieces import TextBuilder, build_pieces, chat_logprobs, completion_logprobs, own_label

texts = st.text(alphabet=st.characters(min_codepoint=1, max_codepoint=0x1F9FF, blacklist_categories=("Cs",)),
                min_size=1, max_size=40)


@st.composite
def tokenized(draw):
    """A text and a random cut of its UTF-8 bytes into tokens (cuts may fall inside characters),
    each with a random top table that may hold other tokens with identical bytes."""
    data = draw(texts).encode()
    cuts = sorted(draw(st.sets(st.integers(1, len(data) - 1), max_size=len(data) - 1))) if len(data) > 1 else []
    pieces = [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)])]
    entries = []
    for i, b in enumerate(pieces):
        own = -draw(st.floats(0, 20, allow_nan=False))
        alts = [(1000 + i * 10 + j, b if draw(st.booleans()) else draw(st.binary(min_size=1, max_size=3)),
                 -draw(st.floats(0, 20, allow_nan=False))) for j in range(draw(st.integers(0, 4)))]
        table = sorted([(i, b, own), *alts], key=lambda t: (-t[2], t[0]))
        entries.append({"id": i, "bytes": b.hex(), "logprob": own,
                        "top": [[t, x.hex(), v] for t, x, v in table]})
    return data, entries


@settings(max_examples=400, deadline=None)
@given(tokenized())
def test_join_equals_text_offsets_and_distinct_labels(case):
    data, entries = case
    pieces = build_pieces(entries)
    text = "".join(p.text for p in pieces)
    assert text == data.decode("utf-8")
    lp = completion_logprobs(pieces, 0, token_ids=False)
    assert "".join(lp.tokens) == text
    for tok, off in zip(lp.tokens, lp.text_offset):
        assert text[off:off + len(tok)] == tok
    for e, tok, v, table in zip(entries, lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(table) == len(e["top"])  # nothing collapsed
        assert table[tok] == v  # the chosen token is in its table under its own label, same float
        assert list(table.values()) == sorted(table.values(), reverse=True)


@settings(max_examples=200, deadline=None)
@given(tokenized())
def test_chat_bytes_are_exact_even_for_partial_characters(case):
    data, entries = case
    content = chat_logprobs(build_pieces(entries))
    assert b"".join(bytes(c["bytes"]) for c in content) == data
    for c, e in zip(content, entries):
        assert c["token"] == own_label(bytes.fromhex(e["bytes"]))


def test_a_token_ending_mid_character_contributes_empty_text():
    euro = "€".encode()
    b = TextBuilder()
    for i, chunk in enumerate([b"a", euro[:1], euro[1:], b"b"]):
        b.feed({"id": i, "bytes": chunk.hex(), "logprob": -1.0, "top": None})
    b.finish()
    assert [p.text for p in b.pieces] == ["a", "", "€", "b"]


def test_an_unfinished_character_at_the_end_is_replaced_on_the_last_token():
    b = TextBuilder()
    b.feed({"id": 1, "bytes": "61", "logprob": -1.0})
    b.feed({"id": 2, "bytes": "e282", "logprob": -1.0})
    b.finish()
    assert [p.text for p in b.pieces] == ["a", "\ufffd"]


def test_keep_cuts_a_token_at_a_stop_string():
    b = TextBuilder()
    b.feed({"id": 1, "bytes": "2e0a", "logprob": -1.0, "keep": 1})
    assert b.pieces[0].text == "." and b.pieces[0].raw == b"."
