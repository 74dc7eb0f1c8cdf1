"""The exact prefix cache: every number returned — prompt (echo) and generated logprobs, top
tables, greedy and seeded tokens — is bit-for-bit what a server without the cache returns,
cold, warm, partly cached, shared inside a prompt array, and after eviction. The accounting
(`cached_tokens`, `cache_read_input_tokens`, the engine's hit counters) tells the truth."""
from __future__ import annotations

import random
import uuid

import pytest

from conftest import TINY_ID, tiny_args
from probity.engine.engine import BLOCK_SIZE as BLOCK
from helpers import PROBE_WORK, add, engine_work, ok

NO_EOS = {"2": -100}


@pytest.fixture
def cold(uncached_server):
    return uncached_server


@pytest.fixture
def small_pool(servers, tiny_model_dir):
    """Room for one full context and a little more: cached blocks are evicted all the time."""
    return servers.get(tiny_args(tiny_model_dir, "--kv-cache-gib", "0.0004"))


def request(prompt, rng: random.Random) -> dict:
    kind = rng.choice(["echo", "echo", "greedy", "seeded"])
    body = {"model": TINY_ID, "prompt": prompt, "logprobs": rng.choice([1, 5, 32]), "logit_bias": NO_EOS}
    if kind == "echo":
        body.update(echo=True, max_tokens=rng.choice([0, 1]), temperature=0)
    else:
        body.update(max_tokens=rng.randint(1, 12), temperature=0 if kind == "greedy" else 1.0, seed=rng.randrange(100),
                    echo=rng.random() < 0.5)
    return body


def numbers(server, body) -> list:
    r = ok(server, **body)
    return [(c["text"], c["logprobs"], c["finish_reason"]) for c in r["choices"]]


def overlapping_prompts(rng: random.Random, n: int) -> list[list[int]]:
    """Token-id prompts that share prefixes of random lengths with earlier ones."""
    out = []
    for _ in range(n):
        if out and rng.random() < 0.8:
            base = rng.choice(out)
            cut = rng.randint(1, len(base))
            p = base[:cut] + [rng.randrange(3, 390) for _ in range(rng.randint(0, 40))]
        else:
            p = [rng.randrange(3, 390) for _ in range(rng.randint(1, 120))]
        out.append(p[:200])
    return out


def _compare(server, cold, seed: int, n: int) -> None:
    rng = random.Random(seed)
    for prompt in overlapping_prompts(rng, n):
        body = request(prompt, rng)
        want = numbers(cold, body)
        assert numbers(server, body) == want       # cold or partly cached
        assert numbers(server, body) == want       # warm: the whole prefix is cached now


def test_cache_equals_no_cache_random_overlaps(tiny_server, cold):
    _compare(tiny_server, cold, seed=1, n=30)


def test_cache_equals_no_cache_for_arrays_sharing_prefixes(tiny_server, small_pool, cold):
    """Members of one array that share prefixes of random lengths run in the same steps, the
    later ones reading blocks the earlier ones fill in that very forward pass: every number
    is still the cold server's, with a roomy pool and with one that evicts all the time."""
    rng = random.Random(8)
    for _ in range(8):
        members = overlapping_prompts(rng, rng.randint(2, 6))
        body = request(members, rng)
        want = numbers(cold, body)
        for server in (tiny_server, small_pool):
            assert numbers(server, body) == want


def test_cache_equals_no_cache_under_eviction(small_pool, cold):
    stats0 = small_pool.get("/health").json()["engine"]["stats"]
    _compare(small_pool, cold, seed=2, n=30)
    stats = small_pool.get("/health").json()["engine"]["stats"]
    assert stats["prefix_hit_tokens"] > stats0.get("prefix_hit_tokens", 0)


