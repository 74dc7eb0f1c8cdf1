"""Requests one client could send to crash, stall or mislead the engine (the second hostile
sweep): each is answered or refused by name, and the engine keeps running, unrestarted."""
from __future__ import annotations

import concurrent.futures as cf
import os
import signal

import httpx

import pytest

from conftest import TINY_ID, tiny_args
from helpers import assert_named, nothing_in_flight

HASHES = 45855  # the default model's token of 80 '#'


def health_engine(server) -> dict:
    return server.get("/health").json()["engine"]


def unrestarted(server, before: dict) -> None:
    after = health_engine(server)
    assert (after["pid"], after["restarts"]) == (before["pid"], before["restarts"]), after
    nothing_in_flight(server)


def test_tokenize_beyond_the_result_bound_is_refused_by_name_and_kills_nothing(tiny_server):
    before = health_engine(tiny_server)
    text = "1" * 2_200_000  # the tiny tokenizer keeps every digit a token: 2.2M ids, over 2^21
    with cf.ThreadPoolExecutor(1) as pool:
        beside = pool.submit(tiny_server.post, "/v1/completions",
                             json={"model": TINY_ID, "prompt": "Hello", "max_tokens": 40, "temperature": 0})
        r = tiny_server.post("/tokenize", json={"prompt": text})
        assert_named(r, False, 400, "response_too_large", "prompt")
        assert "2200000 tokens" in r.json()["error"]["message"]
        assert beside.result().status_code == 200  # an unrelated request in flight is untouched
    unrestarted(tiny_server, before)


def test_count_tokens_counts_a_text_whose_ids_would_not_fit(tiny_server):
    before = health_engine(tiny_server)
    text = "1" * 2_200_000
    msgs = [{"role": "user", "content": text}]
    r = tiny_server.post("/v1/messages/count_tokens", json={"model": TINY_ID, "messages": msgs})
    assert r.status_code == 200, r.text
    small = tiny_server.post("/v1/messages/count_tokens", json={"model": TINY_ID, "messages": [
        {"role": "user", "content": "1"}]}).json()["input_tokens"]
    assert r.json()["input_tokens"] == small + len(text) - 1
    unrestarted(tiny_server, before)


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"model": TINY_ID, "prompt": "Hi", "stop": "#" * 4097}, "stop"),
    ("/v1/completions", {"model": TINY_ID, "prompt": "Hi", "stop": ["a", "#" * 4097]}, "stop[1]"),
    ("/v1/chat/completions", {"model": TINY_ID, "messages": [{"role": "user", "content": "Hi"}],
                              "stop": ["#" * 4097]}, "stop[0]"),
    ("/v1/messages", {"model": TINY_ID, "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}],
                      "stop_sequences": ["#" * 4097]}, "stop_sequences[0]"),
])
def test_stop_strings_beyond_4096_characters_are_named(tiny_server, path, body, param):
    r = tiny_server.post(path, json=body)
    assert_named(r, path == "/v1/messages", 400, "invalid_value", param)


@pytest.mark.default_model
def test_a_matched_stop_string_of_4096_characters_is_named_in_the_answer(default_server):
    """52 tokens of 80 '#' run into a 4,096-'#' stop: DONE names it (it once exceeded DONE's
    bound and restarted the engine), and the answer holds the text before it."""
    before = health_engine(default_server)
    stop = "#" * 4096
    r = default_server.post("/v1/completions", json={
        "model": "SmolLM2-135M-Instruct", "prompt": "Hi", "max_tokens": 60, "temperature": 0,
        "logit_bias": {str(HASHES): 100}, "stop": [stop]})
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    assert c["finish_reason"] == "stop" and c["text"] == ""
    r = default_server.post("/v1/messages", json={
        "model": "SmolLM2-135M-Instruct", "max_tokens": 60, "temperature": 0,
        "messages": [{"role": "user", "content": "Write 5000 hash signs."}], "stop_sequences": [stop]})
    assert r.status_code == 200, r.text
    unrestarted(default_server, before)


@pytest.mark.default_model
def test_detokenize_beyond_the_result_bound_is_refused_by_name(default_server):
    before = health_engine(default_server)
    r = default_server.post("/detokenize", json={"tokens": [HASHES] * 600_000})  # 48 MB of text
    assert_named(r, False, 400, "response_too_large", "tokens")
    r = default_server.post("/detokenize", json={"tokens": [HASHES] * 1000})
    assert r.status_code == 200 and r.json()["prompt"] == "#" * 80_000
    unrestarted(default_server, before)


def test_many_long_stop_strings_do_not_stall_the_engine(tiny_server):
    """32 stop strings of ~4,096 characters beside a 200-token generation: the answer is the
    one without stops and the engine is not restarted (the matcher's work per token is
    counted in test_stop_text.py)."""
    before = health_engine(tiny_server)
    stops = [("ab" * 2048)[: 4096 - i] for i in range(32)]
    body = {"model": TINY_ID, "prompt": "Hello", "max_tokens": 200, "seed": 3, "logit_bias": {"2": -100}}  # no EOS
    r = tiny_server.post("/v1/completions", json={**body, "stop": stops}, timeout=120)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 200
    plain = tiny_server.post("/v1/completions", json=body).json()
    assert r.json()["choices"][0]["text"] == plain["choices"][0]["text"]  # no stop matched
    unrestarted(tiny_server, before)


