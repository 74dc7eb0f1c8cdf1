"""Helpers shared by the test modules (fixtures and the server classes are in conftest.py).

Requests on the tiny model, the in-process reference, the engine's own work counters,
/metrics read by prometheus-client's parser, token bytes from the tokenizer's byte table, and
waiting for a state (never for a time)."""
from __future__ import annotations

import json
import time
import uuid

import torch
from prometheus_client.parser import text_string_to_metric_families

from conftest import TINY_ID

# ------------------------------------------------------------------ requests


def complete(server, **body):
    body.setdefault("model", TINY_ID)
    return server.post("/v1/completions", json=body)


def ok(server, **body) -> dict:
    r = complete(server, **body)
    assert r.status_code == 200, r.text
    return r.json()


def cold(server, path: str = "/v1/completions", **body) -> dict:
    """A request no cache can answer, its 200 answer: it carries a salt no other request has
    (the prefix cache shares blocks only among requests of one salt, and the echo cache answers
    only for shared blocks), and its usage says no prompt token came from the cache. Tests that
    compare two computations send both sides this way, so neither is the cache's copy of the
    other. (The n choices of one request share its salt, and its blocks.)"""
    body.setdefault("model", TINY_ID)
    r = server.post(path, json={**body, "cache_salt": uuid.uuid4().hex})
    assert r.status_code == 200, r.text
    j = r.json()
    assert j["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, j["usage"]
    return j


def err(server, status=400, **body) -> dict:
    r = complete(server, **body)
    assert r.status_code == status, r.text
    e = r.json()["error"]
    assert set(e) == {"message", "type", "param", "code"}
    return e


def sse_events(resp_text: str) -> list:
    out = []
    for block in resp_text.split("\n\n"):
        if block.startswith("data: "):
            data = block[6:]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def nothing_in_flight(server) -> None:
    e = server.get("/health").json()["engine"]
    assert (e["in_flight"], e["abandoned"]) == (0, 0), e


def assert_named(r, anthropic: bool, status: int, code: str, param: str | None) -> None:
    """An error answer in the endpoint's envelope, with its code (and param) named."""
    from probity.server.errors import CODES

    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/json" and r.headers["x-request-id"]
    j = r.json()
    if anthropic:
        assert j["type"] == "error" and j["error"]["type"] == CODES[code][2]
        assert param is None or j["error"]["message"].startswith(f"{param}:"), j
    else:
        assert (j["error"]["code"], j["error"]["param"]) == (code, param), j


def label_id(label: str) -> int:
    """The id in a `token_id:N` label (return_tokens_as_token_ids)."""
    assert label.startswith("token_id:"), label
    return int(label.split(":", 1)[1])


# ------------------------------------------------------------------ the reference


def reference_logprobs(hf, ids: list[int]) -> torch.Tensor:
    """log-softmax of transformers' own forward, in-process: one row per position."""
    model = hf[0]
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-to-character table (the ByteLevel pre-tokenizer's), inverted."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


BYTE_OF = _byte_decoder()


def token_bytes(tok, tid: int) -> bytes:
    """A token's bytes from a byte-level BPE tokenizer's own vocabulary (not from probity)."""
    piece = tok.convert_ids_to_tokens(tid)
    return piece.encode() if piece in tok.all_special_tokens else bytes(BYTE_OF[c] for c in piece)


# ------------------------------------------------------------------ waiting for a state


def poll(fn, within: float = 60.0, what="state"):
    """fn() until it returns something truthy (the state reached), or fail after `within` s.
    `what` names the state in the failure (a callable is called then, to show the last seen)."""
    deadline = time.monotonic() + within
    while not (got := fn()):
        assert time.monotonic() < deadline, f"{what() if callable(what) else what} not reached in {within}s"
        time.sleep(0.02)
    return got


# ------------------------------------------------------------------ the engine's own counters

PROBE = {"model": TINY_ID, "prompt": [5], "max_tokens": 1, "temperature": 0}
PROBE_WORK = (1, 1)  # one forward pass over one prompt token


def add(a: tuple, b: tuple) -> tuple:
    return tuple(x + y for x, y in zip(a, b))


def engine_work(server, model: str = TINY_ID) -> tuple[int, int]:
    """(forward_passes, prompt_tokens_computed) as the engine itself reports them, after
    everything sent so far. The engine sends its STATS just before the terminal frame that
    leaves it idle, so once a probe request is answered the figures include all earlier work,
    plus exactly PROBE_WORK."""
    def now():
        st = server.get("/health").json()["engine"]["stats"]
        return st.get("forward_passes"), st.get("prompt_tokens_computed")

    before = now()
    assert server.post("/v1/completions", json={**PROBE, "model": model}).status_code == 200
    after = poll(lambda: (a := now()) != before and a, 30, "the probe's STATS")
    assert None not in after, after
    return after


def engine_health(server) -> dict:
    return server.get("/health").json()["engine"]


# ------------------------------------------------------------------ /metrics


def samples(text: str) -> dict[tuple[str, tuple], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def scrape(server, headers: dict | None = None) -> dict[tuple[str, tuple], float]:
    r = server.get("/metrics", headers=headers or {})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain; version=0.0.4"), r.text
    return samples(r.text)


def value(m: dict, name: str, **labels) -> float:
    """The sample, which must exist: a series the server does not export fails, never reads 0."""
    key = (name, tuple(sorted(labels.items())))
    assert key in m, f"/metrics has no series {name} {labels or ''}"
    return m[key]


def delta(before: dict, after: dict, name: str, **labels) -> float:
    """How much a series grew between two scrapes. It must exist in `after`; it may be missing
    from `before` only as a labelled child not created yet (prometheus-client adds one on its
    first increment). An unlabelled series missing before is a failure."""
    key = (name, tuple(sorted(labels.items())))
    assert key in after, f"/metrics has no series {name} {labels or ''}"
    if key not in before:
        assert labels, f"{name} was not exported before"
        return after[key]
    return after[key] - before[key]
