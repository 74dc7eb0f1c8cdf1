"""Tools on the server's side: a request's tools and tool choice checked (OpenAI's shape;
Anthropic's is mapped onto it), the grammar of a forced call, and the calls found in what the
model wrote, whole (find_calls) or as it streams (ToolText, ForcedCalls). docs/api.md, Tools."""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

import llguidance

from .errors import APIError
from .fields import check_keys, object_field, string_field
from .grammar_bounds import check_lark
from .grammar_check import GrammarCheck
from .structured import DEFAULT_CHECK, JSON_STYLE, check, check_name, json_grammar, strict_problems

MAX_TOOLS = 128


@dataclass
class Tools:
    """A request's tools (OpenAI's shape), what it demands of them, and how the model writes calls."""
    tools: list[dict]                  # [{"type": "function", "function": {name, description?, parameters}}]
    choice: str = "auto"               # none, auto, required, or "function" (a named one)
    named: str | None = None
    parallel: bool = True
    fmt: str = "hermes"

    @property
    def names(self) -> set[str]:
        return {t["function"]["name"] for t in self.tools}

    @property
    def forced(self) -> bool:
        return self.choice in ("required", "function")

    def wire(self) -> str:
        return json.dumps(self.tools, ensure_ascii=False, separators=(",", ":"))

    def grammar(self, gc: GrammarCheck = DEFAULT_CHECK) -> str | None:
        """The grammar of a forced call: every output parses to calls of the allowed functions
        whose arguments match their parameters' schema (its bounds count all of them together)."""
        if not self.forced:
            return None
        fns = [t["function"] for t in self.tools if self.choice == "required" or t["function"]["name"] == self.named]
        key = "parameters" if self.fmt == "llama3_json" else "arguments"
        alts = [{"type": "object", "properties": {"name": {"const": f["name"]},
                                                   key: f.get("parameters") or {"type": "object"}},
                 "required": ["name", key], "additionalProperties": False} for f in fns]
        call = alts[0] if len(alts) == 1 else {"anyOf": alts}
        obj = "%json " + json.dumps({**call, "x-guidance": JSON_STYLE}, ensure_ascii=False)
        if self.fmt == "hermes":
            rule = 'call: "<tool_call>\\n" obj "\\n</tool_call>"'
            start = 'start: call ("\\n" call)*' if self.parallel else "start: call"
        elif self.fmt == "llama3_json":
            rule = "call: obj"
            start = 'start: call ("; " call)*' if self.parallel else "start: call"
        else:
            raise APIError("unsupported_value", f"tool_choice {self.choice!r} cannot be enforced for this model's "
                           f"tool-call format ({self.fmt}); use \"auto\"", "tool_choice")
        text = f"{start}\n{rule}\nobj: {obj}\n"
        check_lark(text, "tools", gc.bounds)
        return check(llguidance.LLMatcher.grammar_from_lark(text), "tools", gc)


