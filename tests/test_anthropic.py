"""/v1/messages and count_tokens with the official anthropic SDK and raw sockets."""
from __future__ import annotations

import socket
import json

import anthropic
import pytest

from conftest import TINY_ID

MSGS = [{"role": "user", "content": "Say hello"}]


@pytest.fixture(scope="module")
def client(tiny_server):
    return anthropic.Anthropic(base_url=tiny_server.url, api_key="unused", max_retries=0)


def test_sdk_messages_create(client):
    m = client.messages.create(model=TINY_ID, max_tokens=8, messages=MSGS, system="Be brief.", extra_body={"temperature": 0})
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
    assert m.content[0].type == "text" and m.stop_reason in ("end_turn", "max_tokens", "stop_sequence")
    assert m.usage.input_tokens > 0 and m.usage.output_tokens >= 1


def test_sdk_stream_text_and_final_message(client):
    plain = client.messages.create(model=TINY_ID, max_tokens=8, messages=MSGS, extra_body={"temperature": 0})
    with client.messages.stream(model=TINY_ID, max_tokens=8, messages=MSGS, extra_body={"temperature": 0}) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == plain.content[0].text == final.content[0].text
    assert final.stop_reason == plain.stop_reason and final.usage.output_tokens == plain.usage.output_tokens


def test_sdk_count_tokens_uses_the_same_rendering(client, tiny_server):
    n = client.messages.count_tokens(model=TINY_ID, messages=MSGS, system="Be brief.").input_tokens
    m = client.messages.create(model=TINY_ID, max_tokens=1, messages=MSGS, system="Be brief.")
    assert n == m.usage.input_tokens


def test_sdk_raises_bad_request_for_an_overlong_prompt(client):
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=TINY_ID, max_tokens=8, messages=[{"role": "user", "content": "Hello " * 300}])
    assert e.value.status_code == 400 and e.value.body["error"]["type"] == "invalid_request_error"


def test_stop_sequence_reported(client):
    base = client.messages.create(model=TINY_ID, max_tokens=20, messages=MSGS, extra_body={"temperature": 0}).content[0].text
    i = next(i for i in range(1, len(base) - 1) if "\ufffd" not in base[i:i + 2])
    stop = base[i:i + 2]
    m = client.messages.create(model=TINY_ID, max_tokens=20, messages=MSGS, extra_body={"temperature": 0}, stop_sequences=[stop])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    assert m.content[0].text == base[: base.index(stop)]


@pytest.mark.parametrize("extra,param", [
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type"),
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages[0].content[0].type"),
    ({"messages": [{"role": "system", "content": "x"}]}, "messages[0].role"),
    ({"temperature": 1.5}, "temperature"),
    ({"bogus": 1}, "bogus"),
    ({"max_tokens": None}, "max_tokens"),
])
def test_refusals_use_the_anthropic_envelope(tiny_server, extra, param):
    body = {"model": TINY_ID, "max_tokens": 8, "messages": MSGS, **extra}
    r = tiny_server.post("/v1/messages", json=body)
    assert r.status_code == 400
    j = r.json()
    assert j["type"] == "error" and j["error"]["type"] == "invalid_request_error"
    assert j["error"]["message"].startswith(param + ":")


def test_metadata_is_a_documented_no_op(tiny_server):
    body = {"model": TINY_ID, "max_tokens": 5, "messages": MSGS, "temperature": 0}
    a = tiny_server.post("/v1/messages", json=body).json()["content"]
    b = tiny_server.post("/v1/messages", json={**body, "metadata": {"user_id": "u1"}},
                         headers={"anthropic-version": "2023-06-01"}).json()["content"]
    assert a == b


def test_unknown_model_is_not_found_error(tiny_server):
    r = tiny_server.post("/v1/messages", json={"model": "claude-x", "max_tokens": 5, "messages": MSGS})
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"


def raw_post(port: int, path: str, body: dict) -> bytes:
    data = json.dumps(body).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(b"POST %s HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (path.encode(), len(data), data))
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    return out


def test_raw_overlong_stream_is_400_with_no_event_bytes(tiny_server):
    out = raw_post(tiny_server.port, "/v1/messages", {
        "model": TINY_ID, "max_tokens": 8, "stream": True, "messages": [{"role": "user", "content": "Hello " * 300}]})
    assert out.startswith(b"HTTP/1.1 400 ")
    assert b"event:" not in out and out.count(b"HTTP/1.1") == 1
    assert b'"type":"error"' in out.replace(b" ", b"")


def test_raw_healthy_stream_has_the_exact_event_order(tiny_server):
    out = raw_post(tiny_server.port, "/v1/messages", {
        "model": TINY_ID, "max_tokens": 6, "stream": True, "messages": MSGS, "temperature": 0})
    assert out.startswith(b"HTTP/1.1 200 ")
    names = [line[7:].strip().decode() for line in out.split(b"\n") if line.startswith(b"event: ")]
    assert names[:3] == ["message_start", "content_block_start", "ping"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) <= {"content_block_delta", "ping"} and "content_block_delta" in names


def test_assistant_prefill_is_continued(tiny_server, tiny_hf):
    _, tok = tiny_hf
    msgs = MSGS + [{"role": "assistant", "content": "Hello, the"}]
    text = tok.apply_chat_template(msgs, tokenize=False, continue_final_message=True)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    m = tiny_server.post("/v1/messages", json={"model": TINY_ID, "max_tokens": 8, "messages": msgs,
                                               "temperature": 0}).json()
    ref = tiny_server.post("/v1/completions", json={"model": TINY_ID, "prompt": ids, "max_tokens": 8,
                                                    "temperature": 0}).json()
    assert m["usage"]["input_tokens"] == len(ids)
    assert m["content"][0]["text"] == ref["choices"][0]["text"]  # the text after the prefill, as Anthropic returns
    n = tiny_server.post("/v1/messages/count_tokens", json={"model": TINY_ID, "messages": msgs}).json()
    assert n["input_tokens"] == len(ids)


def test_prefill_ending_in_whitespace_is_refused_by_name(tiny_server):
    msgs = MSGS + [{"role": "assistant", "content": "Hello "}]
    r = tiny_server.post("/v1/messages", json={"model": TINY_ID, "max_tokens": 4, "messages": msgs})
    assert r.status_code == 400
    assert r.json()["error"]["message"].startswith("messages[1].content:")


def test_a_template_that_cannot_continue_a_prefill_is_a_named_refusal(tiny_hf):
    """A template that drops the final assistant message cannot continue it: the engine says
    so by name (BAD_REQUEST on the member, which the server reports as `messages`)."""
    import copy

    from probity.engine.work import Refusal, member_ids
    from probity.engine.vocab import Vocab

    tok = copy.deepcopy(tiny_hf[1])
    tok.chat_template = ("{% for m in messages %}{% if m['role'] != 'assistant' %}<|im_start|>{{ m['role'] }}\n"
                         "{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}<|im_start|>assistant\n")
    vocab = Vocab(tok, len(tok))
    with pytest.raises(Refusal) as e:
        member_ids({"messages": MSGS + [{"role": "assistant", "content": "Hello"}]}, 0, vocab, False)
    assert (e.value.code, e.value.param) == ("BAD_REQUEST", "members[0]")
    assert member_ids({"messages": MSGS}, 0, vocab, False)  # without a prefill it renders
