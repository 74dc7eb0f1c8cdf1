"""The batched engine through the live server: numbers do not depend on what else runs, on how
prompts are chunked, on preemption, or on whether a position was prefilled or decoded.
Floats arrive as JSON with round-trip precision, so `==` here compares the engine's float32
bits. Every compared request is computed, never the cache's copy of another: each carries a
fresh `cache_salt` and its `cached_tokens` is 0 (helpers.cold), and the n choices of one
request, which share its blocks, are compared on a server without the prefix cache.

Seen failing (each break made once in the runner, then undone): hidden states scaled by
1 + 2^-20 in steps that run more than one sequence fails the concurrent, chunked, array and
default-model tests; the same in steps whose sequences each run one row (decode) fails the
rescore tests -- which, while the rescore read the generated positions from the cache, passed."""
from __future__ import annotations

import concurrent.futures as cf

import pytest

from conftest import TINY_ID, LiveServer
from helpers import PROBE_WORK, cold, engine_work, ok, poll

EOS_ID = "2"  # <|im_end|> in the tiny tokenizer
NO_EOS = {EOS_ID: -100}  # reported values are raw: the bias only keeps sequences long


def gen(server, prompt, **kw) -> dict:
    body = {"model": TINY_ID, "prompt": prompt, "max_tokens": 40, "logprobs": 5, "seed": 11,
            "temperature": 0.9, "logit_bias": NO_EOS, **kw}
    return cold(server, **body)["choices"]


PROMPTS = ["The quick brown fox", "Paris is the capital of France. " * 3, "日本語のテキスト",
           "def f(x):\n    return x * 2\n" * 2, "Numbers 0 1 2 3 4 5 6 7 8 9 10", "Hello"]


@pytest.fixture(scope="module")
def alone(tiny_server):
    """Each prompt's seeded generation and echo, sent alone and one at a time."""
    return {p: (gen(tiny_server, p), gen(tiny_server, p, echo=True, max_tokens=0)) for p in PROMPTS}


def run_concurrently(server) -> dict:
    jobs = [(p, {}) for p in PROMPTS] + [(p, {"echo": True, "max_tokens": 0}) for p in PROMPTS]
    with cf.ThreadPoolExecutor(len(jobs)) as pool:
        futs = [pool.submit(gen, server, p, **kw) for p, kw in jobs]
        res = [f.result() for f in futs]
    return {p: (res[i], res[i + len(PROMPTS)]) for i, p in enumerate(PROMPTS)}


def with_passes(server, fn, model: str = TINY_ID):
    """(fn(), forward passes the engine ran for it), from the engine's own STATS, with no engine
    restart in between (a new engine counts from 0)."""
    restarts = server.get("/health").json()["engine"]["restarts"]
    before = engine_work(server, model)
    out = fn()
    after = engine_work(server, model)
    assert server.get("/health").json()["engine"]["restarts"] == restarts
    return out, after[0] - before[0] - PROBE_WORK[0]


def test_concurrent_requests_equal_each_alone_and_share_forward_passes(tiny_server, alone):
    """Run together, every request gets its alone-run's floats, bit for bit -- and they really
    ran together: one at a time, each forward pass samples at most one token, so the generated
    tokens alone need as many passes; fewer passes means passes carried several requests' rows."""
    got, passes = with_passes(tiny_server, lambda: run_concurrently(tiny_server))
    assert got == alone
    generated = sum(len(c["logprobs"]["tokens"]) for p in PROMPTS for c in got[p][0])
    assert generated == 40 * len(PROMPTS)   # NO_EOS keeps every choice at max_tokens; echo generates none
    assert passes < generated, (passes, generated)


def test_tiny_prompt_chunks_change_nothing(tiny_model_dir, alone):
    s = LiveServer(["--model", str(tiny_model_dir), "--threads", "1", "--step-tokens", "3"])
    try:
        assert run_concurrently(s) == alone
    finally:
        s.stop()


def test_pool_far_too_small_preempts_and_recomputes_identically(tiny_model_dir, alone):
    # 71 blocks of 4 tokens: room for one full context (256) but not for the concurrent load
    s = LiveServer(["--model", str(tiny_model_dir), "--threads", "1", "--kv-cache-gib", "0.00028"])
    try:
        long = {p: gen(s, p, max_tokens=120) for p in PROMPTS[:1]}
        with cf.ThreadPoolExecutor(6) as pool:
            futs = {p: pool.submit(gen, s, p, max_tokens=120) for p in PROMPTS}
            got = {p: f.result() for p, f in futs.items()}
        assert got[PROMPTS[0]] == long[PROMPTS[0]]
        assert run_concurrently(s) == alone
        stats = s.get("/health").json()["engine"]["stats"]
        assert stats["preemptions"] > 0, stats
        # int(0.00028 GiB / 4224 B per block) + 1, less the zero block: per token 784 B of K/V and
        # hidden state, 272 B of echo cache, 4 tokens a block (docs/engine.md)
        assert stats["kv_blocks_total"] == 71
    finally:
        s.stop()


