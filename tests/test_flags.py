"""Every limit flag and environment variable takes effect, and its refusal is named: one server
with all of them set low, compared with the default tiny server."""
from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

from conftest import TINY_ID, tiny_args
from helpers import assert_named


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("probity-cache")


@pytest.fixture
def tight(servers, tiny_model_dir, cache_dir):
    return servers.get(tiny_args(tiny_model_dir, "--max-logprobs", "3", "--max-batch-members", "2",
                                 "--batch-completion-tokens", "10", "--max-body", "2000", "--max-connections", "4",
                                 "--log-level", "warning", "--kv-cache-gib", "0.05", "--kept-keys-gib", "0",
                                 "--heap-keep-gib", "0"),
                       env={"PROBITY_CACHE_DIR": str(cache_dir)})


def complete(server, **body) -> httpx.Response:
    return server.post("/v1/completions", json={"model": TINY_ID, "prompt": "Hello", **body})


def test_max_logprobs_bounds_completions_and_chat(tight):
    assert complete(tight, logprobs=3).status_code == 200
    r = complete(tight, logprobs=4)
    assert_named(r, False, 400, "invalid_value", "logprobs")
    assert "[0, 3]" in r.json()["error"]["message"]
    r = tight.post("/v1/chat/completions", json={"model": TINY_ID, "messages": [{"role": "user", "content": "Hi"}],
                                                 "logprobs": True, "top_logprobs": 4})
    assert_named(r, False, 400, "invalid_value", "top_logprobs")


def test_batch_member_cap_and_completion_budget(tight):
    assert_named(complete(tight, prompt=["a", "b", "c"], max_tokens=1), False, 400, "prompt_batch_cap_exceeded",
                 "prompt")
    assert complete(tight, prompt=["a", "b"], max_tokens=5).status_code == 200
    assert_named(complete(tight, prompt=["a", "b"], max_tokens=6), False, 400, "batch_completion_budget_exceeded",
                 "max_tokens")


def test_max_body(tight):
    r = complete(tight, user="x" * 1990)
    assert_named(r, False, 413, "request_too_large", None)
    assert complete(tight, user="x" * 1000).status_code == 200


def test_max_connections_refuses_by_name_then_recovers(tight):
    idle = [socket.create_connection(("127.0.0.1", tight.port)) for _ in range(4)]
    try:
        time.sleep(0.3)
        r = complete(tight)
        assert r.status_code == 503 and r.json()["error"]["code"] == "too_many_connections", r.text
        assert r.headers["retry-after"] == "1" and r.headers["x-request-id"]
    finally:
        for c in idle:
            c.close()
    deadline = time.monotonic() + 10
    while complete(tight).status_code != 200 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert complete(tight).status_code == 200


def test_log_level_warning_drops_the_info_lines(tight):
    complete(tight, max_tokens=1)
    log = tight.log_path.read_text()
    assert "request_id=" not in log and "engine ready" not in log  # INFO lines


def test_memory_flags_set_what_the_engine_holds(tight, tiny_server):
    small, big = tight.get("/health").json()["engine"]["memory"], tiny_server.get("/health").json()["engine"]["memory"]
    pools = [m["kv_pool"] + m["hidden_pool"] + m["echo_cache"] for m in (small, big)]
    assert 0.04 * (1 << 30) <= pools[0] <= 0.051 * (1 << 30) and 1.99 * (1 << 30) <= pools[1] <= 2.01 * (1 << 30)
    assert (small["kept_keys_max"], big["kept_keys_max"]) == (0, 1 << 30)
    assert small["weights_kernels"] == big["weights_kernels"] > 0
    assert small["resident"] < big["resident"] - (1 << 30)  # the pool is touched at start: it is resident
    for m in (small, big):
        assert sum(m[k] for k in ("weights_kernels", "kv_pool", "hidden_pool", "echo_cache")) \
            <= m["resident"]
    # no keys kept between decode steps changes no number
    body = {"prompt": "The quick brown fox", "max_tokens": 20, "temperature": 0, "logprobs": 3}
    a = complete(tight, **body).json()["choices"][0]
    b = complete(tiny_server, **body).json()["choices"][0]
    assert a["logprobs"] == b["logprobs"]


def test_probity_cache_dir_holds_the_kernels(tight, cache_dir):
    assert list((cache_dir / "kernels").glob("kernels-*.so"))
    assert sorted(p.name for p in cache_dir.iterdir()) == ["kernels"]