"""Batch jobs (issue 40, 3; docs/api.md, Batch jobs): /v1/files and /v1/batches through the
official openai SDK unmodified, a 1,000-line batch that survives its engine SIGKILLed and its
server killed and started again, bad input named per line, bounds, cancel, and the
`probity batch` command.

The reference for every line is the same request sent directly to a server on the same
model: its `choices` (text, logprobs, finish reasons — raw floats, compared as parsed JSON
numbers, which round-trip exactly) and token counts must be equal. Only what names the response
itself (`id`, `created`) and `usage.prompt_tokens_details.cached_tokens` (what the prefix cache
happened to hold; it changes no number) may differ.

Seen failing against deliberate breaks: results recovered without the half-written last
line cut off (the restart test: a JSON error); every result line's id without its line number
(lines run twice after the restart: 1,000+ output lines)."""
from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys

import pytest

from conftest import ROOT, TINY_ID, tiny_args
from helpers import poll

PROMPTS = ["Paris is the capital of", "The quick brown fox", "Hello, world! Hello", "def f(x):\n   ",
           "Numbers 0 1 2 3", "Prices: 5€, 10£", "Emoji: 😀🚀", "日本語のテキスト"]


def mixed_lines(count: int) -> list[dict]:
    """Completions with echo and tables, seeded sampling with n = 2, chat with logprobs."""
    out = []
    for i in range(count):
        p = PROMPTS[i % len(PROMPTS)] + f" {i}"
        kind = i % 3
        if kind == 0:
            url, body = "/v1/completions", {"prompt": p, "echo": True, "logprobs": 3, "max_tokens": 12,
                                            "temperature": 0}
        elif kind == 1:
            url, body = "/v1/completions", {"prompt": p, "max_tokens": 12, "n": 2, "seed": 1000 + i,
                                            "logprobs": 2, "temperature": 0.9}
        else:
            url, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": p}], "max_tokens": 12,
                                                 "logprobs": True, "top_logprobs": 2, "seed": i}
        out.append({"custom_id": f"req-{i}", "method": "POST", "url": url, "body": {"model": TINY_ID, **body}})
    return out


def jsonl(lines: list) -> bytes:
    return b"".join((x if isinstance(x, bytes) else json.dumps(x).encode()) + b"\n" for x in lines)


def comparable(resp: dict) -> dict:
    usage = {k: v for k, v in resp["usage"].items() if k != "prompt_tokens_details"}
    return {"choices": resp["choices"], "usage": usage, "model": resp["model"],
            "system_fingerprint": resp["system_fingerprint"], "object": resp["object"]}


def direct(server, line: dict) -> dict:
    r = server.post(line["url"], json=line["body"])
    assert r.status_code == 200, r.text
    return r.json()


