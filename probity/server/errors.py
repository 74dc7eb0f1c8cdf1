"""Errors are values with names: one type, one closed list of codes, two envelopes."""
from __future__ import annotations

from starlette.responses import JSONResponse

# code -> (HTTP status, OpenAI error type, Anthropic error type). Documented in docs/api.md.
CODES: dict[str, tuple[int, str, str]] = {
    "invalid_json": (400, "invalid_request_error", "invalid_request_error"),
    "invalid_body": (400, "invalid_request_error", "invalid_request_error"),
    "unknown_parameter": (400, "invalid_request_error", "invalid_request_error"),
    "missing_required_parameter": (400, "invalid_request_error", "invalid_request_error"),
    "invalid_type": (400, "invalid_request_error", "invalid_request_error"),
    "invalid_value": (400, "invalid_request_error", "invalid_request_error"),
    "unsupported_parameter": (400, "invalid_request_error", "invalid_request_error"),
    "unsupported_value": (400, "invalid_request_error", "invalid_request_error"),
    "token_out_of_vocabulary": (400, "invalid_request_error", "invalid_request_error"),
    "context_length_exceeded": (400, "invalid_request_error", "invalid_request_error"),
    "prompt_batch_cap_exceeded": (400, "invalid_request_error", "invalid_request_error"),
    "prompt_batch_token_budget_exceeded": (400, "invalid_request_error", "invalid_request_error"),
    "batch_completion_budget_exceeded": (400, "invalid_request_error", "invalid_request_error"),
    "engine_capability_missing": (400, "invalid_request_error", "invalid_request_error"),
    "invalid_grammar": (400, "invalid_request_error", "invalid_request_error"),
    "grammar_too_large": (400, "invalid_request_error", "invalid_request_error"),
    "invalid_schema": (400, "invalid_request_error", "invalid_request_error"),
    "response_too_large": (400, "invalid_request_error", "invalid_request_error"),
    "storage_full": (400, "invalid_request_error", "invalid_request_error"),
    "invalid_api_key": (401, "authentication_error", "authentication_error"),
    "model_not_found": (404, "not_found_error", "not_found_error"),
    "not_found": (404, "not_found_error", "not_found_error"),
    "conflict": (409, "invalid_request_error", "invalid_request_error"),
    "method_not_allowed": (405, "invalid_request_error", "invalid_request_error"),
    "invalid_host": (400, "invalid_request_error", "invalid_request_error"),
    "invalid_http_request": (400, "invalid_request_error", "invalid_request_error"),
    "request_header_too_large": (431, "invalid_request_error", "invalid_request_error"),
    "request_timeout": (408, "invalid_request_error", "invalid_request_error"),
    "request_too_large": (413, "invalid_request_error", "request_too_large"),
    "unsupported_media_type": (415, "invalid_request_error", "invalid_request_error"),
    "queue_full": (429, "rate_limit_error", "rate_limit_error"),
    "queue_timeout": (429, "rate_limit_error", "rate_limit_error"),
    "engine_error": (500, "server_error", "api_error"),
    "internal_error": (500, "server_error", "api_error"),
    "engine_unavailable": (503, "server_error", "overloaded_error"),
    "engine_timeout": (503, "server_error", "overloaded_error"),
    "too_many_connections": (503, "server_error", "overloaded_error"),
}


def _text(s: str | None) -> str | None:
    """An error that quotes client input must still encode: lone surrogates become escapes."""
    return s if s is None or s.isascii() else s.encode("utf-8", "backslashreplace").decode("utf-8")


class APIError(Exception):
    def __init__(self, code: str, message: str, param: str | None = None,
                 headers: dict[str, str] | None = None, member: int | None = None):
        if code not in CODES:
            raise ValueError(f"undocumented error code {code}")
        message, param = _text(message), _text(param)
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param
        self.headers = headers or {}
        self.member = member  # the prompt-array member an engine refusal names (its param is then prompt[member])

    @property
    def status(self) -> int:
        return CODES[self.code][0]

    def openai_body(self) -> dict:
        return {"error": {"message": self.message, "type": CODES[self.code][1],
                          "param": self.param, "code": self.code}}

    def anthropic_body(self) -> dict:
        msg = f"{self.param}: {self.message}" if self.param else self.message
        return {"type": "error", "error": {"type": CODES[self.code][2], "message": msg}}

    def response(self, anthropic: bool = False) -> JSONResponse:
        body = self.anthropic_body() if anthropic else self.openai_body()
        return JSONResponse(body, status_code=self.status, headers=self.headers)
