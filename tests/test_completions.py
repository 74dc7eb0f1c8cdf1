"""/v1/completions against the real engine on the tiny model: the instrumentation contract."""
from __future__ import annotations

import concurrent.futures as cf
from uuid import uuid4

import pytest
import torch

from conftest import TINY_ID
from helpers import PROBE_WORK, add, cold, complete, engine_work, err, ok, reference_logprobs, sse_events


# ------------------------------------------------------------------ SDK and shapes

def test_openai_sdk_completion_and_stream(tiny_client):
    r = tiny_client.completions.create(model=TINY_ID, prompt="Hello", max_tokens=5, temperature=0)
    assert r.object == "text_completion" and r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens > 0 and r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    chunks = list(tiny_client.completions.create(model=TINY_ID, prompt="Hello", max_tokens=5, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text


def test_every_response_carries_request_id(tiny_server):
    r = complete(tiny_server, prompt="Hi", max_tokens=1)
    assert r.headers["x-request-id"]
    assert complete(tiny_server, prompt="Hi", max_tokens=1, bogus=1).headers["x-request-id"]
    assert tiny_server.get("/nope").headers["x-request-id"]


# ------------------------------------------------------------------ echo and logprobs

def test_echo_logprobs_match_transformers_in_process(tiny_server, tiny_hf):
    _, tok = tiny_hf
    prompt = "The quick brown fox jumps over the lazy dog. 5€ 😀"
    ids = tok(prompt)["input_ids"]
    body = ok(tiny_server, prompt=prompt, max_tokens=0, echo=True, logprobs=3)
    lp = body["choices"][0]["logprobs"]
    ref = reference_logprobs(tiny_hf, ids)
    assert len(lp["token_logprobs"]) == len(ids)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    for i in range(1, len(ids)):
        assert abs(lp["token_logprobs"][i] - ref[i - 1, ids[i]].item()) <= 1e-5
    assert body["choices"][0]["text"] == prompt


def test_lm_eval_shaped_request_matches_transformers(tiny_server, tiny_hf):
    _, tok = tiny_hf
    ctx = tok("Paris is the capital of")["input_ids"]
    cont = tok(" France.")["input_ids"]
    body = ok(tiny_server, prompt=[ctx + cont], echo=True, logprobs=1, max_tokens=1, temperature=0, seed=1234)
    ch = body["choices"][0]["logprobs"]
    ref = reference_logprobs(tiny_hf, ctx + cont)
    n = len(ctx) + len(cont)
    assert len(ch["tokens"]) == n + 1  # prompt positions, then the one generated token
    for i in range(len(ctx), n):
        assert abs(ch["token_logprobs"][i] - ref[i - 1, (ctx + cont)[i]].item()) <= 1e-5
        # lm-eval's greedy check: argmax of the table compared with the token, by label
        top = ch["top_logprobs"][i]
        assert ch["tokens"][i] in top and top[ch["tokens"][i]] == ch["token_logprobs"][i]
    greedy = int(torch.argmax(ref[n - 1]))
    assert ch["token_logprobs"][n] == pytest.approx(ref[n - 1, greedy].item(), abs=1e-5)


def test_top_table_has_k_plus_chosen_sorted_and_identical_floats(tiny_server):
    body = ok(tiny_server, prompt="Hello, world! Hello again", max_tokens=8, echo=True, logprobs=2, temperature=1.0, seed=3)
    lp = body["choices"][0]["logprobs"]
    for i in range(1, len(lp["tokens"])):
        table = lp["top_logprobs"][i]
        assert len(table) in (2, 3)
        values = list(table.values())
        assert values == sorted(values, reverse=True)
        assert table[lp["tokens"][i]] == lp["token_logprobs"][i]  # the identical float, not approx


def test_greedy_token_logprob_is_max_of_its_table(tiny_server):
    lp = ok(tiny_server, prompt="The quick", max_tokens=10, temperature=0, logprobs=5)["choices"][0]["logprobs"]
    for tok, v, table in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert v == max(table.values()) and table[tok] == v


def test_joined_tokens_equal_text_and_offsets_count_characters(tiny_server):
    prompt = "日本語 😀 café €"
    body = ok(tiny_server, prompt=prompt, max_tokens=12, echo=True, logprobs=1, temperature=1.0, seed=11)
    ch = body["choices"][0]
    lp = ch["logprobs"]
    assert "".join(lp["tokens"]) == ch["text"] and ch["text"].startswith(prompt)
    pos = 0
    for t, off in zip(lp["tokens"], lp["text_offset"]):
        assert off == pos
        pos += len(t)


def test_logprobs_zero_false_null_mean_no_logprobs(tiny_server):
    for v in (0, False, None):
        assert ok(tiny_server, prompt="Hi", max_tokens=2, logprobs=v)["choices"][0]["logprobs"] is None


@pytest.mark.parametrize("value,code", [(True, "invalid_type"), (1.5, "invalid_type"), ("2", "invalid_type"),
                                        (33, "invalid_value"), (-1, "invalid_value"), ([1], "invalid_type")])
def test_logprobs_invalid_values_are_named(tiny_server, value, code):
    e = err(tiny_server, prompt="Hi", logprobs=value)
    assert (e["param"], e["code"]) == ("logprobs", code)


@pytest.mark.parametrize("value", [1, "true", None, 0])
def test_echo_must_be_boolean(tiny_server, value):
    e = err(tiny_server, prompt="Hi", echo=value)
    assert e["param"] == "echo" and e["code"] == "invalid_type"


def test_max_tokens_zero_with_echo_returns_prompt_only(tiny_server):
    body = ok(tiny_server, prompt="Hello world", max_tokens=0, echo=True, logprobs=1)
    ch = body["choices"][0]
    assert ch["text"] == "Hello world" and body["usage"]["completion_tokens"] == 0
    assert len(ch["logprobs"]["tokens"]) == body["usage"]["prompt_tokens"]


def test_max_tokens_zero_without_echo_is_named(tiny_server):
    e = err(tiny_server, prompt="Hi", max_tokens=0)
    assert (e["param"], e["code"]) == ("max_tokens", "invalid_value")


def test_return_tokens_as_token_ids_labels(tiny_server):
    lp = ok(tiny_server, prompt="Hi", max_tokens=3, logprobs=2, temperature=0,
            return_tokens_as_token_ids=True)["choices"][0]["logprobs"]
    assert all(t.startswith("token_id:") for t in lp["tokens"])
    assert all(k.startswith("token_id:") for table in lp["top_logprobs"] for k in table)


# ------------------------------------------------------------------ streaming

def test_streamed_logprobs_equal_non_streamed(tiny_server):
    body = dict(prompt="Prices: 5€, naïve", max_tokens=10, echo=True, logprobs=2, temperature=0.8, seed=21)
    full = cold(tiny_server, **body)["choices"][0]
    r = complete(tiny_server, stream=True, stream_options={"include_usage": True}, cache_salt="stream-" + str(uuid4()),
                 **body)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert events[-1] == "[DONE]" and events[-2]["usage"]["completion_tokens"] >= 1
    assert events[-2]["usage"]["prompt_tokens_details"]["cached_tokens"] == 0   # computed, not the cache's copy
    chunks = [e for e in events[:-1] if e["choices"]]
    assert chunks[0]["choices"][0]["text"].startswith("Prices")  # the first chunk carries the prompt
    text = "".join(c["choices"][0]["text"] for c in chunks)
    tokens, lps, offsets, tops = [], [], [], []
    for c in chunks:
        lp = c["choices"][0]["logprobs"]
        if lp:
            tokens += lp["tokens"]; lps += lp["token_logprobs"]; offsets += lp["text_offset"]; tops += lp["top_logprobs"]
    assert text == full["text"]
    assert tokens == full["logprobs"]["tokens"] and lps == full["logprobs"]["token_logprobs"]
    assert offsets == full["logprobs"]["text_offset"] and tops == full["logprobs"]["top_logprobs"]
    assert chunks[-1]["choices"][0]["finish_reason"] == full["finish_reason"]


# ------------------------------------------------------------------ seed

def test_same_seed_same_tokens_and_logprobs_under_concurrent_noise(tiny_server):
    body = dict(prompt="Once upon", max_tokens=20, temperature=1.0, seed=42, logprobs=2)
    alone = cold(tiny_server, **body)["choices"][0]
    with cf.ThreadPoolExecutor(8) as pool:
        noise = [pool.submit(cold, tiny_server, prompt=f"noise {i}", max_tokens=15, temperature=1.0) for i in range(6)]
        again = [pool.submit(cold, tiny_server, **body) for _ in range(2)]
        results = [f.result()["choices"][0] for f in again]
        [f.result() for f in noise]
    for r in results:
        assert r["text"] == alone["text"] and r["logprobs"] == alone["logprobs"]


def test_seed_changes_nothing_but_sampling(tiny_server):
    common = dict(prompt="Once upon", max_tokens=8, temperature=0, logprobs=3, echo=True)
    assert cold(tiny_server, **common)["choices"] == cold(tiny_server, seed=99, **common)["choices"]


def test_different_seeds_sample_differently(tiny_server):
    texts = {ok(tiny_server, prompt="Once upon", max_tokens=20, temperature=1.0, seed=s)["choices"][0]["text"]
             for s in range(5)}
    assert len(texts) > 1


def test_system_fingerprint_names_model_and_dtype(tiny_server):
    fp = ok(tiny_server, prompt="Hi", max_tokens=1)["system_fingerprint"]
    assert fp.startswith("fp_") and "f32" in fp


# ------------------------------------------------------------------ prompts and batches

def test_token_id_prompt_equals_text_prompt(tiny_server, tiny_hf):
    _, tok = tiny_hf
    ids = tok("Hello world")["input_ids"]
    a = cold(tiny_server, prompt="Hello world", max_tokens=5, temperature=0, logprobs=1, echo=True)["choices"][0]
    b = cold(tiny_server, prompt=ids, max_tokens=5, temperature=0, logprobs=1, echo=True)["choices"][0]
    assert a == b


def test_single_member_array_equals_flat_prompt(tiny_server):
    flat = cold(tiny_server, prompt="Hello", max_tokens=5, temperature=0, logprobs=2, echo=True)
    arr = cold(tiny_server, prompt=["Hello"], max_tokens=5, temperature=0, logprobs=2, echo=True)
    assert flat["choices"] == arr["choices"] and flat["usage"] == arr["usage"]


def test_batch_members_equal_each_prompt_sent_alone(tiny_server):
    prompts = ["Hello", "The quick brown", "日本語", "Prices: 5€"]
    common = dict(max_tokens=6, temperature=0.9, seed=7, logprobs=2, echo=True, stop=["."])
    batch = cold(tiny_server, prompt=prompts, n=2, **common)
    assert [c["index"] for c in batch["choices"]] == list(range(8))
    total = 0
    for i, p in enumerate(prompts):
        alone = cold(tiny_server, prompt=p, n=2, **common)
        total += alone["usage"]["prompt_tokens"]
        for j in range(2):
            b, a = batch["choices"][i * 2 + j], alone["choices"][j]
            assert (b["text"], b["logprobs"], b["finish_reason"]) == (a["text"], a["logprobs"], a["finish_reason"])
    assert batch["usage"]["prompt_tokens"] == total


@pytest.mark.parametrize("prompt,param,code", [
    ([], "prompt", "invalid_value"),
    (["a", 1], "prompt[1]", "invalid_type"),
    ([[1, 2], "a"], "prompt[1]", "invalid_type"),
    ([[1, 2], []], "prompt[1]", "invalid_value"),
    ([[1, 2], [1, True]], "prompt[1]", "invalid_type"),
    ([[1, 2], [1, -1]], "prompt[1]", "token_out_of_vocabulary"),
    ([[1, 2], [1, 10**6]], "prompt[1]", "token_out_of_vocabulary"),
    ([1, 2.0], "prompt", "invalid_type"),
    ([True], "prompt[0]", "invalid_type"),
    (5, "prompt", "invalid_type"),
    ({"a": 1}, "prompt", "invalid_type"),
])
def test_malformed_prompt_members_are_named(tiny_server, prompt, param, code):
    e = err(tiny_server, prompt=prompt)
    assert (e["param"], e["code"]) == (param, code)


def test_batch_caps_and_budgets_are_named(tiny_server):
    e = err(tiny_server, prompt=["a"] * 129)
    assert (e["code"], e["param"]) == ("prompt_batch_cap_exceeded", "prompt")
    e = err(tiny_server, prompt=["a"] * 128, max_tokens=100, n=6)  # 76,800 > 65,536
    assert (e["code"], e["param"]) == ("batch_completion_budget_exceeded", "max_tokens")
    ok(tiny_server, prompt=["a"], max_tokens=200, n=16)  # a length-1 array is exempt from the budgets
    ok(tiny_server, prompt=[[5] * 250] * 128, max_tokens=1)  # 32,000 real tokens: within budget


def test_batch_prompt_token_budget_counts_real_tokens(tiny_model_dir):
    from conftest import LiveServer

    s = LiveServer(["--model", str(tiny_model_dir), "--batch-prompt-tokens", "20", "--threads", "1"])
    try:
        ok(s, prompt=["Hello", "Hello"], max_tokens=1)
        e = err(s, prompt=["Hello world " * 3, "Hello world " * 3], max_tokens=1)
        assert (e["code"], e["param"]) == ("prompt_batch_token_budget_exceeded", "prompt")
        e = err(s, prompt=[[5] * 15, [5] * 15], max_tokens=1)
        assert e["code"] == "prompt_batch_token_budget_exceeded"
        ok(s, prompt=[[5] * 60], max_tokens=1)  # a length-1 array is exempt
        before = engine_work(s)
        err(s, prompt=["Hello world " * 6, "x"], max_tokens=1)
        assert engine_work(s) == add(before, PROBE_WORK)  # the refused batch ran nothing
    finally:
        s.stop()


def test_batch_member_rejected_by_engine_is_named(tiny_server):
    e = err(tiny_server, prompt=["Hello", "Hello " * 300], max_tokens=4)
    assert (e["code"], e["param"]) == ("context_length_exceeded", "prompt[1]")


def test_rejected_batch_does_no_engine_work(tiny_server):
    before = engine_work(tiny_server)
    e = err(tiny_server, prompt=["Hello", "Hello " * 300], max_tokens=4)  # refused by the engine
    assert (e["code"], e["param"]) == ("context_length_exceeded", "prompt[1]")
    e = err(tiny_server, prompt=[[1, 2], [1, 10**6]], max_tokens=4)  # refused by the server
    assert (e["code"], e["param"]) == ("token_out_of_vocabulary", "prompt[1]")
    # between the two probes the engine ran exactly the second probe: nothing of member 0
    assert engine_work(tiny_server) == add(before, PROBE_WORK)


def test_engine_work_probe_sees_work(tiny_server):
    """The probe above can fail: a request that runs does show up in it."""
    before = engine_work(tiny_server)
    ok(tiny_server, prompt=[300, 301, 302], max_tokens=3, temperature=0)
    assert engine_work(tiny_server) == add(add(before, (3, 3)), PROBE_WORK)


def test_stream_on_batch_is_named(tiny_server):
    e = err(tiny_server, prompt=["a", "b"], stream=True)
    assert (e["param"], e["code"]) == ("stream", "unsupported_value")


def test_the_context_window_is_exact(tiny_server):
    """prompt + max_tokens == the window (256) is accepted; one more token is refused."""
    ctx = tiny_server.get("/v1/models").json()["data"][0]["max_model_len"]
    assert ctx == 256
    prompt = [5] * 250
    body = ok(tiny_server, prompt=prompt, max_tokens=ctx - 250, temperature=0)
    assert body["usage"]["prompt_tokens"] == 250
    e = err(tiny_server, prompt=prompt, max_tokens=ctx - 250 + 1)
    assert (e["code"], e["param"]) == ("context_length_exceeded", "prompt")
    msgs = [{"role": "user", "content": "Hello " * 40}]
    n = tiny_server.post("/tokenize", json={"messages": msgs}).json()["count"]
    r = tiny_server.post("/v1/chat/completions", json={"model": TINY_ID, "messages": msgs, "max_tokens": ctx - n,
                                                       "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == n
    r = tiny_server.post("/v1/chat/completions", json={"model": TINY_ID, "messages": msgs,
                                                       "max_tokens": ctx - n + 1})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


def test_context_length_exceeded_is_never_clamped(tiny_server):
    e = err(tiny_server, prompt="Hello", max_tokens=300)
    assert (e["code"], e["param"]) == ("context_length_exceeded", "prompt")


# ------------------------------------------------------------------ other fields

def test_group_score_refused_before_anything_else(tiny_server):
    e = err(tiny_server, prompt=12, logprobs=True, group_score=True, bogus=1)
    assert (e["code"], e["param"]) == ("unsupported_value", "group_score")
    for v in (None, False):
        ok(tiny_server, prompt="Hi", max_tokens=1, group_score=v)
    for v in (0, 0.0, 1, "", [], {}, "false"):  # 0 == False in Python: must still be refused
        e = err(tiny_server, prompt="Hi", max_tokens=1, group_score=v)
        assert (e["code"], e["param"]) == ("unsupported_value", "group_score")


def test_unknown_and_refused_fields_are_named(tiny_server):
    e = err(tiny_server, prompt="Hi", bogus=1)
    assert (e["code"], e["param"]) == ("unknown_parameter", "bogus")
    for f in ("best_of", "suffix"):
        e = err(tiny_server, prompt="Hi", **{f: 2 if f == "best_of" else "x"})
        assert (e["code"], e["param"]) == ("unsupported_parameter", f)


def test_user_is_a_documented_no_op(tiny_server):
    a = ok(tiny_server, prompt="Hi", max_tokens=4, temperature=0)["choices"][0]["text"]
    assert ok(tiny_server, prompt="Hi", max_tokens=4, temperature=0, user="alice")["choices"][0]["text"] == a


def test_stop_string_is_matched_and_not_returned(tiny_server):
    base = ok(tiny_server, prompt="Hello", max_tokens=30, temperature=0)["choices"][0]["text"]
    assert len(base) > 4
    i = next(i for i in range(2, len(base) - 1) if "\ufffd" not in base[i:i + 2])
    stop = base[i:i + 2]
    r = ok(tiny_server, prompt="Hello", max_tokens=30, temperature=0, stop=[stop], logprobs=1)["choices"][0]
    assert r["finish_reason"] == "stop" and r["text"] == base[: base.index(stop)]
    assert "".join(r["logprobs"]["tokens"]) == r["text"]


def test_model_must_be_the_served_one(tiny_server):
    e = err(tiny_server, status=404, prompt="Hi", model="gpt-4")
    assert (e["code"], e["param"]) == ("model_not_found", "model")


@pytest.mark.parametrize("field,value,param,code", [
    ("temperature", 2.5, "temperature", "invalid_value"), ("temperature", "hot", "temperature", "invalid_type"),
    ("top_p", 0, "top_p", "invalid_value"), ("top_p", 1.5, "top_p", "invalid_value"),
    ("n", 0, "n", "invalid_value"), ("n", 17, "n", "invalid_value"),
    ("stop", ["a"] * 33, "stop", "invalid_value"), ("stop", [""], "stop[0]", "invalid_value"),
    ("stop", [1], "stop[0]", "invalid_type"),
    ("presence_penalty", 3, "presence_penalty", "invalid_value"),
    ("frequency_penalty", -3, "frequency_penalty", "invalid_value"),
    ("logit_bias", {"abc": 1}, "logit_bias", "token_out_of_vocabulary"),
    ("logit_bias", {"1": 200}, "logit_bias.1", "invalid_value"),
    ("seed", 2**63, "seed", "invalid_value"), ("seed", 1.5, "seed", "invalid_type"),
    ("max_tokens", -1, "max_tokens", "invalid_value"), ("top_k", -2, "top_k", "invalid_value"),
    ("stream", "yes", "stream", "invalid_type"),
    ("cache_salt", "", "cache_salt", "invalid_value"), ("cache_salt", "s" * 1025, "cache_salt", "invalid_value"),
    ("cache_salt", 7, "cache_salt", "invalid_type"),
])
def test_out_of_range_fields_are_named(tiny_server, field, value, param, code):
    e = err(tiny_server, prompt="Hi", **{field: value})
    assert (e["param"], e["code"]) == (param, code)


def test_logit_bias_and_penalties_change_sampling_not_logprobs(tiny_server, tiny_hf):
    """A +100 bias makes a token far outside the top 32 the greedy choice; its reported value is
    the model's raw one -- the same float an echo of that position reports (no bias there), and
    transformers' value -- and the rest of its table is the unbiased table, float for float."""
    prompt = tiny_server.post("/tokenize", json={"model": TINY_ID, "prompt": "Hello"}).json()["tokens"]
    ref = reference_logprobs(tiny_hf, prompt)[-1]
    order = torch.argsort(ref, descending=True).tolist()
    t = order[40]                       # never in the unbiased top 32
    assert ref[order[0]] - ref[t] < 50  # so a +100 bias surely makes it the greedy pick
    label = f"token_id:{t}"
    common = dict(prompt=prompt, max_tokens=1, temperature=0, logprobs=32, return_tokens_as_token_ids=True)
    base = cold(tiny_server, **common)["choices"][0]["logprobs"]
    biased = cold(tiny_server, logit_bias={str(t): 100}, **common)["choices"][0]["logprobs"]
    assert label not in base["top_logprobs"][0] and biased["tokens"] == [label]
    raw = cold(tiny_server, prompt=prompt + [t], max_tokens=0, echo=True,
             logprobs=1)["choices"][0]["logprobs"]["token_logprobs"][-1]
    assert biased["token_logprobs"][0] == biased["top_logprobs"][0][label] == raw   # the identical float
    assert abs(raw - ref[t].item()) <= 1e-5
    assert {k: v for k, v in biased["top_logprobs"][0].items() if k != label} == base["top_logprobs"][0]
    pen = cold(tiny_server, prompt="Hello", max_tokens=12, temperature=0, frequency_penalty=2.0)["choices"][0]["text"]
    assert pen != cold(tiny_server, prompt="Hello", max_tokens=12, temperature=0)["choices"][0]["text"]


def test_empty_text_prompt_is_named(tiny_server):
    e = err(tiny_server, prompt="", max_tokens=1)
    assert (e["param"], e["code"]) == ("prompt", "invalid_value")


def test_reported_values_do_not_depend_on_temperature_or_top_p(tiny_server):
    common = dict(prompt="The quick brown fox", max_tokens=0, echo=True, logprobs=5)
    a = cold(tiny_server, temperature=0, **common)["choices"][0]["logprobs"]
    b = cold(tiny_server, temperature=1.9, top_p=0.3, top_k=3, presence_penalty=1.5, **common)["choices"][0]["logprobs"]
    assert a == b
    # and a sampled token's reported value and table are the raw ones: the same floats as when
    # echo scores that position (no temperature, top_p or penalty there)
    gen = cold(tiny_server, prompt="The quick", max_tokens=4, temperature=1.9, top_p=0.5, seed=4, logprobs=1,
             return_tokens_as_token_ids=True)["choices"][0]["logprobs"]
    gen_ids = [int(t.split(":")[1]) for t in gen["tokens"]]
    prompt_ids = tiny_server.post("/tokenize", json={"prompt": "The quick"}).json()["tokens"]
    scored = cold(tiny_server, prompt=prompt_ids + gen_ids, max_tokens=0, echo=True, logprobs=1,
                return_tokens_as_token_ids=True)["choices"][0]["logprobs"]
    n = len(prompt_ids)
    assert len(gen["tokens"]) == 4 and scored["tokens"][n:] == gen["tokens"]
    assert scored["token_logprobs"][n:] == gen["token_logprobs"]
    assert scored["top_logprobs"][n:] == gen["top_logprobs"]
