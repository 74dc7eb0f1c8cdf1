"""The tokenizer as the engine uses it: text <-> ids, chat rendering, and each token's exact bytes."""
from __future__ import annotations

import re


def _bytes_to_unicode() -> dict[int, str]:
    # GPT-2's reversible byte <-> printable-character map used by byte-level BPE.
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class Vocab:
    def __init__(self, tokenizer, vocab_size: int):
        self.tok = tokenizer
        self.size = vocab_size
        self.token_bytes: list[bytes] = self._build_bytes_table()
        self.eos_ids = self._eos_ids()
        specials = self._specials()
        self.special_ids = {i for i in tokenizer.convert_tokens_to_ids(specials) if i is not None}
        self._code = {t: chr(0xF0000 + k) for k, t in enumerate([_ESC, *specials])}
        self._string = {c: t for t, c in self._code.items()}
        self._special_re = re.compile("|".join(re.escape(t) for t in [*specials, _ESC]))

    # ------------------------------------------------------------ bytes
    def _build_bytes_table(self) -> list[bytes]:
        tok = self.tok
        pieces = tok.convert_ids_to_tokens(list(range(self.size)))
        special = set(getattr(tok, "all_special_tokens", []) or [])
        added = {t.content for t in getattr(tok, "added_tokens_decoder", {}).values()}
        decoder = getattr(getattr(tok, "backend_tokenizer", None), "decoder", None)
        byte_level = decoder is not None and "ByteLevel" in type(decoder).__name__ or "ByteLevel" in repr(decoder)
        inv = {c: b for b, c in _bytes_to_unicode().items()}
        table: list[bytes] = []
        for piece in pieces:
            if piece is None:
                table.append(b"")
            elif piece in special or piece in added:
                table.append(piece.encode())
            elif byte_level:
                try:
                    table.append(bytes(inv[c] for c in piece))
                except KeyError:
                    table.append(piece.encode())
            else:
                m = _BYTE_FALLBACK.fullmatch(piece)
                table.append(bytes([int(m.group(1), 16)]) if m else piece.replace("\u2581", " ").encode())
        return table

    def _eos_ids(self) -> list[int]:
        ids = set()
        if self.tok.eos_token_id is not None:
            ids.add(int(self.tok.eos_token_id))
        return sorted(i for i in ids if 0 <= i < self.size)

    # ------------------------------------------------------------ text
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tok(text, add_special_tokens=add_special_tokens)["input_ids"])

    def decode(self, ids: list[int]) -> str:
        return b"".join(self.token_bytes[i] for i in ids).decode("utf-8", errors="replace")

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tok, "chat_template", None))

    def render(self, messages: list[dict]) -> str:
        """The template's text. A final assistant message is continued (prefill), not closed:
        the model writes on from its last character, as Anthropic's API does."""
        cont = messages[-1]["role"] == "assistant"
        return self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=not cont,
                                            continue_final_message=cont)

    def encode_chat(self, messages: list[dict]) -> list[int]:
        """Only the template's own markup becomes special tokens; message content is text,
        so a `<|im_end|>` typed by a user is tokenized as the characters it is made of.

        The content's special-token strings are swapped for private-use sentinels, the
        template is rendered and tokenized (every special token found now is markup), and
        each stretch of text between two of them is restored and tokenized with special
        tokens off -- the same split the tokenizer itself makes around special tokens."""
        rendered = self.render([{**m, "content": self._escape(m["content"])} for m in messages])
        enc = self.tok(rendered, add_special_tokens=False, return_offsets_mapping=True)
        ids: list[int] = []
        at = 0
        for tid, (start, end) in zip(enc["input_ids"], enc["offset_mapping"]):
            if tid in self.special_ids:
                ids += self._plain(rendered[at:start])
                ids.append(tid)
                at = end
        return ids + self._plain(rendered[at:])

    # ------------------------------------------------------------ content as text
    def _specials(self) -> list[str]:
        decoder = getattr(self.tok, "added_tokens_decoder", {}) or {}
        found = {t.content for t in decoder.values() if getattr(t, "special", False)}
        found |= set(getattr(self.tok, "all_special_tokens", []) or [])
        return sorted((t for t in found if t), key=len, reverse=True)  # longest first: no prefix wins

    def _escape(self, text: str) -> str:
        return self._special_re.sub(lambda m: _ESC + self._code[m.group()], text)

    def _plain(self, text: str) -> list[int]:
        if not text:
            return []
        text = _SENTINEL_RE.sub(lambda m: self._string.get(m.group(1), m.group()), text)
        return list(self.tok(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])


# While the template renders, a special-token string inside content (and the escape
# character itself) stands as _ESC + one private-use code point: templates may trim or
# reformat content, never private-use characters.
_ESC = "\ue000"
_SENTINEL_RE = re.compile(f"{_ESC}(.)", re.S)