def parse_tools(tools: Any, tool_choice: Any, parallel: Any, fmt: str, gc: GrammarCheck = DEFAULT_CHECK) -> Tools | None:
    """OpenAI's tools, tool_choice and parallel_tool_calls, or a named 400."""
    if tool_choice is not None and type(tool_choice) not in (str, dict):
        raise APIError("invalid_type", "'tool_choice' must be a string or an object", "tool_choice")
    if parallel is not None and type(parallel) is not bool:
        raise APIError("invalid_type", "'parallel_tool_calls' must be a boolean", "parallel_tool_calls")
    if tools is None:
        if tool_choice not in (None, "none", "auto"):
            raise APIError("invalid_value", "'tool_choice' must be none or auto without 'tools'", "tool_choice")
        return None
    if type(tools) is not list:
        raise APIError("invalid_type", "'tools' must be an array", "tools")
    if not tools:
        raise APIError("invalid_value", "'tools' must be a non-empty array", "tools")
    if len(tools) > MAX_TOOLS:
        raise APIError("invalid_value", f"'tools' holds at most {MAX_TOOLS} tools", "tools")
    out, names = [], set()
    for i, t in enumerate(tools):
        w = f"tools[{i}]"
        t = object_field(t, w)
        check_keys(t, ("type", "function"), where=w)
        if t.get("type") != "function":
            raise APIError("unsupported_value", f"'{w}.type' must be \"function\"", f"{w}.type")
        f = object_field(t.get("function"), f"{w}.function")
        check_keys(f, ("name", "description", "parameters", "strict"), where=f"{w}.function")
        name = check_name(f.get("name"), f"{w}.function.name")
        if name in names:
            raise APIError("invalid_value", f"tool name {name!r} is given twice", f"{w}.function.name")
        names.add(name)
        fn = {"name": name}
        if f.get("description") is not None:
            fn["description"] = string_field(f["description"], f"{w}.function.description", allow_empty=True)
        fn["parameters"] = _parameters(f, f"{w}.function.parameters", gc)
        out.append({"type": "function", "function": fn})
    spec = Tools(out, fmt=fmt)
    spec.choice, spec.named = _choice(tool_choice, names)
    if parallel is not None:
        spec.parallel = parallel
    return spec


def _parameters(f: dict, where: str, gc: GrammarCheck) -> dict:
    """A function's `parameters` schema, checked and compiled on its own."""
    params = f.get("parameters")
    if params is None:
        return {"type": "object", "properties": {}}
    params = object_field(params, where)
    if params.get("type", "object") != "object":  # as OpenAI: a call's arguments are an object
        raise APIError("invalid_schema", f"'{where}' must be a JSON schema of type \"object\", not "
                       f"{json.dumps(params['type'])}", where)
    if f.get("strict") is True:
        problem = strict_problems(params)
        if problem:
            raise APIError("invalid_schema", f"'{where}' {problem}", where)
    # compiled alone, as the arguments of a call: a schema that admits no output
    # (one that only refers to itself) is refused here, not ended by grammar_dead_end
    json_grammar(params, where, gc)
    return params


def _choice(tool_choice: Any, names: set[str]) -> tuple[str, str | None]:
    """tool_choice as (choice, the named function or None); its type was checked first."""
    if tool_choice is None or tool_choice in ("auto", "none", "required"):
        return tool_choice or "auto", None
    if type(tool_choice) is not dict:
        raise APIError("invalid_value", "'tool_choice' must be none, auto, required or a named function",
                       "tool_choice")
    check_keys(tool_choice, ("type", "function"), where="tool_choice")
    if tool_choice.get("type") != "function":
        raise APIError("unsupported_value", "'tool_choice.type' must be \"function\"", "tool_choice.type")
    fc = object_field(tool_choice.get("function"), "tool_choice.function")
    check_keys(fc, ("name",), where="tool_choice.function")
    name = string_field(fc.get("name"), "tool_choice.function.name")
    if name not in names:
        raise APIError("invalid_value", f"tool_choice names {name!r}, which is not among the tools",
                       "tool_choice.function.name")
    return "function", name


def in_use(tools: Tools | None) -> bool:
    """Whether a request's tools go to the template and its output is read for calls (not
    tool_choice none)."""
    return tools is not None and tools.choice != "none"


def calls_of(text: str, tools: Tools | None, finish: str) -> tuple[str, list[Call]] | None:
    """(content, calls) of a finished choice, or None: only a choice that ended by itself (not
    cut by max_tokens) and whose text parses as calls of the given tools has them."""
    if not in_use(tools) or finish != "stop":
        return None
    content, calls = find_calls(text, tools)
    return (content, calls) if calls else None