def client(server):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def batch_server(servers, tiny_model_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("batches")
    return servers.get(tiny_args(tiny_model_dir, "--batch-dir", str(d)))


def wait_done(c, batch_id: str, within: float = 300.0):
    return poll(lambda: (b := c.batches.retrieve(batch_id)).status in ("completed", "failed", "cancelled") and b,
                within, what=lambda: c.batches.retrieve(batch_id).model_dump())


def test_openai_sdk_runs_a_batch_and_each_line_equals_the_direct_request(batch_server, tiny_server):
    c = client(batch_server)
    lines = mixed_lines(24)
    bad = [b"{not json", json.dumps({"custom_id": "u", "method": "POST", "url": "/v1/embeddings", "body": {}}).encode(),
           json.dumps({**lines[0], "custom_id": "other-model", "body": {**lines[0]["body"], "model": "gpt-9"}}).encode(),
           json.dumps(lines[1]).encode(),  # custom_id req-1 again
           json.dumps({**lines[2], "custom_id": "s", "body": {**lines[2]["body"], "stream": True}}).encode(),
           json.dumps({**lines[0], "custom_id": "bad-temp", "body": {**lines[0]["body"], "temperature": 9}}).encode()]
    f = c.files.create(file=("requests.jsonl", io.BytesIO(jsonl(lines + bad))), purpose="batch")
    assert (f.object, f.purpose, f.bytes) == ("file", "batch", len(jsonl(lines + bad)))
    assert c.files.retrieve(f.id).id == f.id and f.id in [x.id for x in c.files.list(purpose="batch")]
    b = c.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h",
                         metadata={"eval": "t1"})
    assert b.status in ("validating", "in_progress") and b.request_counts.total == len(lines) + len(bad)
    b = wait_done(c, b.id)
    assert b.status == "completed" and b.metadata == {"eval": "t1"}, b
    assert (b.request_counts.completed, b.request_counts.failed) == (len(lines), len(bad))
    want = [direct(tiny_server, x)["usage"] for x in lines]
    assert (b.usage.input_tokens, b.usage.output_tokens, b.usage.total_tokens) == \
        tuple(sum(u[k] for u in want) for k in ("prompt_tokens", "completion_tokens", "total_tokens"))
    assert b.id in [x.id for x in c.batches.list()]
    out = [json.loads(x) for x in c.files.content(b.output_file_id).text.splitlines()]
    assert sorted(r["custom_id"] for r in out) == sorted(x["custom_id"] for x in lines)
    by_id = {x["custom_id"]: x for x in lines}
    for r in out:
        assert r["error"] is None and r["response"]["status_code"] == 200
        assert comparable(r["response"]["body"]) == comparable(direct(tiny_server, by_id[r["custom_id"]]))
    errs = {r["custom_id"]: r for r in (json.loads(x) for x in c.files.content(b.error_file_id).text.splitlines())}
    assert errs[None]["error"]["code"] == "invalid_json_line" and "line 25" in errs[None]["error"]["message"]
    assert errs["u"]["error"]["code"] == "invalid_url"
    assert errs["req-1"]["error"]["code"] == "duplicate_custom_id"
    assert errs["s"]["error"]["code"] == "invalid_line" and "stream" in errs["s"]["error"]["message"]
    # a request the route refuses is answered as the route answers it, in the error file
    assert errs["other-model"]["response"]["status_code"] == 404
    assert errs["other-model"]["response"]["body"]["error"]["code"] == "model_not_found"
    assert errs["bad-temp"]["response"]["body"]["error"]["param"] == "temperature"
    # once its batch has ended, an input can be deleted (while it runs: test_bounds_and_cancel)
    assert c.files.delete(f.id).deleted
    with pytest.raises(Exception) as e:
        c.files.retrieve(f.id)
    assert getattr(e.value, "status_code", None) == 404


