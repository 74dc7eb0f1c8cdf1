"""A request for anything the running engine did not declare in READY is a named 400 before any SUBMIT."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest


FAKE = Path(__file__).parent / "fakes" / "fake_engine.py"


@pytest.fixture(scope="module")
def less_frames(tmp_path_factory) -> Path:
    """The frames the fake engine reads, one line each, in order."""
    log = tmp_path_factory.mktemp("fake") / "frames.log"
    log.write_text("")
    return log


@pytest.fixture
def less_server(servers, less_frames):
    s = servers.get(["--engine-command", f"{sys.executable} {FAKE} less {less_frames}"], startup=30)
    s.frames = less_frames
    return s


def submits(s) -> list[str]:
    """The SUBMIT frames the fake engine has logged, in the order it read them."""
    return [line for line in s.frames.read_text().splitlines() if line.startswith("SUBMIT ")]


def assert_no_submit_since(s, before: int) -> None:
    """Nothing reached the engine since it had logged `before` SUBMITs: a request that does
    reach it is sent now, and the pipe is ordered and the fake logs a frame before it answers,
    so any SUBMIT sent earlier would be logged before this one's."""
    r = s.post("/v1/completions", json={"model": "fake", "prompt": "sentinel", "max_tokens": 1})
    assert r.status_code == 200, r.text
    new = submits(s)[before:]
    assert len(new) == 1 and '"sentinel"' in new[0], new


@pytest.mark.parametrize("body,param", [
    ({"prompt": "hi", "logprobs": 6}, "logprobs"),
    ({"prompt": "hi", "echo": True, "max_tokens": 1}, "echo"),
    ({"prompt": [1, 2, 3]}, "prompt"),
    ({"prompt": "hi", "seed": 1}, "seed"),
    ({"prompt": ["a", "b", "c", "d", "e"]}, "prompt"),
])
def test_undeclared_capability_is_named_before_any_submit(less_server, body, param):
    before = len(submits(less_server))
    r = less_server.post("/v1/completions", json={"model": "fake", **body})
    e = r.json()["error"]
    assert r.status_code == 400 and (e["code"], e["param"]) == ("engine_capability_missing", param)
    assert_no_submit_since(less_server, before)


def test_chat_without_template_is_named(less_server):
    before = len(submits(less_server))
    r = less_server.post("/v1/chat/completions", json={"model": "fake", "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 400 and r.json()["error"]["code"] == "engine_capability_missing"
    assert_no_submit_since(less_server, before)


def test_declared_capabilities_still_work(less_server):
    r = less_server.post("/v1/completions", json={"model": "fake", "prompt": "hi", "logprobs": 5, "max_tokens": 1})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "A"


def test_unused_optional_fields_leave_submit_bytes_unchanged(less_server):
    before = len(submits(less_server))
    less_server.post("/v1/completions", json={"model": "fake", "prompt": "hi", "max_tokens": 3})
    less_server.post("/v1/completions", json={"model": "fake", "prompt": "hi", "max_tokens": 3, "temperature": 1.0,
                                              "top_p": 1, "n": 1, "stop": None, "logprobs": 0, "echo": False,
                                              "presence_penalty": 0, "frequency_penalty": 0, "user": "u",
                                              "logit_bias": {}, "stream": False, "group_score": None})
    subs = [line.split(" ", 2)[2] for line in submits(less_server)][before:]
    assert len(subs) == 2 and subs[0] == subs[1]
