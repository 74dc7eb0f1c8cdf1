"""How a request body's fields are read: each helper checks one field's JSON type and range and
names the field in its error (APIError's codes, docs/api.md). One module, imported by every
route that reads a body: completions and chat (validation.py), Anthropic's messages, the
tokenizer routes, structured outputs and tools."""
from __future__ import annotations

from typing import Any

from .. import protocol as P
from .errors import APIError


def is_int(v: Any) -> bool:
    return type(v) is int


def is_num(v: Any) -> bool:
    # No isfinite(): it overflows (a 500) on a JSON integer beyond float range. JSON has no
    # NaN or Infinity (read_json refuses them), so the range checks that follow compare
    # exactly, 400-digit integers and the inf that 1e400 parses to included.
    return type(v) in (int, float)


def bad_type(param: str, what: str) -> APIError:
    return APIError("invalid_type", f"'{param}' must be {what}", param)


def bad_value(param: str, what: str) -> APIError:
    return APIError("invalid_value", f"'{param}' must be {what}", param)


def missing_field(param: str) -> APIError:
    return APIError("missing_required_parameter", f"'{param}' is required", param)


def check_keys(body: dict, allowed, refused: dict[str, str] | None = None, where: str = "") -> None:
    """unknown_parameter for a key not in `allowed`; unsupported_parameter (with its reason) for a
    key in `refused` that is not null. `where` names a nested object (`response_format`), whose
    keys are then named `where.key`."""
    for k in body:
        name = f"{where}.{k}" if where else k
        if refused and k in refused:
            if body[k] is not None:
                raise APIError("unsupported_parameter", f"'{name}' is not supported: {refused[k]}", name)
        elif k not in allowed:
            raise APIError("unknown_parameter", f"unknown parameter '{name}'", name)


def number(body: dict, key: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
    v = body.get(key)
    if v is None:
        return default
    if not is_num(v) or type(v) is bool:
        raise bad_type(key, "a number")
    if v < lo or v > hi or (lo_open and v == lo):
        raise bad_value(key, f"in {'(' if lo_open else '['}{lo}, {hi}]")
    return float(v)


def integer(body: dict, key: str, default: int | None, lo: int, hi: int) -> int | None:
    v = body.get(key)
    if v is None:
        return default
    if not is_int(v):
        raise bad_type(key, "an integer")
    if not lo <= v <= hi:
        raise bad_value(key, f"an integer in [{lo}, {hi}]")
    return v


def boolean(body: dict, key: str, default: bool, nullable: bool = True, where: str = "") -> bool:
    """`where` prefixes the param of a nested field (`stream_options.`)."""
    v = body.get(key, default)
    if v is None and nullable:
        return default
    if type(v) is not bool:
        raise bad_type(where + key, "a boolean")
    return v


def model_field(body: dict, served: str) -> str:
    v = body.get("model")
    if v is None:
        raise APIError("missing_required_parameter", "'model' is required", "model")
    if type(v) is not str:
        raise bad_type("model", "a string")
    if v != served:
        raise APIError("model_not_found", f"model '{v}' is not served here; this server serves '{served}'", "model")
    return v


def stop_field(body: dict, key: str = "stop") -> list[str]:
    v = body.get(key)
    if v is None:
        return []
    if type(v) is str:
        if not v:
            raise bad_value(key, "a non-empty string")
        if len(v) > P.MAX_STOP_CHARS:
            raise bad_value(key, f"at most {P.MAX_STOP_CHARS} characters")
        return [v]
    if type(v) is not list:
        raise bad_type(key, "a string or an array of strings")
    if len(v) > P.MAX_STOPS:
        raise bad_value(key, f"at most {P.MAX_STOPS} strings")
    for i, s in enumerate(v):
        if type(s) is not str:
            raise bad_type(f"{key}[{i}]", "a string")
        if not s:
            raise bad_value(f"{key}[{i}]", "a non-empty string")
        if len(s) > P.MAX_STOP_CHARS:
            raise bad_value(f"{key}[{i}]", f"at most {P.MAX_STOP_CHARS} characters")
    return list(v)


def token_ids(v: list, param: str, vocab_size: int) -> list[int]:
    for j, t in enumerate(v):
        if type(t) is not int:
            raise bad_type(param, "an array of integer token ids")
        if not 0 <= t < vocab_size:
            raise APIError("token_out_of_vocabulary", f"token id {t} at {param}[{j}] is outside [0, {vocab_size})", param)
    return list(v)


def object_field(v: Any, param: str) -> dict:
    if type(v) is not dict:
        raise APIError("invalid_type", f"'{param}' must be an object", param)
    return v


def string_field(v: Any, param: str, allow_empty: bool = False) -> str:
    if type(v) is not str:
        raise APIError("invalid_type" if v is not None else "missing_required_parameter",
                       f"'{param}' must be a string" if v is not None else f"'{param}' is required", param)
    if not v and not allow_empty:
        raise APIError("invalid_value", f"'{param}' must be a non-empty string", param)
    return v
