"""Turn the engine's token entries (exact bytes, raw logprobs, top tables) into text and the
OpenAI logprobs shapes.

Text is the UTF-8 decoding of the token bytes, one incremental decoder per choice, so a
token that ends mid-character contributes "" and the token that completes the character
carries it; `"".join(tokens) == text` by construction, except for a generated EOS token,
which has its entry (labelled with its own text) but adds nothing to the text.

Top-table labels (completions): the token actually at the position is labelled with its
own text contribution, so lm-eval's greedy check (`max(top) == token`) works. Other
entries are labelled with their own text, or `bytes:\\xNN...` when their bytes are not
valid UTF-8 on their own; an entry whose label is already taken in the same table is
labelled `token_id:N` instead, so no two entries ever collapse. A token cut by a stop
string is the exception: `tokens` holds the part of it in the text, and its table names it
by its whole text (the cut part could be another token's text: `" "` of `" Paris"`).
"""
from __future__ import annotations

import codecs
from dataclasses import dataclass, field


def own_label(b: bytes) -> str:
    try:
        return b.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{c:02x}" for c in b)


@dataclass
class Piece:
    """One token position, ready for any of the response shapes."""
    id: int
    token: bytes        # the token's exact bytes
    raw: bytes          # the part of them in the text (cut by `keep` at a stop string)
    text: str           # its contribution to the text
    logprob: float | None
    top: list | None    # [[id, hex, logprob], ...] sorted, or None
    conditioned: bool = True  # False only for echo position 0
    eos: bool = False   # the generated end-of-sequence token: reported, but not part of the text
    dist: str | None = None      # the whole log-softmax row (base64 float32), when asked for
    scores: list | None = None   # score_tokens' values, when asked for

    @property
    def label(self) -> str:
        """The token's text in `tokens`: its contribution to the text, except for EOS, which
        contributes nothing and is labelled with its own text (e.g. `<|im_end|>`)."""
        return own_label(self.raw) if self.eos else self.text


class TextBuilder:
    """One choice's decoder. Feed pieces in order; `finish` flushes an incomplete tail."""

    def __init__(self):
        self.dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.pieces: list[Piece] = []

    def feed(self, e: dict, conditioned: bool = True) -> Piece:
        token = bytes.fromhex(e["bytes"])
        raw = token[: e["keep"]] if "keep" in e else token
        if e.get("eos"):
            self.finish()  # an incomplete character before EOS ends as U+FFFD in the text, not in EOS
            p = Piece(e["id"], token, raw, "", e["logprob"], e.get("top"), conditioned, eos=True,
                      dist=e.get("dist"), scores=e.get("scores"))
        else:
            p = Piece(e["id"], token, raw, self.dec.decode(raw), e["logprob"], e.get("top"), conditioned,
                      dist=e.get("dist"), scores=e.get("scores"))
        self.pieces.append(p)
        return p

    @property
    def pending(self) -> bool:
        return bool(self.dec.getstate()[0])

    def finish(self) -> str:
        tail = self.dec.decode(b"", final=True)
        text_pieces = [p for p in self.pieces if not p.eos]
        if tail and text_pieces:
            text_pieces[-1].text += tail
        return tail


def build_pieces(tokens: list[dict], echo: list[dict] = ()) -> list[Piece]:
    """One whole choice: its echo positions (position 0 unconditioned), then its tokens."""
    b = TextBuilder()
    for j, e in enumerate(echo):
        b.feed(e, conditioned=j > 0)
    for e in tokens:
        b.feed(e)
    b.finish()
    return b.pieces


@dataclass(frozen=True)
class RowReports:
    """What a request asked each position to report beyond its value and table (probity's
    extensions): the whole distribution, and the values of score_tokens (their ids, in order)."""
    distribution: bool = False
    score_ids: list[int] | None = None

    @classmethod
    def of(cls, sampling, accept: dict) -> "RowReports":
        return cls(sampling.distribution, accept.get("score_ids"))

    @property
    def any(self) -> bool:
        return self.distribution or self.score_ids is not None


@dataclass
class CompletionLogprobs:
    tokens: list = field(default_factory=list)
    token_logprobs: list = field(default_factory=list)
    top_logprobs: list = field(default_factory=list)
    text_offset: list = field(default_factory=list)
    distributions: list | None = None   # per position, base64 float32 rows (null at an echo's position 0)
    token_scores: list | None = None    # per position, score_tokens' values
    score_token_ids: list | None = None

    def as_dict(self) -> dict:
        out = {"tokens": self.tokens, "token_logprobs": self.token_logprobs,
               "top_logprobs": self.top_logprobs, "text_offset": self.text_offset}
        if self.distributions is not None:
            out["distributions"] = self.distributions
        if self.score_token_ids is not None:
            out["score_token_ids"] = self.score_token_ids
            out["token_scores"] = self.token_scores
        return out


def completion_logprobs(pieces: list[Piece], start_offset: int, token_ids: bool,
                        rows: RowReports = RowReports()) -> CompletionLogprobs:
    out = CompletionLogprobs()
    if rows.distribution:
        out.distributions = []
    if rows.score_ids is not None:
        out.token_scores, out.score_token_ids = [], rows.score_ids
    offset = start_offset
    for p in pieces:
        label = f"token_id:{p.id}" if token_ids else p.label
        out.tokens.append(label)
        out.text_offset.append(offset)
        offset += len(p.text)
        if out.distributions is not None:
            out.distributions.append(p.dist if p.conditioned else None)
        if out.token_scores is not None:
            out.token_scores.append(p.scores if p.conditioned else None)
        if not p.conditioned:
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            continue
        out.token_logprobs.append(p.logprob)
        out.top_logprobs.append(top_dict(p, label, token_ids) if p.top is not None else None)
    return out


def top_dict(p: Piece, label: str, token_ids: bool) -> dict:
    if not token_ids and not p.eos and p.raw != p.token:
        # A token a stop string cut keeps only its first bytes in `tokens`; in its table it is
        # named by its whole text, so its value never sits under another token's label.
        label = own_label(p.token)
    taken = {label}
    table = {}
    for tid, hexb, lp in p.top:
        if tid == p.id:
            name = label
        else:
            name = f"token_id:{tid}" if token_ids else own_label(bytes.fromhex(hexb))
            if name in taken:
                name = f"token_id:{tid}"
        taken.add(name)
        table[name] = lp
    return table


def chat_logprobs(pieces: list[Piece]) -> list[dict]:
    out = []
    for p in pieces:
        top = [{"token": own_label(bytes.fromhex(h)), "logprob": lp, "bytes": list(bytes.fromhex(h))}
               for _, h, lp in (p.top or [])]
        # the token itself, also when a stop string cut its text: `bytes` are the token's
        e = {"token": own_label(p.token), "logprob": p.logprob, "bytes": list(p.token), "top_logprobs": top}
        if p.dist is not None:
            e["distribution"] = p.dist
        if p.scores is not None:
            e["token_scores"] = p.scores
        out.append(e)
    return out
