"""vLLM-shaped tokenizer endpoints, so lm-eval's tokenizer_backend=auto needs no local tokenizer."""
from __future__ import annotations

from .errors import APIError
from .fields import bad_type, boolean, check_keys, model_field, token_ids
from .generation import Source, run_op
from .validation import parse_messages


TOKENIZE_FIELDS = {"model", "prompt", "messages", "add_special_tokens", "add_generation_prompt"}
DETOKENIZE_FIELDS = {"model", "tokens"}


async def tokenize(svc, request, body: dict) -> dict:
    info = svc.ready_info()
    check_keys(body, TOKENIZE_FIELDS, {})
    if body.get("model") is not None:  # optional here, but a string that names the served model
        model_field(body, info["model"]["id"])
    has_prompt, has_messages = body.get("prompt") is not None, body.get("messages") is not None
    if has_prompt and has_messages:
        raise APIError("invalid_value", "give exactly one of 'prompt' or 'messages', not both", "prompt")
    if not has_prompt and not has_messages:
        raise APIError("missing_required_parameter", "give exactly one of 'prompt' or 'messages'", "prompt")
    generation_prompt = boolean(body, "add_generation_prompt", True)
    if has_prompt:
        if type(body["prompt"]) is not str:
            raise bad_type("prompt", "a string")
        if body.get("add_generation_prompt") is not None:
            raise APIError("invalid_value", "'add_generation_prompt' applies to 'messages' only",
                           "add_generation_prompt")
        member = {"text": body["prompt"]}
        add_special = boolean(body, "add_special_tokens", True)
    else:
        if not generation_prompt:
            raise APIError("unsupported_value", "only add_generation_prompt: true is supported", "add_generation_prompt")
        member = {"messages": parse_messages(body["messages"])}
        add_special = boolean(body, "add_special_tokens", False)
        if add_special:
            raise APIError("unsupported_value", "a rendered chat template already holds its special tokens",
                           "add_special_tokens")
    result = await run_op(svc, request, {"op": "tokenize", "members": [member], "add_special_tokens": add_special},
                          Source("prompt" if has_prompt else "messages"))
    return {"tokens": result["ids"], "count": result["count"], "max_model_len": info["model"]["context_length"]}


async def detokenize(svc, request, body: dict) -> dict:
    info = svc.ready_info()
    check_keys(body, DETOKENIZE_FIELDS, {})
    if body.get("model") is not None:
        model_field(body, info["model"]["id"])
    tokens = body.get("tokens")
    if tokens is None:
        raise APIError("missing_required_parameter", "'tokens' is required", "tokens")
    if type(tokens) is not list:
        raise bad_type("tokens", "an array of token ids")
    token_ids(tokens, "tokens", info["model"]["vocab_size"])
    result = await run_op(svc, request, {"op": "detokenize", "ids": tokens}, Source("tokens"))
    return {"prompt": result["text"]}


def tokenizer_info(svc) -> dict:
    m = svc.ready_info()["model"]
    return {"tokenizer_class": "PreTrainedTokenizerFast", "model": m["id"], "vocab_size": m["vocab_size"],
            "max_model_len": m["context_length"], "bos_token": m["bos_token"], "eos_token": m["eos_token"],
            "pad_token": m["pad_token"],
            "eos_token_ids": m["eos_token_ids"], "chat_template": m["chat_template"]}