def test_bad_uploads_and_batches_are_named(batch_server):
    import openai

    c = client(batch_server)
    with pytest.raises(openai.BadRequestError) as e:
        c.files.create(file=("x.jsonl", io.BytesIO(b"{}\n")), purpose="fine-tune")
    assert e.value.body["code"] == "unsupported_value" and e.value.body["param"] == "purpose"
    with pytest.raises(openai.NotFoundError):
        c.batches.create(input_file_id="file-nope", endpoint="/v1/completions", completion_window="24h")
    f = c.files.create(file=("x.jsonl", io.BytesIO(jsonl(mixed_lines(1)))), purpose="batch")
    for kw, param in (({"endpoint": "/v1/embeddings"}, "endpoint"), ({"completion_window": "1h"}, "completion_window")):
        args = {"input_file_id": f.id, "endpoint": "/v1/completions", "completion_window": "24h", **kw}
        with pytest.raises(openai.BadRequestError) as e:
            c.batches.create(**args)
        assert e.value.body["param"] == param
    b = wait_done(c, c.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h").id)
    with pytest.raises(openai.ConflictError):
        c.batches.cancel(b.id)
    r = batch_server.post("/v1/files", content=b"not multipart", headers={"content-type": "text/plain"})
    assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type"


def test_bounds_and_cancel(servers, tiny_model_dir, tmp_path):
    import openai

    # two sequences at a time, 200 tokens each: the job is still running when it is cancelled
    s = servers.get(tiny_args(tiny_model_dir, "--batch-dir", str(tmp_path), "--max-file-mib", "0.05",
                              "--batch-disk-mib", "0.3", "--max-running", "2"))
    c = client(s)
    with pytest.raises(openai.APIStatusError) as e:
        c.files.create(file=("big.jsonl", io.BytesIO(b"x" * 60000)), purpose="batch")
    assert e.value.status_code == 413 and e.value.body["code"] == "request_too_large"
    data = jsonl([{"custom_id": f"l{i}", "method": "POST", "url": "/v1/completions",
                   "body": {"model": TINY_ID, "prompt": f"line {i}", "max_tokens": 200, "temperature": 0}}
                  for i in range(400)])[:45000]
    data = data[:data.rfind(b"\n") + 1]
    files = []
    with pytest.raises(openai.BadRequestError) as e:
        for _ in range(8):
            files.append(c.files.create(file=("a.jsonl", io.BytesIO(data)), purpose="batch"))
    assert e.value.body["code"] == "storage_full" and len(files) == 6
    for f in files[1:]:
        c.files.delete(f.id)
    b = c.batches.create(input_file_id=files[0].id, endpoint="/v1/completions", completion_window="24h")
    poll(lambda: c.batches.retrieve(b.id).request_counts.completed >= 5, 120)
    with pytest.raises(openai.ConflictError):
        c.files.delete(files[0].id)
    assert c.batches.cancel(b.id).status in ("cancelling", "cancelled")
    b = wait_done(c, b.id)
    assert b.status == "cancelled" and b.cancelled_at is not None
    done = b.request_counts.completed + b.request_counts.failed
    assert 5 <= done < b.request_counts.total
    assert len(c.files.content(b.output_file_id).text.splitlines()) == b.request_counts.completed


def test_a_batch_survives_its_engine_killed_and_its_server_restarted(servers, tiny_model_dir, tmp_path, tiny_server):
    """1,000 mixed lines; the engine SIGKILLed a tenth of the way in, the whole server (and its
    engine) SIGKILLed at ~40 %, a new server started on the same --batch-dir: the job ends
    completed, every line answered once, each answer equal to the direct request's."""
    # two sequences at a time: the job takes long enough (~30 s) to be killed twice midway
    args = tiny_args(tiny_model_dir, "--batch-dir", str(tmp_path), "--max-running", "2")
    s = servers.fresh(args)
    c = client(s)
    lines = mixed_lines(1000)
    f = c.files.create(file=("eval.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")
    b = c.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
    poll(lambda: c.batches.retrieve(b.id).request_counts.completed >= 100, 300)
    engine = s.engine_pid()
    os.kill(engine, signal.SIGKILL)
    poll(lambda: s.get("/health").status_code == 200 and s.engine_pid() != engine, 120, "engine restarted")
    poll(lambda: c.batches.retrieve(b.id).request_counts.completed >= 400, 300)
    os.killpg(s.proc.pid, signal.SIGKILL)
    s.proc.wait()
    at_kill = json.loads((tmp_path / "batches" / f"{b.id}.json").read_text())
    assert at_kill["status"] == "in_progress"
    # a kill mid-write leaves half a result line: the new server cuts it off and runs that line again
    with open(tmp_path / "files" / f"{at_kill['_files']['output']}.jsonl", "ab") as half:
        half.write(b'{"id": "batch_req_' + b.id.removeprefix("batch_").encode() + b'_999", "custom_id": "req-9')
    s2 = servers.fresh(args)
    c2 = client(s2)
    assert c2.batches.retrieve(b.id).status in ("in_progress", "finalizing", "completed")
    b = wait_done(c2, b.id, 600)
    assert b.status == "completed", b
    assert (b.request_counts.completed, b.request_counts.failed, b.request_counts.total) == (1000, 0, 1000)
    out = [json.loads(x) for x in c2.files.content(b.output_file_id).text.splitlines()]
    assert len(out) == 1000 and len({r["custom_id"] for r in out}) == 1000
    assert (b.usage.output_tokens, b.usage.total_tokens) == (  # lines answered before the kills count once
        sum(r["response"]["body"]["usage"]["completion_tokens"] for r in out),
        sum(r["response"]["body"]["usage"]["total_tokens"] for r in out))
    by_id = {x["custom_id"]: x for x in lines}
    for r in out[::7]:   # a spread of them against the direct request (all of them: 3x longer)
        assert comparable(r["response"]["body"]) == comparable(direct(tiny_server, by_id[r["custom_id"]]))


def test_probity_batch_command_writes_every_line_in_input_order(tiny_model_dir, tmp_path, tiny_server):
    lines = mixed_lines(12) + [{"custom_id": "bad", "method": "GET", "url": "/v1/completions", "body": {}}]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_bytes(jsonl(lines))
    r = subprocess.run([sys.executable, "-m", "probity", "batch", str(inp), str(out), "--model", str(tiny_model_dir),
                        "--threads", "1"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "12 of 13 lines answered, 1 failed" in r.stderr
    got = [json.loads(x) for x in out.read_text().splitlines()]
    assert [g["custom_id"] for g in got] == [x["custom_id"] for x in lines]
    for g, line in zip(got[:-1], lines):
        assert comparable(g["response"]["body"]) == comparable(direct(tiny_server, line))
    assert got[-1]["error"]["code"] == "invalid_method"

