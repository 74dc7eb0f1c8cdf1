"""Structured outputs on the server's side: what a request asks for (a JSON schema, a regex, a
choice list, a grammar; tools.py adds the calls a tool choice forces) compiled into
llguidance's grammar text and checked before any engine work. The engine applies the grammar
(engine/grammar.py); docs/api.md says what each field does."""
from __future__ import annotations

import json
import re
from typing import Any

import llguidance

from ..protocol import grammar_reason
from .errors import APIError
from .fields import check_keys, object_field, string_field
from .grammar_bounds import check_choices, check_lark, check_regex, check_schema
from .grammar_check import OK, TOO_LARGE, GrammarCheck

# JSON is written as Python's json.dumps writes it ({"a": 1, "b": [2, 3]}): no free whitespace,
# so a model cannot pad an answer forever; a schema's own "x-guidance" key overrides this.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# llguidance's JSON options (a schema's "x-guidance") and the type each takes
X_GUIDANCE = {"item_separator": str, "key_separator": str, "whitespace_flexible": bool,
              "whitespace_pattern": (str, type(None)), "coerce_one_of": bool, "lenient": bool,
              "json_allowed_escapes": str}
DEFAULT_CHECK = GrammarCheck()   # where a caller names none (tests of the validators)


def check(grammar: str, param: str, gc: GrammarCheck) -> str:
    """The grammar, or a named 400 at `param`: `invalid_grammar` if llguidance cannot compile it
    or it admits no output, `grammar_too_large` if compiling it ran past the worker's limits.
    Blocks while the worker compiles: call it off the event loop (the endpoints parse in a
    thread)."""
    v = gc.verify(grammar)
    if v.kind == TOO_LARGE:
        raise APIError("grammar_too_large", f"'{param}' is too large to compile: {v.reason}", param)
    if v.kind != OK:
        raise APIError("invalid_grammar", f"'{param}' cannot be compiled: {v.reason}", param)
    return grammar


def json_grammar(schema: Any, param: str, gc: GrammarCheck, verify: bool = True) -> str:
    """A JSON schema's grammar, its bounds counted first; `verify` compiles it in the worker."""
    if type(schema) is bool:
        schema = {} if schema else {"not": {}}
    if type(schema) is not dict:
        raise APIError("invalid_type", f"'{param}' must be a JSON schema object", param)
    _check_x_guidance(schema, param)
    check_schema(schema, param, gc.bounds)
    try:
        g = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_STYLE)
    except (ValueError, TypeError) as e:
        raise APIError("invalid_grammar", f"'{param}' is not a usable JSON schema: {grammar_reason(str(e))}",
                       param) from None
    return check(g, param, gc) if verify else g


def _check_x_guidance(schema: dict, param: str) -> None:
    xg = schema.get("x-guidance")
    if xg is None:
        return
    where = f"{param}.x-guidance"
    if type(xg) is not dict:
        raise APIError("invalid_type", f"'{where}' must be an object of llguidance's JSON options", where)
    for k, v in xg.items():
        if k not in X_GUIDANCE:
            raise APIError("unknown_parameter", f"unknown parameter '{where}.{k}' (llguidance's JSON options are "
                           f"{', '.join(X_GUIDANCE)})", f"{where}.{k}")
        if not isinstance(v, X_GUIDANCE[k]) or (X_GUIDANCE[k] is not bool and type(v) is bool):
            raise APIError("invalid_type", f"'{where}.{k}' has the wrong type", f"{where}.{k}")


def strict_problems(schema: Any, where: str = "schema") -> str | None:
    """OpenAI's strict mode: every object lists all its properties as required and sets
    additionalProperties to false. The first place that does not, or None."""
    if type(schema) is dict:
        if schema.get("type") == "object" or "properties" in schema:
            props = schema.get("properties", {})
            if schema.get("additionalProperties") is not False:
                return f"{where}: additionalProperties must be false in strict mode"
            if type(props) is dict and set(schema.get("required", [])) != set(props):
                return f"{where}: every property must be required in strict mode"
        for k, v in schema.items():
            if k in ("properties", "$defs", "definitions") and type(v) is dict:
                for name, sub in v.items():
                    p = strict_problems(sub, f"{where}.{k}.{name}")
                    if p:
                        return p
            elif k in ("items", "additionalProperties", "not"):
                p = strict_problems(v, f"{where}.{k}")
                if p:
                    return p
            elif k in ("anyOf", "oneOf", "allOf", "prefixItems") and type(v) is list:
                for i, sub in enumerate(v):
                    p = strict_problems(sub, f"{where}.{k}[{i}]")
                    if p:
                        return p
    return None


