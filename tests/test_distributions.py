"""Whole distributions and chosen-token scores (issue 40; docs/api.md, Distributions and scores).

`distribution: true` reports each position's whole log-softmax row as base64 float32 and
`score_tokens` the values of named tokens at every position, prompt (echo) and generated. They
are the very floats the tables report, so they are compared with them bit for bit; the rows are
checked against transformers' own forward on the same weights (a different implementation,
within the fidelity budget) and against `logsumexp == 0` in float64. Invariance (alone vs in a
prompt array, streamed vs whole) is compared on raw bytes, on a server whose prefix cache cannot
answer (`--no-prefix-cache`, `cached_tokens == 0` asserted), and with the shared server's echo
cache holding the same positions (it keeps no rows, so it must step aside).

Seen failing against deliberate breaks: rows taken from the logits instead of their
log-softmax (test_rows_are_the_tables_floats); the echo cache answering a rows request
(test_the_echo_cache_does_not_answer_for_rows: positions without a row)."""
from __future__ import annotations

import base64

import numpy as np
import pytest
import torch

from conftest import TINY_ID, tiny_args
from helpers import complete, err, label_id, ok, reference_logprobs, sse_events, token_bytes

PROMPT = "Paris is the capital of France. The quick brown fox"
VOCAB = 400  # the tiny model's


def row(b64: str) -> np.ndarray:
    r = np.frombuffer(base64.b64decode(b64), dtype="<f4")
    assert r.shape == (VOCAB,)
    return r


def rows_request(**extra) -> dict:
    body = dict(prompt=PROMPT, echo=True, logprobs=5, max_tokens=6, temperature=0, distribution=True,
                return_tokens_as_token_ids=True)
    body.update(extra)
    return body


@pytest.fixture(scope="module")
def uncached(uncached_server):
    """A server whose prefix cache cannot answer for anything."""
    return uncached_server


def one_token_text(tok) -> tuple[str, int]:
    """A token whose bytes are UTF-8 text no other token has (from the tokenizer, not probity)."""
    seen: dict[bytes, list[int]] = {}
    for tid in range(VOCAB):
        seen.setdefault(token_bytes(tok, tid), []).append(tid)
    for b, ids in seen.items():
        if len(ids) == 1 and len(b) > 2 and b.isascii() and b.decode().strip():
            return b.decode(), ids[0]
    raise AssertionError("no one-token text")


def test_rows_are_the_tables_floats(tiny_server, tiny_hf):
    lp = ok(tiny_server, **rows_request(prompt=PROMPT + " rows"))["choices"][0]["logprobs"]
    ids = [label_id(t) for t in lp["tokens"]]
    assert lp["distributions"][0] is None and lp["token_logprobs"][0] is None
    ref = reference_logprobs(tiny_hf, ids)
    for i in range(1, len(ids)):
        r = row(lp["distributions"][i])
        assert float(r[ids[i]]) == lp["token_logprobs"][i]          # the same float, not a near one
        for label, v in lp["top_logprobs"][i].items():
            assert float(r[label_id(label)]) == v
        assert abs(float(np.logaddexp.reduce(r.astype(np.float64)))) < 2e-5
        # transformers' forward on the same weights: row i scores token i from position i - 1
        assert torch.allclose(torch.from_numpy(r.copy()), ref[i - 1], atol=1e-4, rtol=0)


def test_score_tokens_equal_echo_and_distribution(tiny_server, tiny_hf):
    text, tid = one_token_text(tiny_hf[1])
    lp = ok(tiny_server, **rows_request(prompt=PROMPT + " scores", score_tokens=[5, text, 0]))["choices"][0]["logprobs"]
    assert lp["score_token_ids"] == [5, tid, 0]
    ids = [label_id(t) for t in lp["tokens"]]
    assert lp["token_scores"][0] is None
    for i in range(1, len(ids)):
        r = row(lp["distributions"][i])
        assert lp["token_scores"][i] == [float(r[5]), float(r[tid]), float(r[0])]
    # scores alone (no distribution, no tables), of the tokens actually there: echo's floats
    alone = ok(tiny_server, prompt=PROMPT + " scores", echo=True, max_tokens=0, score_tokens=ids[1:6],
               return_tokens_as_token_ids=True)["choices"][0]["logprobs"]
    assert "distributions" not in alone and alone["top_logprobs"][1] is None
    for i in range(1, 6):
        assert alone["token_scores"][i][i - 1] == lp["token_logprobs"][i]


def test_score_tokens_refused_by_name(tiny_server):
    e = err(tiny_server, prompt="x", max_tokens=1, score_tokens=["no such token text here"])
    assert (e["code"], e["param"]) == ("invalid_value", "score_tokens[0]") and "not the text of one token" in e["message"]
    e = err(tiny_server, prompt="x", max_tokens=1, score_tokens=[3, VOCAB])
    assert (e["code"], e["param"]) == ("invalid_value", "score_tokens[1]")
    e = err(tiny_server, prompt="x", max_tokens=1, score_tokens=[1.5])
    assert (e["code"], e["param"]) == ("invalid_type", "score_tokens[0]")
    e = err(tiny_server, prompt="x", max_tokens=1, score_tokens=[])
    assert (e["code"], e["param"]) == ("invalid_type", "score_tokens")
    e = err(tiny_server, prompt="x", max_tokens=1, distribution="yes")
    assert (e["code"], e["param"]) == ("invalid_type", "distribution")
    assert ok(tiny_server, prompt="x", max_tokens=1)["choices"][0]["text"] is not None


