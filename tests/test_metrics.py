"""/metrics read by prometheus-client's own parser: counts after known traffic, bounded series,
no forged samples, exact counters."""
from __future__ import annotations

import json
import os
import signal
from types import SimpleNamespace

import httpx
import pytest

import helpers
from conftest import API_KEY, TINY_ID, LiveServer
from helpers import delta, poll, samples, value

KEY = {"Authorization": f"Bearer {API_KEY}"}
FORGED = "/v1/models/x%22,status=%22999%22%7D%2042%20%23"
TEMPLATES = {"/v1/completions", "/v1/chat/completions", "/v1/messages", "/v1/messages/count_tokens", "/tokenize",
             "/detokenize", "/tokenizer_info", "/v1/models", "/v1/models/{model_id:path}", "/health", "/metrics",
             "/", "/inspect", "/inspector/{name}", "/docs", "/docs/assets/{name}", "/openapi.json",
             "/v1/files", "/v1/files/{file_id}", "/v1/files/{file_id}/content", "/v1/batches",
             "/v1/batches/{batch_id}", "/v1/batches/{batch_id}/cancel", "other"}


def scrape(s: LiveServer) -> dict[tuple[str, tuple], float]:
    return helpers.scrape(s, KEY)


def quiet_snapshot(s: LiveServer) -> tuple[dict, dict]:
    """(scrape, engine STATS) with every engine series present, and nothing running while both
    are read: one small request first (the engine sends its idle STATS just before its answer,
    so a server that has answered holds the figures)."""
    r = s.post("/v1/completions", {"model": TINY_ID, "prompt": "warm", "max_tokens": 1}, headers=KEY)
    assert r.status_code == 200
    return scrape(s), s.get("/health").json()["engine"]["stats"]


@pytest.fixture
def server(keyed_server):
    return keyed_server


