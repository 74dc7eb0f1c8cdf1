"""The tokenizer as the engine uses it: text <-> ids, chat rendering, and each token's exact bytes."""
from __future__ import annotations

import json
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
        self.tools_in_template = self._renders_tools()
        self.tool_format = tool_format(getattr(tokenizer, "chat_template", None) or "", self.tools_in_template)

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

    def render(self, messages: list[dict], tools: list[dict] | None = None) -> str:
        """The template's text. A final assistant message is continued (prefill), not closed:
        the model writes on from its last character, as Anthropic's API does. `tools` (OpenAI's
        shape) go to the template where it renders them, and into the documented fallback
        where it does not (docs/api.md, Tools)."""
        cont = messages[-1]["role"] == "assistant" and not messages[-1].get("tool_calls")
        if tools is not None or any(m.get("tool_calls") or m["role"] == "tool" for m in messages):
            messages, tools = self._with_tools(messages, tools)
        kw = {"tools": tools} if tools else {}
        return self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=not cont,
                                            continue_final_message=cont, **kw)

    def _renders_tools(self) -> bool:
        """Whether the chat template writes a request's tools into the prompt at all."""
        if not self.has_chat_template:
            return False
        probe = [{"role": "user", "content": "hi"}]
        tool = [{"type": "function", "function": {"name": "probity_probe_tool", "description": "probe",
                                                  "parameters": {"type": "object", "properties": {}}}}]
        try:
            return "probity_probe_tool" in self.tok.apply_chat_template(probe, tokenize=False, tools=tool,
                                                                         add_generation_prompt=True)
        except Exception:
            return False

    def _with_tools(self, messages: list[dict], tools: list[dict] | None) -> tuple[list[dict], list[dict] | None]:
        """The wire's messages in the shape chat templates read (assistant `tool_calls` with
        their arguments as objects, `tool` messages with their call's id); where the template
        ignores tools, the Hermes-style fallback: the tools described in the system message,
        calls as <tool_call> text, results as <tool_response> user text."""
        out = []
        for m in messages:
            m = dict(m)
            calls = m.pop("tool_calls", None)
            if calls:
                hf = []
                for c in calls:
                    try:
                        args = json.loads(c["arguments"])
                    except ValueError:
                        args = c["arguments"]
                    hf.append({"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": args}})
                if self.tools_in_template:
                    m["tool_calls"] = hf
                else:
                    m["content"] = m["content"] + "".join(
                        "\n<tool_call>\n" + json.dumps({"name": c["function"]["name"],
                                                          "arguments": c["function"]["arguments"]},
                                                         ensure_ascii=False) + "\n</tool_call>" for c in hf)
            if m["role"] == "tool" and not self.tools_in_template:
                m = {"role": "user", "content": "<tool_response>\n" + m["content"] + "\n</tool_response>"}
            out.append(m)
        if tools and not self.tools_in_template:
            described = FALLBACK_TOOLS.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
            if out and out[0]["role"] == "system":
                out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + described}
            else:
                out.insert(0, {"role": "system", "content": described})
            tools = None
        return out, tools

    def encode_chat(self, messages: list[dict], tools: list[dict] | None = None,
                    marks: list[bool] | None = None) -> list[int]:
        """Only the template's own markup becomes special tokens; message content is text,
        so a `<|im_end|>` typed by a user is tokenized as the characters it is made of.

        The content's special-token strings are swapped for private-use sentinels, the
        template is rendered and tokenized (every special token found now is markup), and
        each stretch of text between two of them is restored and tokenized with special
        tokens off -- the same split the tokenizer itself makes around special tokens.

        `marks`, when given, receives one flag per token: True where the token is the
        template's own, False where it lies wholly inside a message's content (each content
        is found in the rendered text in order, as written or trimmed)."""
        escaped = [{**m, "content": self._escape(m["content"])} for m in messages]
        rendered = self.render(escaped, tools)
        spans = _content_spans(rendered, [m["content"] for m in escaped]) if marks is not None else []
        enc = self.tok(rendered, add_special_tokens=False, return_offsets_mapping=True)
        ids: list[int] = []
        at = 0
        for tid, (start, end) in zip(enc["input_ids"], enc["offset_mapping"]):
            if tid in self.special_ids:
                ids += self._plain(rendered, at, start, spans, marks)
                ids.append(tid)
                if marks is not None:
                    marks.append(True)
                at = end
        return ids + self._plain(rendered, at, len(rendered), spans, marks)

    # ------------------------------------------------------------ content as text
    def _specials(self) -> list[str]:
        decoder = getattr(self.tok, "added_tokens_decoder", {}) or {}
        found = {t.content for t in decoder.values() if getattr(t, "special", False)}
        found |= set(getattr(self.tok, "all_special_tokens", []) or [])
        return sorted((t for t in found if t), key=len, reverse=True)  # longest first: no prefix wins

    def _escape(self, text: str) -> str:
        return self._special_re.sub(lambda m: _ESC + self._code[m.group()], text)

    def _plain(self, rendered: str, a: int, b: int, spans: list[tuple[int, int]] = (),
               marks: list[bool] | None = None) -> list[int]:
        """rendered[a:b], its sentinels restored, as plain text's tokens; with `marks`, each
        token's flag (True: not wholly inside one of the content `spans` of `rendered`)."""
        if a >= b:
            return []
        text, src = [], []   # the restored text, and each of its characters' index in `rendered`
        i = a
        while i < b:
            c = rendered[i]
            if c == _ESC and i + 1 < b:
                orig = self._string.get(rendered[i + 1], rendered[i:i + 2])
                text.append(orig)
                src += [i] * len(orig)
                i += 2
            else:
                text.append(c)
                src.append(i)
                i += 1
        enc = self.tok("".join(text), add_special_tokens=False, split_special_tokens=True,
                       return_offsets_mapping=marks is not None)
        if marks is not None:
            for s0, e0 in enc["offset_mapping"]:
                lo, hi = src[min(s0, len(src) - 1)], src[max(e0 - 1, 0)] + 1
                marks.append(not any(cs <= lo and hi <= ce for cs, ce in spans))
        return list(enc["input_ids"])


def _content_spans(rendered: str, contents: list[str]) -> list[tuple[int, int]]:
    """Where each message's content lies in the rendered template, searched in order (as
    written, else trimmed; a content the template dropped has no span)."""
    spans, at = [], 0
    for c in contents:
        for probe in (c, c.strip()):
            if not probe:
                continue
            k = rendered.find(probe, at)
            if k >= 0:
                spans.append((k, k + len(probe)))
                at = k + len(probe)
                break
    return spans


# The tools of a request whose chat template ignores them: described as Hermes-style templates
# (Qwen2.5, Hermes 2/3) describe them, and called in the same format (docs/api.md, Tools).
FALLBACK_TOOLS = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}}\n</tool_call>")


def tool_format(template: str, in_template: bool) -> str:
    """How the model writes a tool call, from its chat template: `hermes` (<tool_call>{json}
    </tool_call>: Qwen2.5, Hermes, and the fallback), `mistral` ([TOOL_CALLS][...]) or
    `llama3_json` (a bare {"name", "parameters"} object: Llama 3.1+)."""
    if not in_template or "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or "ipython" in template or '"parameters"' in template:
        return "llama3_json"
    return "hermes"


# While the template renders, a special-token string inside content (and the escape
# character itself) stands as _ESC + one private-use code point: templates may trim or
# reformat content, never private-use characters.
_ESC = "\ue000"