def test_n_choices_with_echo_report_identical_numbers(uncached_server):
    """Each of the three choices computes the prompt itself (no prefix cache to share it through:
    the engine's own count of computed prompt tokens is three prompts), and all report the
    same floats."""
    body = dict(model=TINY_ID, prompt="The capital of France is", max_tokens=6, n=3, echo=True,
                logprobs=3, temperature=0, logit_bias=NO_EOS)
    before = engine_work(uncached_server)
    r = ok(uncached_server, **body)
    computed = engine_work(uncached_server)[1] - before[1] - PROBE_WORK[1]
    assert computed == 3 * r["usage"]["prompt_tokens"], computed
    lps = [c["logprobs"] for c in r["choices"]]
    assert lps[0] == lps[1] == lps[2]


def test_generated_text_rescored_with_echo_returns_identical_floats(tiny_server):
    prompt = tiny_server.post("/tokenize", json={"model": TINY_ID, "prompt": "Hello, world! Hello"}).json()["tokens"]
    g = cold(tiny_server, model=TINY_ID, prompt=prompt, max_tokens=30, logprobs=4, seed=3, temperature=1.0,
             logit_bias=NO_EOS, return_tokens_as_token_ids=True)["choices"][0]["logprobs"]
    ids = [int(t.split(":")[1]) for t in g["tokens"]]
    e = cold(tiny_server, model=TINY_ID, prompt=prompt + ids, max_tokens=0, echo=True, logprobs=4,
             return_tokens_as_token_ids=True)["choices"][0]["logprobs"]
    n = len(prompt)
    assert e["tokens"][n:] == g["tokens"]
    assert e["token_logprobs"][n:] == g["token_logprobs"]
    assert e["top_logprobs"][n:] == g["top_logprobs"]


def test_prompt_array_members_equal_alone_at_any_position(tiny_server):
    """...and the array's members really share forward passes (fewer passes than members)."""
    members = PROMPTS[:4]
    solo = [cold(tiny_server, model=TINY_ID, prompt=p, max_tokens=0, echo=True, logprobs=2)["choices"][0]
            for p in members]
    for order in (members, members[::-1]):
        r, passes = with_passes(tiny_server, lambda: cold(tiny_server, model=TINY_ID, prompt=order, max_tokens=0,
                                                          echo=True, logprobs=2)["choices"])
        assert passes < len(members), passes
        by_prompt = {m: c for m, c in zip(order, r)}
        assert [by_prompt[m]["logprobs"] for m in members] == [c["logprobs"] for c in solo]


@pytest.mark.default_model
def test_long_echo_request_peak_memory_is_bounded(default_server):
    """An ~4,000-token echo request with 32 alternatives: the engine's peak resident memory
    rises by less than 1 GiB over its resting size (the head and log-softmax run in bounded
    chunks of rows; the KV pool is preallocated). Computed for every position at once, the
    logits and their log-softmax alone would take 4,000 x 49,152 x 4 bytes x 2 = 1.6 GB.
    (It was 8,000 tokens until stop 22: 136 s of the suite, the attention's cost quadratic.)"""
    pid = default_server.engine_pid()
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")  # reset the peak (VmHWM) to the current resident size
    rest = _status_kib(pid, "VmRSS")
    text = "The quick brown fox jumps over the lazy dog. " * 400
    r = default_server.post("/v1/completions", json={"model": "SmolLM2-135M-Instruct", "prompt": text,
                            "max_tokens": 0, "echo": True, "logprobs": 32}, timeout=900)
    assert r.status_code == 200, r.text
    r = r.json()
    assert len(r["choices"][0]["logprobs"]["tokens"]) > 3500
    peak = _status_kib(pid, "VmHWM")
    assert peak - rest < 1024 * 1024, (rest, peak)


DEFAULT_PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", "Once upon a time, in a village by the sea,",
                   "Translate to French: the cat sleeps on the warm windowsill."]