def test_rows_alone_equal_rows_in_an_array_and_streamed(uncached):
    prompts = [PROMPT + " one", "The quick brown fox jumps", "Hello, world! Hello again"]
    body = rows_request(score_tokens=[1, 2, 3], max_tokens=5)
    together = ok(uncached, **{**body, "prompt": prompts})
    assert together["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    for m, p in enumerate(prompts):
        alone = ok(uncached, **{**body, "prompt": p})
        assert alone["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert alone["choices"][0]["logprobs"] == together["choices"][m]["logprobs"]
    r = complete(uncached, **{**body, "prompt": prompts[0], "stream": True})
    chunks = [e for e in sse_events(r.text) if e != "[DONE]"]
    streamed = {"distributions": [], "token_scores": [], "token_logprobs": []}
    for c in chunks:
        lp = c["choices"][0]["logprobs"]
        if lp is not None:
            for k in streamed:
                streamed[k] += lp[k]
    whole = together["choices"][0]["logprobs"]
    assert streamed == {k: whole[k] for k in streamed}


def test_the_echo_cache_does_not_answer_for_rows(tiny_server, uncached):
    """The shared server has just scored these positions (echo cache and prefix cache hold
    them); a request for rows must still get every row, the same bytes a cold server computes."""
    body = rows_request(prompt=PROMPT + " cached", score_tokens=[7])
    plain = {k: v for k, v in body.items() if k not in ("distribution", "score_tokens")}
    ok(tiny_server, **plain)
    warm = ok(tiny_server, **body)
    assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    cold = ok(uncached, **body)
    assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    lp = warm["choices"][0]["logprobs"]
    assert all(d is not None for d in lp["distributions"][1:])
    assert lp == cold["choices"][0]["logprobs"]


def test_chat_tokens_carry_rows(tiny_server):
    msgs = [{"role": "user", "content": "Say something."}]
    body = dict(model=TINY_ID, messages=msgs, max_tokens=5, temperature=0, logprobs=True, top_logprobs=3,
                distribution=True, score_tokens=[9, 10])
    j = tiny_server.post("/v1/chat/completions", json=body).json()
    lp = j["choices"][0]["logprobs"]
    assert lp["score_token_ids"] == [9, 10]
    for e in lp["content"]:
        r = row(e["distribution"])
        assert e["token_scores"] == [float(r[9]), float(r[10])]
        assert e["logprob"] in {float(v) for v in r}
        for t in e["top_logprobs"]:
            assert t["logprob"] in {float(v) for v in r}
    r = tiny_server.post("/v1/chat/completions", json={**body, "stream": True})
    content = [x for ev in sse_events(r.text) if ev != "[DONE]" for c in ev["choices"]
               if c["logprobs"] for x in c["logprobs"]["content"]]
    assert content == lp["content"]
    for extra, code in (({"logprobs": False, "top_logprobs": None}, "invalid_value"),
                        ({"prompt_logprobs": 1}, "unsupported_value")):
        r = tiny_server.post("/v1/chat/completions", json={**body, **extra})
        assert r.status_code == 400 and (r.json()["error"]["code"], r.json()["error"]["param"]) == (code, "distribution")


def test_distribution_bound_named(servers, tiny_model_dir):
    bounded = servers.get(tiny_args(tiny_model_dir, "--no-prefix-cache", "--max-distribution-floats", str(10 * VOCAB)))
    e = err(bounded, **rows_request())
    assert (e["code"], e["param"]) == ("invalid_value", "distribution") and "--max-distribution-floats" in e["message"]
    small = ok(bounded, prompt="Hello", max_tokens=10, distribution=True, temperature=0)
    assert len(small["choices"][0]["logprobs"]["distributions"]) == small["usage"]["completion_tokens"]


def test_rows_frame_bound_fits_the_largest_vocabulary():
    """The pipe's TOKEN and ECHO bounds hold one row of the largest vocabulary a distribution
    is offered for, beside its table and scores."""
    from probity import protocol as P

    e = {"id": 1, "bytes": "41", "logprob": -1.0, "top": [[i, "41", -1.0] for i in range(P.MAX_TOP)],
         "dist": base64.b64encode(bytes(4 * P.MAX_DIST_VOCAB)).decode(), "scores": [-1.0] * P.MAX_SCORE_TOKENS}
    assert len(P.encode("TOKEN", 1, {"member": 0, "choice": 0, "tokens": [e]})) < P.KINDS["TOKEN"].max_payload
    assert len(P.encode("ECHO", 1, {"member": 0, "start": 1, "positions": [e]})) < P.KINDS["ECHO"].max_payload
    assert len(P.entry_chunks("TOKEN", [e] * 3, P.MAX_TOKEN_ENTRIES)) == 3
    with pytest.raises(P.SchemaError):
        P.KINDS["TOKEN"].schema({"member": 0, "choice": 0, "tokens": [{**e, "dist": "not base64!"}]}, "TOKEN")
