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

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        return self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)

    def encode_chat(self, messages: list[dict]) -> list[int]:
        # The rendered template already holds the model's special tokens as text.
        return self.encode(self.render(messages), add_special_tokens=False)