@pytest.mark.default_model
def test_default_model_as_served_is_batch_invariant_and_rescores_exactly(default_server):
    """The default model as `make serve` serves it (its stored Q4_1 blocks, the stored-weights
    kernels): each prompt's seeded generation and echo, sent alone, equal the same requests run
    all at once (sharing forward passes: fewer than the tokens generated) and the echoes sent
    as one prompt array, bit for bit; and a generation rescored with echo (every position
    prefilled) reports the floats decoding reported. Nothing here is the cache's copy."""
    model = "SmolLM2-135M-Instruct"
    body = dict(model=model, max_tokens=12, logprobs=5, seed=5, temperature=0.8, return_tokens_as_token_ids=True)
    echo = dict(model=model, max_tokens=0, echo=True, logprobs=5)
    alone = [(cold(default_server, prompt=p, **body)["choices"], cold(default_server, prompt=p, **echo)["choices"])
             for p in DEFAULT_PROMPTS]

    def together():
        with cf.ThreadPoolExecutor(2 * len(DEFAULT_PROMPTS)) as pool:
            gens = [pool.submit(cold, default_server, prompt=p, **body) for p in DEFAULT_PROMPTS]
            echoes = [pool.submit(cold, default_server, prompt=p, **echo) for p in DEFAULT_PROMPTS]
            return [(g.result()["choices"], e.result()["choices"]) for g, e in zip(gens, echoes)]

    got, passes = with_passes(default_server, together, model)
    assert got == alone
    generated = sum(len(g[0]["logprobs"]["tokens"]) for g, _ in got)
    assert passes < generated, (passes, generated)
    array = cold(default_server, prompt=DEFAULT_PROMPTS, **echo)["choices"]
    assert [c["logprobs"] for c in array] == [e[0]["logprobs"] for _, e in alone]

    for p, ((g,), _) in zip(DEFAULT_PROMPTS, alone):
        ids = default_server.post("/tokenize", json={"model": model, "prompt": p}).json()["tokens"]
        out = [int(t.split(":")[1]) for t in g["logprobs"]["tokens"]]
        e = cold(default_server, prompt=ids + out, **echo, return_tokens_as_token_ids=True)["choices"][0]["logprobs"]
        n = len(ids)
        assert e["tokens"][n:] == g["logprobs"]["tokens"]
        assert e["token_logprobs"][n:] == g["logprobs"]["token_logprobs"]
        assert e["top_logprobs"][n:] == g["logprobs"]["top_logprobs"]


def _status_kib(pid: int, key: str) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def test_engine_stats_are_fresh_once_a_cancelled_stream_leaves_it_idle(tiny_server):
    """A stream the client abandons is cancelled; the engine, now idle, says so at once
    (before, /health kept showing one running sequence until the next request)."""
    import json
    import socket

    s = tiny_server
    # 16 choices with top tables, so the tiny model is still busy when the client leaves
    body = json.dumps({"model": TINY_ID, "prompt": "Hello", "max_tokens": 240, "stream": True, "n": 16,
                       "logprobs": 32, "logit_bias": NO_EOS}).encode()
    c = socket.create_connection(("127.0.0.1", s.port), timeout=30)
    c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    assert c.recv(4096).startswith(b"HTTP/1.1 200")  # committed: the engine runs it
    poll(lambda: s.get("/health").json()["engine"]["stats"].get("active"), 30, "the engine busy")
    assert s.get("/health").json()["engine"]["stats"]["active"] == 16
    c.close()
    h = poll(lambda: (h := s.get("/health").json())["engine"]["in_flight"] == 0
             and h["engine"]["stats"].get("active") == 0 and h, 30, "the engine idle")
    assert h["engine"]["stats"]["active"] == 0 and h["engine"]["stats"]["waiting"] == 0


def test_api_reports_the_engines_float32_values_exactly(tiny_server, tiny_model_dir):
    """Echo values over HTTP are the engine forward's own floats, bit for bit (a transport that
    rounded, e.g. to 6 decimals, would fail): compared with probity's model run in-process
    on the same weights and thread count."""
    import torch
    from transformers import AutoModelForCausalLM

    from test_invariance import Harness, alone

    ids = tiny_server.post("/tokenize", json={"model": TINY_ID, "prompt": "Prices: 5€, 10£ — naïve café"}).json()["tokens"]
    r = ok(tiny_server, model=TINY_ID, prompt=ids, max_tokens=0, echo=True, logprobs=3)["choices"][0]["logprobs"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the server's engine runs with --threads 1
    try:
        hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
        lp = torch.log_softmax(alone(Harness(hf, 1024), ids), -1)
    finally:
        torch.set_num_threads(threads)
    want = [lp[i, t].item() for i, t in enumerate(ids[1:])]
    assert r["token_logprobs"][1:] == want