@dataclass
class Call:
    id: str
    name: str
    arguments: str  # JSON text of an object

    def openai(self, index: int) -> dict:
        return {"index": index, "id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"(?:[^"\\]|\\.)*"\s*,\s*"(?:arguments|parameters)"\s*:\s*')
_TAIL = re.compile(r"\s*\}\s*")


def _raw_args(raw: str) -> str | None:
    """The arguments object's own text in a call written name first ({"name": …, "arguments":
    {…}}), as the model wrote it; None for any other shape."""
    m = _HEAD.match(raw)
    if not m:
        return None
    try:
        _, end = json.JSONDecoder().raw_decode(raw, m.end())
    except ValueError:
        return None
    return raw[m.end():end] if _TAIL.fullmatch(raw, end) else None


def _call(obj: Any, names: set[str], key: str, raw: str | None = None) -> Call | None:
    """A valid call, or None. Its arguments are the model's own text of the object where the
    call is written name first (so streamed fragments join to exactly this), else the object
    re-serialized (json.dumps, ensure_ascii=False)."""
    if type(obj) is not dict or obj.get("name") not in names:
        return None
    args = obj.get(key, obj.get("arguments" if key == "parameters" else "parameters"))
    if type(args) is not dict:
        return None
    text = _raw_args(raw) if raw is not None else None
    return Call(new_call_id(), obj["name"], text if text is not None else json.dumps(args, ensure_ascii=False))


def find_calls(text: str, spec: Tools) -> tuple[str, list[Call]]:
    """(content, calls) from a finished output in the model's tool-call format: the content is
    the text before the first call, without trailing whitespace (what streaming sends as
    content). Text that is not a valid call (unknown name, arguments not an object, not JSON)
    stays text: ("text", [])."""
    fmt = spec.fmt
    if fmt == "hermes":
        found = list(_HERMES.finditer(text))
        if not found:
            return text, []
        calls = []
        for m in found:
            try:
                c = _call(json.loads(m.group(1)), spec.names, "arguments", m.group(1))
            except ValueError:
                c = None
            if c is None:
                return text, []
            calls.append(c)
        return text[: found[0].start()].rstrip(), calls
    if fmt == "mistral":
        at = text.find("[TOOL_CALLS]")
        if at < 0:
            return text, []
        try:
            arr = json.loads(text[at + len("[TOOL_CALLS]"):].strip())
        except ValueError:
            return text, []
        calls = [_call(o, spec.names, "arguments") for o in (arr if type(arr) is list else [arr])]
        return (text[:at].rstrip(), calls) if calls and all(calls) else (text, [])
    body = text.strip().removeprefix("<|python_tag|>").strip()   # llama3_json
    calls, dec, at = [], json.JSONDecoder(), 0
    while at < len(body):
        try:
            obj, end = dec.raw_decode(body, at)
        except ValueError:
            return text, []
        c = _call(obj, spec.names, "parameters", body[at:end])
        if c is None:
            return text, []
        calls.append(c)
        at = end
        while at < len(body) and body[at] in "; \n\t":
            at += 1
    return ("", calls) if calls else (text, [])


def call_start(fmt: str) -> str:
    """The text that opens a call in this format (streaming holds content back from here on)."""
    return {"hermes": "<tool_call>", "mistral": "[TOOL_CALLS]"}.get(fmt, "{")


class ToolText:
    """One streamed choice's text where the model may call tools: content goes out as it
    comes until a call may be starting (the format's opening text, or a prefix of it at the
    end), then is held; at the end, held text that parses as calls becomes tool-call deltas,
    and is sent as content otherwise."""

    def __init__(self, tools: Tools):
        self.tools = tools
        self.marker = call_start(tools.fmt)
        self.pending = ""      # content not yet sent: it may begin a call
        self.held = False      # a call has begun: everything from here waits for the end
        self.seen = ""         # all text so far (a llama3_json call opens the output)
        # calls a grammar forces come in one exact form: their parts go out as they are written
        self.forced = ForcedCalls(tools.fmt) if tools.forced and tools.fmt in ("hermes", "llama3_json") else None
        self.events: list[tuple] = []   # forced calls' ("start", i, id, name), ("args", i, text), ("end", i)

    def add(self, text: str) -> str:
        """Content that can go out now (and, for forced calls, `events` to send)."""
        self.seen += text
        if self.forced is not None:
            self.held = True
            self.events += self.forced.feed(self.seen)
            return ""
        self.pending += text
        if self.held:
            return ""
        if self.marker is None:   # the output began otherwise: it is content throughout
            out, self.pending = self.pending, ""
            return out
        if self.marker == "{":    # llama3_json: a call is the whole output, from its first character
            head = self.seen.lstrip()
            if not head or "<|python_tag|>".startswith(head):
                return ""
            if head.startswith(("{", "<|python_tag|>")):
                self.held = True
                return ""
            self.marker = None
            out, self.pending = self.pending, ""
            return out
        at = self.pending.find(self.marker)
        if at >= 0:
            out = self.pending[:at].rstrip()
            self.pending, self.held = self.pending[len(out):], True
            return out
        keep = next((n for n in range(min(len(self.marker) - 1, len(self.pending)), 0, -1)
                     if self.marker.startswith(self.pending[-n:])), 0)
        # whitespace before a call is not content (find_calls drops it too): it waits for what follows
        out = self.pending[: len(self.pending) - keep].rstrip()
        self.pending = self.pending[len(out):]
        return out


class ForcedCalls:
    """Reads calls written in the exact form a forced tool choice's grammar gives them (hermes:
    `<tool_call>\\n{"name": "N", "arguments": {…}}\\n</tool_call>`, "\\n"-separated; llama3_json:
    `{"name": "N", "parameters": {…}}`, "; "-separated) as they arrive: a call's start once its
    name is complete, its arguments' text as it comes (a JSON scanner finds where the object
    ends), its end. Text in any other form stops it (no grammar would write it)."""

    def __init__(self, fmt: str):
        hermes = fmt == "hermes"
        self.open = '<tool_call>\n{"name": "' if hermes else '{"name": "'
        self.sep = "\n" if hermes else "; "
        self.mid = '", "arguments": ' if hermes else '", "parameters": '
        self.close = "}\n</tool_call>" if hermes else "}"
        self.at, self.state, self.index = 0, "open", -1
        self.depth, self.in_str, self.esc = 0, False, False

    def feed(self, text: str) -> list[tuple]:
        """Events for what `text` (all the output so far) adds."""
        events: list[tuple] = []
        while self.state != "broken":
            if self.state in ("open", "close"):
                want = ((self.sep if self.index >= 0 else "") + self.open) if self.state == "open" else self.close
                have = text[self.at:self.at + len(want)]
                if not want.startswith(have):
                    self.state = "broken"
                elif len(have) < len(want):
                    break
                else:
                    self.at += len(want)
                    if self.state == "close":
                        events.append(("end", self.index))
                    self.state = "name" if self.state == "open" else "open"
            elif self.state == "name":
                end = text.find(self.mid, self.at)
                if end < 0:
                    break
                self.index += 1
                events.append(("start", self.index, new_call_id(), text[self.at:end]))
                self.at, self.state = end + len(self.mid), "args"
                self.depth, self.in_str, self.esc = 0, False, False
            else:   # args: scan the object's characters
                i, done = self.at, False
                while i < len(text) and not done:
                    c = text[i]
                    i += 1
                    if self.in_str:
                        if self.esc:
                            self.esc = False
                        elif c == "\\":
                            self.esc = True
                        elif c == '"':
                            self.in_str = False
                    elif c == '"':
                        self.in_str = True
                    elif c in "{[":
                        self.depth += 1
                    elif c in "}]":
                        self.depth -= 1
                        done = self.depth == 0
                if i > self.at:
                    events.append(("args", self.index, text[self.at:i]))
                    self.at = i
                if not done:
                    break
                self.state = "close"
        return events
