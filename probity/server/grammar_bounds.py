"""The bounds a request's grammar is held to before anything compiles it: counted on what the
client sent (a JSON schema, a choice list, a regex, a Lark or GBNF grammar), in time linear in
its size, so a grammar whose compiled form would be huge (`minItems: 10^9`, 100,000 choices)
is a named 400 `grammar_too_large` in milliseconds. Compiling (grammar_check.py) comes after,
in a worker with its own time and memory limits, for what these counts do not foresee.
Operators set each bound (`probity serve --grammar-max-*`); docs/api.md lists them."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from .errors import APIError

# The JSON-schema keywords whose value llguidance expands into that many grammar symbols.
REPEAT_KEYS = (("minItems", "maxItems"), ("minProperties", "maxProperties"))
# Keywords whose value is a subschema, a list of them, or a map of them.
_ONE = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames",
        "unevaluatedItems", "unevaluatedProperties", "additionalItems")
_LIST = ("anyOf", "oneOf", "allOf", "prefixItems")
_MAP = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")


@dataclass(frozen=True)
class Bounds:
    """Each a total over one grammar (docs/api.md, Grammar bounds)."""
    nodes: int = 10_000       # schema nodes; Lark/GBNF rules and alternatives; regex characters
    properties: int = 2_000   # object properties named in a schema
    choices: int = 10_000     # choice entries, enum entries
    repeat: int = 10_000      # minItems/maxItems/minProperties/maxProperties, {m,n} repetitions expanded
    depth: int = 32           # nesting: subschemas in subschemas, groups in groups


def too_large(param: str, what: str, n: int, bound: int, flag: str) -> APIError:
    return APIError("grammar_too_large", f"'{param}' is too large to compile: {what} {n:,}, above this "
                    f"server's bound of {bound:,} (--grammar-max-{flag})", param)


class _Count:
    def __init__(self, b: Bounds, param: str):
        self.b, self.param = b, param
        self.nodes = self.properties = self.choices = self.repeat = 0

    def add(self, attr: str, n: int, what: str) -> None:
        total = getattr(self, attr) + n
        setattr(self, attr, total)
        bound = getattr(self.b, attr)
        if total > bound:
            raise too_large(self.param, what, total, bound, attr)

    def depth(self, d: int, what: str) -> None:
        if d > self.b.depth:
            raise too_large(self.param, what, d, self.b.depth, "depth")

    # ------------------------------------------------------------ JSON schema
    def schema(self, s: Any, d: int = 1) -> None:
        if type(s) is not dict:
            return  # a boolean schema, or something llguidance itself refuses by name
        self.depth(d, "subschemas nested")
        self.add("nodes", 1, "schema nodes")
        for lo, hi in REPEAT_KEYS:  # llguidance writes max(lo, hi) copies of the item
            counts = [v for v in (s.get(lo), s.get(hi)) if type(v) in (int, float) and v > 0]
            if counts:
                self.add("repeat", int(min(max(counts), 1 << 62)),
                         f"items or properties repeated ({lo}/{hi}, in all)")
        for k in ("enum",):
            if type(s.get(k)) is list:
                self.add("choices", len(s[k]), "enum entries")
        if type(s.get("pattern")) is str:
            self.regex(s["pattern"], d)
        for k, v in s.items():
            if k in _ONE:
                self.schema(v, d + 1)
            elif k in _LIST and type(v) is list:
                for sub in v:
                    self.schema(sub, d + 1)
            elif k in _MAP and type(v) is dict:
                if k == "properties":
                    self.add("properties", len(v), "object properties")
                for sub in v.values():
                    self.schema(sub, d + 1)

    # ------------------------------------------------------------ regex, Lark, GBNF
    def regex(self, text: str, d: int = 0) -> None:
        """Regex syntax (Rust's, as llguidance reads it)."""
        self.add("nodes", len(text), "regex characters")
        self.scan(text, "regex", d)

    def lark(self, text: str) -> None:
        """Lark (llguidance's dialect) or GBNF: rules (`name:` or `name ::=` at a line's start)
        and alternatives count as nodes; quoted strings are atoms; a /regex/ and a `%json {...}`
        count as what they are."""
        rules = len(re.findall(r"(?m)^\s*[?!]?[A-Za-z_][\w.-]*\s*(?::|::=)", text))
        self.add("nodes", rules + text.count("|"), "rules and alternatives")
        self.scan(text, "gbnf" if "::=" in text else "lark", 0)

    def _json_at(self, text: str, i: int) -> int:
        """A Lark `%json {schema}` at i: the schema counted; returns the index past it."""
        m = re.compile(r"%json\s*").match(text, i)
        try:
            schema, end = json.JSONDecoder().raw_decode(text, m.end())
        except ValueError:
            return m.end()  # llguidance names the syntax error
        self.schema(schema)
        return end

    def scan(self, text: str, kind: str, d: int) -> int:
        """The size `text` expands to: the depth of its groups and what its {m,n} repetitions
        expand to (a group repeated n times counts n times its inside, so `(a{100}){100}` is
        10,000, counted against `repeat`). Returns the expanded size."""
        stack = [0]     # expanded size of each open group so far
        last = 0        # size of the atom just before a quantifier
        i, n = 0, len(text)
        opens = "([" if kind == "lark" else "("   # Lark's [x] is an optional group
        closes = ")]" if kind == "lark" else ")"
        while i < n:
            c = text[i]
            atom = 1
            if c == "\\":
                i += 2
            elif c == "[" and kind != "lark":  # a class is one atom, whatever it holds
                j = i + 1
                if j < n and text[j] == "^":
                    j += 1
                if j < n and text[j] == "]":
                    j += 1
                i = _past(text, j, "]")
            elif c in "\"'" and kind != "regex":   # a literal: one atom
                i = _past(text, i + 1, c)
            elif c == "/" and kind == "lark":
                if text.startswith("//", i):        # a comment to the line's end
                    j = text.find("\n", i)
                    i = n if j < 0 else j
                    continue
                j = _past(text, i + 1, "/")
                atom = self.scan(text[i + 1:j - 1], "regex", d + len(stack) - 1)
                i = j
            elif c == "%" and kind == "lark" and text.startswith("%json", i):
                i = self._json_at(text, i)
            elif c in opens:
                stack.append(0)
                self.depth(d + len(stack) - 1, "groups nested")
                i += 1
                continue
            elif c in closes and len(stack) > 1:
                last = stack.pop()
                stack[-1] += last
                i += 1
                continue
            elif c == "{" and (m := re.compile(r"\{\s*(\d*)\s*(,?)\s*(\d*)\s*\}").match(text, i)) \
                    and (m.group(1) or m.group(3)):
                lo = int(m.group(1) or 0)
                hi = int(m.group(3)) if m.group(3) else (lo + 1 if m.group(2) else lo)
                extra = last * (max(lo, hi, 1) - 1)
                self.add("repeat", extra, "{m,n} repetitions expanding to")
                stack[-1] += extra
                last += extra
                i = m.end()
                continue
            else:
                i += 1
            stack[-1] += atom
            last = atom
        return sum(stack)


def check_schema(schema: Any, param: str, b: Bounds) -> None:
    _Count(b, param).schema(schema)


def check_choices(choices: list, param: str, b: Bounds) -> None:
    if len(choices) > b.choices:
        raise too_large(param, "choices", len(choices), b.choices, "choices")


def check_regex(text: str, param: str, b: Bounds) -> None:
    _Count(b, param).regex(text)


def check_lark(text: str, param: str, b: Bounds) -> None:
    _Count(b, param).lark(text)


def _past(text: str, j: int, end: str) -> int:
    """The index just past the first unescaped `end` at or after j (len(text) + 1 if none)."""
    while j < len(text) and text[j] != end:
        j += 2 if text[j] == "\\" else 1
    return j + 1
