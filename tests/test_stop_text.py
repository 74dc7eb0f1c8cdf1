"""Stop strings: the streaming matcher against a brute-force reference, and its work bound."""
from __future__ import annotations

import random

from probity.engine import stop_text as sequence
from probity.engine.stop_text import StopText


def reference(stops: list[bytes], tokens: list[bytes]) -> tuple[list[tuple[int, int | None]], bytes | None]:
    """Plain search over the whole text after every token: the released (index, keep) pairs
    and the matched stop, computed from scratch each time."""
    text = b""
    released: list[tuple[int, int | None]] = []
    bounds = []
    for i, t in enumerate(tokens):
        start = len(text)
        text += t
        bounds.append((start, len(text)))
        hits = [(text.find(s), s) for s in stops if text.find(s) >= 0]
        if hits:
            p, s = min(hits, key=lambda h: h[0])
            for j in range(len(released), i + 1):
                a, b = bounds[j]
                if b <= p:
                    released.append((j, None))
                elif a < p:
                    released.append((j, p - a))
            return released, s
        hold = max((n for s in stops for n in range(1, len(s)) if text.endswith(s[:n])), default=0)
        while len(released) <= i and bounds[len(released)][1] <= len(text) - hold:
            released.append((len(released), None))
    return released + [(j, None) for j in range(len(released), len(tokens))], None


def run(stops: list[bytes], tokens: list[bytes]):
    st = StopText([s.decode() for s in stops])
    released: list[tuple[int, int | None]] = []
    for i, t in enumerate(tokens):
        out, matched = st.push({"i": i}, t)
        released += [(e["i"], e.get("keep")) for e in out]
        if matched is not None:
            return released, matched.encode()
    return released + [(e["i"], e.get("keep")) for e in st.flush()], None


def test_stop_matching_equals_a_brute_force_search_on_random_text():
    rng = random.Random(7)
    alphabet = [b"a", b"b", b"ab", b"ba", b"aab", b"\xc3\xa9", b"", b"abab"]
    for _ in range(3000):
        stops = list({"".join(rng.choice("ab\u00e9") for _ in range(rng.randint(1, 6))).encode()
                      for _ in range(rng.randint(1, 4))})
        tokens = [rng.choice(alphabet) for _ in range(rng.randint(1, 14))]
        assert run(stops, tokens) == reference(stops, tokens), (stops, tokens)


def test_a_stop_string_split_over_tokens_and_ending_inside_one_cuts_it():
    st = StopText(["Paris"])
    assert st.push({"i": 0}, b" Pa") == ([], None)
    out, matched = st.push({"i": 1}, b"ris is")
    assert matched == "Paris" and out == [{"i": 0, "keep": 1}]


def test_work_per_token_does_not_grow_with_the_text_or_the_stop_length(monkeypatch):
    """32 stop strings of 4,096 '#' against 300 tokens of 80 '#' each (the hostile case
    that re-sliced the whole buffer per prefix length): byte comparisons are counted, and
    they stay within a constant of (bytes fed) x (stop strings)."""
    steps = [0]

    class Counting(bytes):
        def __getitem__(self, i):
            steps[0] += 1
            return bytes.__getitem__(self, i)

    real = sequence._Matcher.__init__

    def counted(self, text):
        real(self, text)
        self.pat = Counting(self.pat)

    monkeypatch.setattr(sequence._Matcher, "__init__", counted)
    stops = ["#" * (4096 - i) for i in range(32)]
    st = StopText(stops)
    fed = 0
    for i in range(300):
        data = b"#" * 79 + b"x"  # never completes a stop, always leaves a long partial match
        out, matched = st.push({"i": i}, data)
        fed += len(data)
        assert matched is None
    assert steps[0] <= 4 * fed * len(stops)
