"""What the running engine declared it can do (its READY), and the named refusal, before any
SUBMIT, of a request that asks for more."""
from __future__ import annotations

from .errors import APIError


def check_capabilities(info: dict, *, logprobs: int | None = None, echo: bool = False, ids: bool = False,
                       seed: bool = False, chat: bool = False, members: int = 1, choices: int = 1,
                       grammar: bool = False, distribution: bool = False, score_tokens: bool = False) -> None:
    caps = info["capabilities"]

    def missing(param: str, what: str) -> APIError:
        return APIError("engine_capability_missing", f"the running engine does not support {what}", param)

    if logprobs is not None and (not caps["logprobs"] or logprobs > caps["max_logprobs"]):
        raise missing("logprobs", f"logprobs={logprobs} (max {caps['max_logprobs'] if caps['logprobs'] else 'none'})")
    if echo and not caps["echo"]:
        raise missing("echo", "echo")
    if ids and not caps["token_ids"]:
        raise missing("prompt", "token-id prompts")
    if seed and not caps["seed"]:
        raise missing("seed", "seeded sampling")
    if chat and not caps["chat_template"]:
        raise missing("messages", "chat (the model has no chat template)")
    if grammar and not caps.get("grammar", False):
        raise missing("response_format", "constrained decoding (response_format, structured_outputs, forced tools)")
    if distribution and not caps.get("distribution", False):
        raise missing("distribution", "whole distributions (distribution: true)")
    if score_tokens and not caps.get("score_tokens", False):
        raise missing("score_tokens", "score_tokens")
    if members > caps["max_members"]:
        raise missing("prompt", f"batches of more than {caps['max_members']} members")
    if choices > caps["max_choices"]:
        raise missing("n", f"n above {caps['max_choices']}")
