"""Stop strings: generated tokens are held back until it is certain they are not part of one,
matched on the generated UTF-8 bytes in time linear in what is new."""
from __future__ import annotations

import collections
import functools


@functools.lru_cache(maxsize=256)
def _failure(pat: bytes) -> tuple[int, ...]:
    """KMP's failure function: fail[i] is the length of the longest proper prefix of
    pat[:i+1] that is also its suffix. Cached: a client that repeats its stop strings pays once."""
    fail = [0] * len(pat)
    k = 0
    for i in range(1, len(pat)):
        c = pat[i]
        while k and pat[k] != c:
            k = fail[k - 1]
        if pat[k] == c:
            k += 1
        fail[i] = k
    return tuple(fail)


class _Matcher:
    """One stop string's streaming matcher: `state` is the length of the longest prefix of
    the stop string that ends the bytes fed so far, advanced byte by byte (amortized O(1)
    each), so nothing already seen is looked at again."""
    __slots__ = ("text", "pat", "fail", "state")

    def __init__(self, text: str):
        self.text = text
        self.pat = text.encode()
        self.fail = _failure(self.pat)
        self.state = 0

    def feed(self, data: bytes) -> int:
        """Advance over data; the offset in data just past the first complete match, or -1."""
        pat, fail, k, n = self.pat, self.fail, self.state, len(self.pat)
        for j, c in enumerate(data):
            while k and pat[k] != c:
                k = fail[k - 1]
            if pat[k] == c:
                k += 1
                if k == n:
                    self.state = k
                    return j + 1
        self.state = k
        return -1


class StopText:
    """Holds back generated tokens until it is certain they are not part of a stop string.

    Matching runs on the generated UTF-8 bytes, which is exact for any valid stop string
    (UTF-8 is self-synchronizing). When a stop string matches, tokens wholly before it are
    released, a token that runs into it is released with `keep` = the bytes before the stop,
    and the rest is dropped. Of several stop strings matching in one token, the one starting
    first wins. The work per token is linear in its bytes times the number of stop strings,
    whatever their length and however long the text has grown: no byte is searched twice.
    """

    def __init__(self, stops: list[str]):
        self.matchers = [_Matcher(s) for s in stops]
        self.size = 0  # bytes seen so far
        self.pending: collections.deque[tuple[dict, int, int]] = collections.deque()  # (entry, start, end)

    def push(self, entry: dict, data: bytes) -> tuple[list[dict], str | None]:
        """Add one token; returns (entries released, matched stop string or None)."""
        start = self.size
        self.size += len(data)
        self.pending.append((entry, start, self.size))
        if not self.matchers:
            return self.flush(), None
        hit: tuple[int, str] | None = None
        for m in self.matchers:
            end = m.feed(data)
            if end >= 0:
                p = start + end - len(m.pat)
                if hit is None or p < hit[0]:
                    hit = (p, m.text)
        if hit is not None:
            return self._cut(hit[0]), hit[1]
        safe = self.size - max(m.state for m in self.matchers)
        out = []
        while self.pending and self.pending[0][2] <= safe:
            out.append(self.pending.popleft()[0])
        return out, None

    def _cut(self, p: int) -> list[dict]:
        out = []
        for entry, start, end in self.pending:
            if end <= p:
                out.append(entry)
            elif start < p:
                out.append({**entry, "keep": p - start})
        self.pending.clear()
        return out

    def flush(self) -> list[dict]:
        out = [e for e, _, _ in self.pending]
        self.pending.clear()
        return out