def test_cached_tokens_are_reported_truthfully(tiny_server):
    rng = random.Random(5)
    prompt = [rng.randrange(3, 390) for _ in range(90)]
    full = 89 // BLOCK * BLOCK  # the full blocks in the first 89 tokens (the last one's row is recomputed)
    body = {"model": TINY_ID, "prompt": prompt, "max_tokens": 1, "echo": True, "logprobs": 1}
    first = ok(tiny_server, **body)["usage"]["prompt_tokens_details"]["cached_tokens"]
    again = ok(tiny_server, **body)["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert first == 0 and again == full
    longer = ok(tiny_server, **{**body, "prompt": prompt + [7] * 30})["usage"]
    assert longer["prompt_tokens_details"]["cached_tokens"] == full
    assert longer["prompt_tokens"] == 120


def test_cache_salt_shares_blocks_only_within_one_salt(tiny_server, cold):
    """vLLM's cache_salt: a prompt's blocks serve a later request only if it carries the same
    salt (or, unsalted, none); the numbers are the cold server's whichever way, and chat too."""
    rng = random.Random(8)
    prompt = [rng.randrange(3, 390) for _ in range(41)]
    full = 40 // BLOCK * BLOCK
    body = {"model": TINY_ID, "prompt": prompt, "max_tokens": 3, "echo": True, "logprobs": 2, "temperature": 0}
    want = ok(cold, **body)["choices"]
    a, b = (f"{x}-{uuid.uuid4()}" for x in "ab")
    seen = []
    for salt in (None, a, a, b, None, a, b):
        r = ok(tiny_server, **body, **({} if salt is None else {"cache_salt": salt}))
        assert r["choices"] == want
        seen.append(r["usage"]["prompt_tokens_details"]["cached_tokens"])
    assert seen == [0, 0, full, 0, full, full, full]
    chat = {"model": TINY_ID, "messages": [{"role": "user", "content": "Salted? " * 6}], "max_tokens": 2,
            "temperature": 0, "logprobs": True, "top_logprobs": 2}
    got = [tiny_server.post("/v1/chat/completions", json={**chat, "cache_salt": salt}).json() for salt in (a, a, b)]
    assert [g["usage"]["prompt_tokens_details"]["cached_tokens"] > 0 for g in got] == [False, True, False]
    assert got[0]["choices"] == got[1]["choices"] == got[2]["choices"]


def test_array_members_share_their_common_context(tiny_server):
    """lm-eval's multiple-choice shape: one context, several continuations, one array."""
    rng = random.Random(6)
    ctx = [rng.randrange(3, 390) for _ in range(102)]  # not a whole number of blocks
    members = [ctx + [rng.randrange(3, 390) for _ in range(6)] for _ in range(4)]
    before = engine_work(tiny_server)
    r = ok(tiny_server, model=TINY_ID, prompt=members, max_tokens=1, echo=True, logprobs=1, temperature=0)
    # the first member computes the full blocks of the context; the other three reuse them, in
    # the same forward pass, and compute the rest: 108 + 3 x (108 - full) prompt rows, one step
    full = 102 // BLOCK * BLOCK
    assert 0 < full < 102
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == 3 * full
    assert engine_work(tiny_server) == add(add(before, (1, 108 + 3 * (108 - full))), PROBE_WORK)
    solo = [ok(tiny_server, model=TINY_ID, prompt=m, max_tokens=1, echo=True, logprobs=1,
               temperature=0)["choices"][0]["logprobs"]
            for m in members]
    assert [c["logprobs"] for c in r["choices"]] == solo


def test_anthropic_reports_cache_reads(tiny_server):
    body = {"model": TINY_ID, "max_tokens": 2, "system": "You are terse. " * 12,
            "messages": [{"role": "user", "content": "Say something."}]}
    h = {"anthropic-version": "2023-06-01"}
    first = tiny_server.post("/v1/messages", json=body, headers=h).json()["usage"]
    second = tiny_server.post("/v1/messages", json=body, headers=h).json()["usage"]
    assert second["cache_read_input_tokens"] > 0
    assert second["cache_read_input_tokens"] % BLOCK == 0
    assert second["cache_read_input_tokens"] < second["input_tokens"]
    assert first["input_tokens"] == second["input_tokens"]