def check_name(v: Any, param: str) -> str:
    """A name OpenAI allows (a json_schema's, a function's): 1-64 of a-z, A-Z, 0-9, _ and -."""
    name = string_field(v, param)
    if not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", name):
        raise APIError("invalid_value", f"'{param}' must be 1-64 of a-z, A-Z, 0-9, _ and -", param)
    return name


def response_format(rf: Any, gc: GrammarCheck = DEFAULT_CHECK) -> tuple[str, str] | None:
    """OpenAI's response_format: text (nothing), json_object or json_schema -> (grammar text,
    the field it came from)."""
    if rf is None:
        return None
    rf = object_field(rf, "response_format")
    t = rf.get("type")
    if t is None:
        raise APIError("missing_required_parameter", "'response_format.type' is required", "response_format.type")
    if t == "text":
        check_keys(rf, ("type",), where="response_format")
        return None
    if t == "json_object":
        check_keys(rf, ("type",), where="response_format")
        return json_grammar({"type": "object"}, "response_format", gc), "response_format"
    if t == "json_schema":
        check_keys(rf, ("type", "json_schema"), where="response_format")
        js = object_field(rf.get("json_schema"), "response_format.json_schema")
        check_keys(js, ("name", "description", "schema", "strict"), where="response_format.json_schema")
        check_name(js.get("name"), "response_format.json_schema.name")
        if js.get("description") is not None:
            string_field(js["description"], "response_format.json_schema.description", allow_empty=True)
        strict = js.get("strict")
        if strict is not None and type(strict) is not bool:
            raise APIError("invalid_type", "'response_format.json_schema.strict' must be a boolean",
                           "response_format.json_schema.strict")
        schema = js.get("schema", {})
        if strict:
            problem = strict_problems(schema)
            if problem:
                raise APIError("invalid_schema", f"'response_format.json_schema.schema' {problem}",
                               "response_format.json_schema.schema")
        param = "response_format.json_schema.schema"
        return json_grammar(schema, param, gc), param
    if type(t) is not str:
        raise APIError("invalid_type", "'response_format.type' must be a string", "response_format.type")
    raise APIError("unsupported_value", f"response_format type {t!r} is not supported; text, json_object and "
                   "json_schema are", "response_format.type")


def structured_outputs(so: Any, gc: GrammarCheck = DEFAULT_CHECK) -> tuple[str, str] | None:
    """vLLM's `structured_outputs` extension: exactly one of json, regex, choice, grammar,
    json_object -> (grammar text, the field it came from)."""
    if so is None:
        return None
    so = object_field(so, "structured_outputs")
    check_keys(so, ("json", "regex", "choice", "grammar", "json_object"), where="structured_outputs")
    given = [k for k in so if so[k] is not None and so[k] is not False]
    if len(given) != 1:
        raise APIError("invalid_value", "'structured_outputs' takes exactly one of json, regex, choice, grammar, "
                       "json_object", "structured_outputs")
    param = f"structured_outputs.{given[0]}"
    return _structured(given[0], so[given[0]], param, gc), param


def _structured(k: str, v: Any, param: str, gc: GrammarCheck) -> str:
    if k == "json":
        if type(v) is str:
            try:
                v = json.loads(v)
            except ValueError as e:
                raise APIError("invalid_grammar", f"'{param}' is not JSON: {e}", param) from None
        return json_grammar(v, param, gc)
    if k == "json_object":
        if v is not True:
            raise APIError("invalid_type", f"'{param}' must be true", param)
        return json_grammar({"type": "object"}, param, gc)
    if k == "regex":
        check_regex(string_field(v, param), param, gc.bounds)
        return check(llguidance.LLMatcher.grammar_from_regex(v), param, gc)
    if k == "choice":
        if type(v) is not list or not v or any(type(c) is not str or not c for c in v):
            raise APIError("invalid_type", f"'{param}' must be a non-empty array of non-empty strings", param)
        check_choices(v, param, gc.bounds)
        return check(llguidance.grammar_from("choice", v), param, gc)
    check_lark(string_field(v, param), param, gc.bounds)
    try:  # grammar: Lark (llguidance's dialect) or GBNF
        g = llguidance.grammar_from("grammar", v)
    except ValueError as e:
        raise APIError("invalid_grammar", f"'{param}' cannot be compiled: {grammar_reason(str(e))}", param) from None
    return check(g, param, gc)