def test_metrics_count_exactly_what_was_sent(server):
    """Every count is the growth between two scrapes around known traffic, so the test holds
    whatever this server saw before (another test, a restart, a rerun)."""
    s = server
    before, stats0 = quiet_snapshot(s)
    prompt_tokens = completion_tokens = cached = 0
    for i in range(3):
        r = s.post("/v1/completions", {"model": TINY_ID, "prompt": f"Hello {i}", "max_tokens": 5 + i,
                                       "temperature": 0}, headers=KEY)
        assert r.status_code == 200
        u = r.json()["usage"]
        prompt_tokens += u["prompt_tokens"]
        completion_tokens += u["completion_tokens"]
        cached += u["prompt_tokens_details"]["cached_tokens"]
    with httpx.stream("POST", s.url + "/v1/completions", headers=KEY, timeout=60, json={
            "model": TINY_ID, "prompt": "Stream me", "max_tokens": 7, "stream": True, "echo": True, "logprobs": 2,
            "stream_options": {"include_usage": True}}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    u = chunks[-1]["usage"]
    prompt_tokens += u["prompt_tokens"]
    completion_tokens += u["completion_tokens"]
    cached += u["prompt_tokens_details"]["cached_tokens"]
    r = s.post("/v1/chat/completions", {"model": TINY_ID, "messages": [{"role": "user", "content": "Hi"}],
                                        "max_tokens": 4}, headers=KEY)
    u = r.json()["usage"]
    prompt_tokens += u["prompt_tokens"]
    completion_tokens += u["completion_tokens"]
    cached += u["prompt_tokens_details"]["cached_tokens"]
    r = s.post("/v1/messages", {"model": TINY_ID, "messages": [{"role": "user", "content": "Hi"}],
                                "max_tokens": 3}, headers=KEY)
    u = r.json()["usage"]
    prompt_tokens += u["input_tokens"]
    completion_tokens += u["output_tokens"]
    cached += u["cache_read_input_tokens"]
    assert s.post("/tokenize", {"prompt": "Hello"}, headers=KEY).status_code == 200
    generate_requests = 6

    assert s.post("/v1/completions", {"model": TINY_ID, "prompt": "x"}).status_code == 401
    assert s.post("/v1/completions", {"model": TINY_ID, "prompt": "x"},
                  headers={"Authorization": "Bearer wrong"}).status_code == 401
    r = httpx.get(s.url + "/v1/models", headers={**KEY, "Host": "evil.example"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_host"
    for i in range(5):  # unknown paths: one label between them, not a series each
        assert s.get(f"/no/such/path/{i}", headers=KEY).status_code == 404
    assert httpx.post(s.url + FORGED, headers=KEY).status_code == 405

    m = scrape(s)

    def d(name, **labels):
        return delta(before, m, name, **labels)

    req = "probity_http_requests_total"
    assert d(req, route="/v1/completions", status="200") == 4
    assert d(req, route="/v1/chat/completions", status="200") == 1
    assert d(req, route="/v1/messages", status="200") == 1
    assert d(req, route="/tokenize", status="200") == 1
    assert d(req, route="/v1/completions", status="401") == 2
    assert d(req, route="/v1/models", status="400") == 1
    assert d(req, route="other", status="404") == 5
    assert d(req, route="/v1/models/{model_id:path}", status="405") == 1
    assert d("probity_refused_requests_total", code="invalid_api_key") == 2
    assert d("probity_refused_requests_total", code="invalid_host") == 1
    # the forged path planted nothing: every label comes from the bounded sets, and the only
    # series that appeared since `before` are counters of requests and refusals
    for name, labels in m:
        dl = dict(labels)
        assert set(dl) <= {"route", "status", "code", "le"}, (name, dl)
        assert dl.get("route", "other") in TEMPLATES, dl
        assert dl.get("status", "200").isdigit() and dl.get("status") != "999", dl
    assert {name for name, _ in m.keys() - before.keys()} <= {req, "probity_refused_requests_total"}, \
        m.keys() - before.keys()

    assert d("probity_prompt_tokens_total") == prompt_tokens
    assert d("probity_generation_tokens_total") == completion_tokens
    assert d("probity_prompt_tokens_cached_total") == cached
    for h in ("probity_time_to_first_token_seconds", "probity_e2e_request_latency_seconds",
              "probity_request_queue_time_seconds", "probity_request_prefill_time_seconds",
              "probity_request_decode_time_seconds"):
        assert d(h + "_count") == generate_requests, h
        assert d(h + "_bucket", le="+Inf") == generate_requests, h
    # one sample per generated sequence of two or more tokens; every request above made one
    assert d("probity_time_per_output_token_seconds_count") == generate_requests
    assert value(m, "probity_engine_up") == 1 and d("probity_engine_restarts_total") == 0
    assert value(m, "probity_queue_depth") == 0 and value(m, "probity_requests_active") == 0

    # Engine figures: the last answer was preceded by the engine's idle STATS, so the server
    # holds them; no restart happened in between (checked above), so the engine's own counters
    # and the exported totals grew by the same amounts.
    stats = s.get("/health").json()["engine"]["stats"]
    for field, name in (("generated_tokens", "probity_engine_generated_tokens_total"),
                        ("forward_passes", "probity_engine_forward_passes_total"),
                        ("prompt_tokens_computed", "probity_engine_prompt_tokens_computed_total")):
        assert d(name) == stats[field] - stats0[field], name
    assert d("probity_engine_generated_tokens_total") == completion_tokens
    assert d("probity_engine_forward_passes_total") > 0
    assert value(m, "probity_num_requests_running") == 0 and value(m, "probity_num_requests_waiting") == 0
    # the engine reports its cache figures or it does not; never a made-up zero
    for field, name in (("prefix_query_tokens", "probity_prefix_cache_queries_total"),
                        ("prefix_hit_tokens", "probity_prefix_cache_hits_total")):
        assert ((name, ()) in m) == (field in stats)
        if field in stats:
            assert d(name) == stats[field] - stats0[field]
    if "kv_blocks_total" in stats:
        assert value(m, "probity_kv_cache_usage_perc") == stats["kv_blocks_used"] / stats["kv_blocks_total"]
    else:
        assert ("probity_kv_cache_usage_perc", ()) not in m


def test_engine_counters_keep_counting_across_a_restart(server):
    s = server
    before, _ = quiet_snapshot(s)
    h0 = s.get("/health").json()["engine"]
    os.kill(h0["pid"], signal.SIGKILL)
    poll(lambda: (h := s.get("/health")).status_code == 200 and h.json()["engine"]["restarts"] == h0["restarts"] + 1,
         what="the engine restarted once")
    r = s.post("/v1/completions", {"model": TINY_ID, "prompt": "Again", "max_tokens": 5, "temperature": 0},
               headers=KEY)
    assert r.status_code == 200
    n = r.json()["usage"]["completion_tokens"]
    # the new engine's idle STATS came before its answer: the total already holds its tokens
    m = scrape(s)
    assert delta(before, m, "probity_engine_generated_tokens_total") == n
    assert delta(before, m, "probity_engine_restarts_total") == 1 and value(m, "probity_engine_up") == 1
    assert delta(before, m, "probity_engine_forward_passes_total") > 0
    assert delta(before, m, "probity_generation_tokens_total") == n


def test_counters_stay_exact_past_a_million_and_across_engine_restarts():
    from probity.server.metrics import Metrics

    engine = SimpleNamespace(up=True, restarts=2)
    m = Metrics(SimpleNamespace(queued=0, active=0), engine)
    m.engine.report({"forward_passes": 1_234_567_891, "generated_tokens": 7, "active": 3, "waiting": 1,
                     "kv_blocks_used": 3, "kv_blocks_total": 8})
    m.engine.report({"forward_passes": 1_234_567_893, "generated_tokens": 9})
    m.engine.engine_started()  # a new engine counts from zero again
    m.engine.report({"forward_passes": 5, "generated_tokens": 1})
    gen = SimpleNamespace(t0=0.0, first_token_at=0.5, queue_s=0.25, token_span={(0, 0): [0.5, 2.5]})
    m.finished(gen, {"usage": {"prompt_tokens": 1_234_567, "completion_tokens": 5, "cached_tokens": 0},
                     "timings": {"queue_s": 0.5, "prefill_s": 0.125, "decode_s": 2.0},
                     "choices": [{"member": 0, "choice": 0, "completion_tokens": 5}]}, now=3.0)
    text = m.render().decode()
    got = samples(text)
    assert got[("probity_engine_forward_passes_total", ())] == 1_234_567_898
    assert got[("probity_engine_generated_tokens_total", ())] == 10
    assert got[("probity_prompt_tokens_total", ())] == 1_234_567
    assert got[("probity_engine_restarts_total", ())] == 2
    assert got[("probity_e2e_request_latency_seconds_sum", ())] == 3.0
    assert got[("probity_time_to_first_token_seconds_sum", ())] == 0.5
    assert got[("probity_request_queue_time_seconds_sum", ())] == 0.75
    assert got[("probity_time_per_output_token_seconds_sum", ())] == 0.5
    # the gauges show the newest engine's report only: it has sent no kv or running figures
    assert ("probity_kv_cache_usage_perc", ()) not in got and ("probity_num_requests_running", ()) not in got