@pytest.mark.parametrize("extra", [{}, {"top_p": 0.9}, {"n": 2}], ids=["batched-draw", "one-row-draw", "n2"])
def test_temperatures_that_overflow_sample_the_greedy_limit(tiny_server, extra):
    body = {"model": TINY_ID, "prompt": "Paris is", "max_tokens": 12, "logprobs": 3, **extra}
    greedy = tiny_server.post("/v1/completions", json={**body, "temperature": 0}).json()
    for t in (1e-39, 5e-324, 1e-45):
        r = tiny_server.post("/v1/completions", json={**body, "temperature": t, "seed": 1})
        assert r.status_code == 200, r.text
        for a, b in zip(r.json()["choices"], greedy["choices"]):
            assert a["text"] == b["text"] and a["logprobs"] == b["logprobs"], t


@pytest.mark.default_model
def test_a_stop_cut_token_never_lends_its_value_to_another_label(default_server):
    """`stop: "Paris"` cuts " Paris" to " ", and " " is a token of its own: the table once
    said top[" "] = the value of " Paris" and relabelled the real " " token:216. Now the
    cut token is keyed by its whole text, and every table equals the one without the stop."""
    body = {"model": "SmolLM2-135M-Instruct", "prompt": "The capital of France is", "max_tokens": 6,
            "temperature": 0, "logprobs": 10}
    free = default_server.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]
    cut = default_server.post("/v1/completions", json={**body, "stop": "Paris"}).json()["choices"][0]
    i = free["tokens"].index(" Paris")
    lp = cut["logprobs"]
    assert cut["text"] == "".join(lp["tokens"]) and lp["tokens"][-1] == " " and len(lp["tokens"]) == i + 1
    assert lp["top_logprobs"] == free["top_logprobs"][: i + 1]
    top = lp["top_logprobs"][-1]
    assert top[" Paris"] == lp["token_logprobs"][-1]
    assert top.get(" ", None) != lp["token_logprobs"][-1]


@pytest.fixture
def one_slot(servers, tiny_model_dir):
    """One engine slot, no queue, and a 0.25 MiB response bound."""
    return servers.get(tiny_args(tiny_model_dir, "--max-running", "1", "--max-queue", "0", "--max-response-mib", "0.25"))


PROMPT = "The quick brown fox jumps over the lazy dog. " * 6


def test_a_response_past_the_bound_is_refused_by_name_and_its_work_cancelled(one_slot):
    before = health_engine(one_slot)
    body = {"model": TINY_ID, "prompt": [PROMPT] * 8, "echo": True, "logprobs": 32, "max_tokens": 4}
    r = one_slot.post("/v1/completions", json=body)
    assert_named(r, False, 400, "response_too_large", None)
    assert "0.25 MiB" in r.json()["error"]["message"] and "--max-response-mib" in r.json()["error"]["message"]
    unrestarted(one_slot, before)
    one = {**body, "prompt": PROMPT}
    assert one_slot.post("/v1/completions", json=one).status_code == 200  # one member fits
    streamed = one_slot.post("/v1/completions", json={**one, "max_tokens": 140, "stream": True,
                                                             "logit_bias": {"2": -100}})
    assert streamed.status_code == 200 and streamed.text.endswith("data: [DONE]\n\n")
    assert len(streamed.content) > 1 << 18  # past the bound, streamed: nothing was held back


def test_tokenizer_routes_take_an_admission_slot(one_slot):
    body = {"model": TINY_ID, "prompt": "Hello", "max_tokens": 200, "stream": True, "logit_bias": {"2": -100}}
    engine = one_slot.engine_pid()
    with httpx.stream("POST", one_slot.url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        it = r.iter_text()
        next(it)  # the one slot is taken ...
        os.kill(engine, signal.SIGSTOP)  # ... and held: the stream cannot finish while the engine is stopped
        try:
            for path, payload in (("/tokenize", {"prompt": "Hi"}), ("/detokenize", {"tokens": [5, 6]}),
                                  ("/v1/messages/count_tokens", {"model": TINY_ID, "messages": [
                                      {"role": "user", "content": "Hi"}]})):
                q = one_slot.post(path, json=payload)
                assert q.status_code == 429 and "queue" in q.text and q.headers["retry-after"], (path, q.text)
        finally:
            os.kill(engine, signal.SIGCONT)
        "".join(it)
    assert one_slot.post("/tokenize", json={"prompt": "Hi"}).status_code == 200


def test_a_large_response_is_written_choice_by_choice_with_the_same_content(tiny_server):
    """32 echoed members with 32-entry tables are ~5 MB: written as a chunked body, one choice
    at a time, and equal to each member sent alone."""
    prompts = [f"{i} {PROMPT}" for i in range(32)]
    body = {"model": TINY_ID, "echo": True, "logprobs": 32, "max_tokens": 2, "temperature": 0}
    r = tiny_server.post("/v1/completions", json={**body, "prompt": prompts})
    assert r.status_code == 200 and "content-length" not in r.headers
    assert r.headers["content-type"] == "application/json" and len(r.content) > 1 << 20
    got = r.json()
    assert got["object"] == "text_completion" and got["usage"]["completion_tokens"] == 64
    for i in (0, 17, 31):
        alone = tiny_server.post("/v1/completions", json={**body, "prompt": prompts[i]}).json()
        assert "content-length" in tiny_server.post("/v1/completions", json={**body, "prompt": "Hi"}).headers
        assert {**got["choices"][i], "index": 0} == alone["choices"][0]
