"""A generated EOS has its logprobs entry, like every generated token, and is not part of the text.

lm-evaluation-harness scores with `echo` + `max_tokens: 1` and drops the last entry as "the
generated token": if EOS had no entry, the last continuation token would be dropped instead.
The tiny model rarely picks EOS on its own, so `logit_bias` forces it; reported values are
raw (before bias), so the EOS entry's value is the model's own and is checked against
transformers in-process."""
from __future__ import annotations

import json
import time

import pytest

from conftest import TINY_ID
from helpers import cold, ok, reference_logprobs

EOS = "<|im_end|>"


@pytest.fixture(scope="module")
def eos_id(tiny_hf):
    return tiny_hf[1].convert_tokens_to_ids(EOS)


def forced_eos(eos_id, **body) -> dict:
    """EOS after `after` sampled-greedy tokens is hard to force; a +100 bias makes it the first."""
    return {"model": TINY_ID, "temperature": 0, "logit_bias": {str(eos_id): 100}, **body}


def test_completion_reports_eos_as_last_entry_outside_the_text(tiny_server, tiny_hf, eos_id):
    _, tok = tiny_hf
    prompt = "Paris is the capital of"
    r = ok(tiny_server, **forced_eos(eos_id, prompt=prompt, max_tokens=4, echo=True, logprobs=3))
    c = r["choices"][0]
    lp = c["logprobs"]
    assert c["finish_reason"] == "stop" and c["text"] == prompt
    assert lp["tokens"][-1] == EOS
    assert "".join(lp["tokens"][:-1]) == c["text"]      # the one exception is the EOS entry
    assert lp["text_offset"][-1] == len(c["text"])
    ids = tok(prompt)["input_ids"]
    ref = reference_logprobs(tiny_hf, ids)[-1]
    assert abs(lp["token_logprobs"][-1] - ref[eos_id].item()) < 1e-5
    top = lp["top_logprobs"][-1]
    assert top[EOS] == lp["token_logprobs"][-1]           # identical float in its table
    assert list(top.values()) == sorted(top.values(), reverse=True)
    assert len(top) in (3, 4)
    assert r["usage"]["completion_tokens"] == 1


def test_lm_eval_shaped_request_keeps_every_continuation_token(tiny_server, tiny_hf, eos_id):
    """What lm-eval computes: sum(token_logprobs[ctxlen:-1]) over echo + max_tokens 1."""
    _, tok = tiny_hf
    ctx, cont = tok("Question: capital of France?\nAnswer:")["input_ids"], tok(" Paris")["input_ids"]
    r = ok(tiny_server, **forced_eos(eos_id, prompt=ctx + cont, max_tokens=1, echo=True, logprobs=1))
    lps = r["choices"][0]["logprobs"]["token_logprobs"]
    assert len(lps) == len(ctx) + len(cont) + 1
    ref = reference_logprobs(tiny_hf, ctx + cont)
    want = sum(ref[i - 1, t].item() for i, t in enumerate(ctx + cont) if i >= len(ctx))
    assert abs(sum(lps[len(ctx):-1]) - want) < 1e-4


def test_streamed_eos_entry_equals_non_streamed(tiny_server, eos_id):
    body = forced_eos(eos_id, prompt="Hello there", max_tokens=3, logprobs=2, echo=True)
    plain = cold(tiny_server, **body)["choices"][0]
    r = tiny_server.post("/v1/completions", json={**body, "stream": True, "cache_salt": f"eos-stream-{time.time_ns()}",
                                                  "stream_options": {"include_usage": True}})
    usage = [json.loads(line[6:])["usage"] for line in r.text.splitlines() if line.startswith('data: {"') and '"usage":{' in line]
    assert usage[-1]["prompt_tokens_details"]["cached_tokens"] == 0   # computed, not the cache's copy
    tokens, values, offsets, text = [], [], [], ""
    for line in r.text.splitlines():
        if line.startswith("data: {"):
            ch = json.loads(line[6:])["choices"]
            if ch:
                text += ch[0]["text"]
                if ch[0]["logprobs"]:
                    tokens += ch[0]["logprobs"]["tokens"]
                    values += ch[0]["logprobs"]["token_logprobs"]
                    offsets += ch[0]["logprobs"]["text_offset"]
    assert text == plain["text"]
    assert tokens == plain["logprobs"]["tokens"] and tokens[-1] == EOS
    assert values == plain["logprobs"]["token_logprobs"]
    assert offsets == plain["logprobs"]["text_offset"]


def test_eos_entry_in_arrays_and_n_choices(tiny_server, eos_id):
    r = ok(tiny_server, **forced_eos(eos_id, prompt=["One", "Two words"], max_tokens=2, logprobs=1, n=2))
    assert len(r["choices"]) == 4
    for c in r["choices"]:
        assert c["logprobs"]["tokens"] == [EOS] and c["text"] == ""
        assert c["logprobs"]["text_offset"] == [0]
        assert c["finish_reason"] == "stop"
    assert r["usage"]["completion_tokens"] == 4


def test_chat_reports_eos_entry_with_special_bytes_not_in_content(tiny_server, eos_id):
    body = {"model": TINY_ID, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3,
            "temperature": 0, "logit_bias": {str(eos_id): 100}, "logprobs": True, "top_logprobs": 2}
    r = tiny_server.post("/v1/chat/completions", json=body).json()
    c = r["choices"][0]
    assert c["message"]["content"] == "" and c["finish_reason"] == "stop"
    entries = c["logprobs"]["content"]
    assert [e["token"] for e in entries] == [EOS]
    assert entries[0]["bytes"] == list(EOS.encode())
    assert entries[0]["top_logprobs"][0]["logprob"] >= entries[0]["logprob"]
    assert r["usage"]["completion_tokens"] == 1


def test_raw_eos_value_does_not_depend_on_the_bias(tiny_server, tiny_hf, eos_id):
    """The value reported for a bias-forced EOS is the model's raw one whether or not EOS is in
    the unbiased top 32 (after this prompt it is far outside it): the same float as an echo of
    that position reports (no bias there), transformers' value, and the forced table is the
    unbiased table plus EOS, float for float."""
    ids = tiny_server.post("/tokenize", json={"model": TINY_ID, "prompt": "Numbers 0 1 2"}).json()["tokens"]
    base = {"model": TINY_ID, "prompt": ids, "max_tokens": 1, "temperature": 0, "logprobs": 32,
            "return_tokens_as_token_ids": True}   # id labels: no two entries collapse into one key
    free = cold(tiny_server, **base)["choices"][0]["logprobs"]
    forced = cold(tiny_server, **base, logit_bias={str(eos_id): 100})["choices"][0]["logprobs"]
    label = f"token_id:{eos_id}"
    assert forced["tokens"] == [label]
    raw = cold(tiny_server, model=TINY_ID, prompt=ids + [eos_id], max_tokens=0, echo=True,
             logprobs=1)["choices"][0]["logprobs"]["token_logprobs"][-1]
    assert forced["token_logprobs"][0] == forced["top_logprobs"][0][label] == raw
    assert abs(raw - reference_logprobs(tiny_hf, ids)[-1, eos_id].item()) < 1e-5
    free_t, forced_t = free["top_logprobs"][0], forced["top_logprobs"][0]
    assert len(free_t) == 32 and len(forced_t) == 32 + (label not in free_t)
    assert {k: v for k, v in forced_t.items() if k != label} == {k: v for k, v in free_t.items() if k != label}
    if label in free_t:
        assert free_t[label] == raw
