"""Structured outputs, tools and chat prompt logprobs (issue 28), through the official clients, on
the tiny model with a Hermes-style (Qwen2.5-like) tools template. Outputs are checked with
`jsonschema`, an independent validator; numbers are compared on raw bits against the
unconstrained model's own scoring of the same tokens."""
from __future__ import annotations

import concurrent.futures
import json
import shutil
from pathlib import Path

import httpx
import jsonschema
import pytest

from conftest import tiny_args
from helpers import PROBE_WORK, add, cold, engine_work

TEMPLATE = Path(__file__).parent / "tools_template.jinja"


@pytest.fixture(scope="module")
def tools_model(tiny_model_dir, tmp_path_factory) -> Path:
    """The tiny model with a chat template that renders tools (and room for their description)."""
    d = tmp_path_factory.mktemp("models") / "tiny-tools"
    shutil.copytree(tiny_model_dir, d)
    (d / "chat_template.jinja").write_text(TEMPLATE.read_text())
    cfg = json.loads((d / "config.json").read_text())
    cfg["max_position_embeddings"] = 2048
    (d / "config.json").write_text(json.dumps(cfg))
    return d


@pytest.fixture(scope="module")
def server(servers, tools_model):
    return servers.get(tiny_args(tools_model))


@pytest.fixture(scope="module")
def client(server):
    import openai
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def aclient(server):
    import anthropic
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)


def model_id(client) -> str:
    return client.models.list().data[0].id


NAME = {"type": "string", "maxLength": 6}
SCHEMAS = {
    "nested": {"type": "object", "properties": {
        "person": {"type": "object", "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 99}},
                   "required": ["name", "age"], "additionalProperties": False}},
        "required": ["person"], "additionalProperties": False},
    "array_enum": {"type": "object", "properties": {
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 3},
        "mode": {"enum": ["on", "off"]}}, "required": ["tags", "mode"], "additionalProperties": False},
    "bounded_numbers": {"type": "object", "properties": {
        "n": {"type": "integer", "minimum": -5, "maximum": 5}, "ok": {"type": "boolean"}},
        "required": ["n", "ok"], "additionalProperties": False},
    "optional": {"type": "object", "properties": {"a": NAME, "b": {"type": "integer", "minimum": 0, "maximum": 9}},
                 "required": ["a"], "additionalProperties": False},
    "ref": {"$defs": {"pt": {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9},
                                                              "y": {"type": "integer", "minimum": 0, "maximum": 9}},
                             "required": ["x", "y"], "additionalProperties": False}},
            "type": "object", "properties": {"a": {"$ref": "#/$defs/pt"}, "b": {"$ref": "#/$defs/pt"}},
            "required": ["a", "b"], "additionalProperties": False},
}


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_json_schema_outputs_validate(client, name):
    schema = SCHEMAS[name]
    r = client.chat.completions.create(
        model=model_id(client), messages=[{"role": "user", "content": "Give me JSON."}], max_tokens=150, n=4,
        seed=7, temperature=1.0,
        response_format={"type": "json_schema", "json_schema": {"name": name, "schema": schema}})
    for c in r.choices:
        assert c.finish_reason == "stop", c.message.content
        jsonschema.validate(json.loads(c.message.content), schema)


def test_json_object_and_vllm_extensions(client, server):
    m = model_id(client)
    r = client.chat.completions.create(model=m, messages=[{"role": "user", "content": "x"}], max_tokens=200, seed=3,
                                       response_format={"type": "json_object"})
    if r.choices[0].finish_reason == "stop":
        assert type(json.loads(r.choices[0].message.content)) is dict
    else:
        assert r.choices[0].message.content.startswith("{")
    r = client.completions.create(model=m, prompt="x", max_tokens=30, n=3, seed=1,
                                  extra_body={"structured_outputs": {"regex": "[0-9]{3}-[a-z]{2}"}})
    import re
    for c in r.choices:
        assert c.finish_reason == "stop" and re.fullmatch("[0-9]{3}-[a-z]{2}", c.text), c.text
    r = client.completions.create(model=m, prompt="x", max_tokens=30, n=4, seed=2,
                                  extra_body={"structured_outputs": {"choice": ["alpha", "beta gamma"]}})
    assert {c.text for c in r.choices} <= {"alpha", "beta gamma"}
    r = client.completions.create(model=m, prompt="x", max_tokens=30, seed=2,
                                  extra_body={"structured_outputs": {"grammar": 'start: "yes" | "no" " " "way"'}})
    assert r.choices[0].text in ("yes", "no way")


def _ids_and_values(choice) -> tuple[list[str], list[float]]:
    lp = choice.logprobs
    return lp.tokens, lp.token_logprobs


def test_reported_values_are_the_raw_distribution(client, server):
    """The mask decides what is drawn, never what is reported: every constrained token's
    logprob is the very float the unconstrained model gives it at that prefix (echo scoring)."""
    m = model_id(client)
    body = {"model": m, "prompt": "Paris is", "max_tokens": 40, "seed": 5, "logprobs": 3,
            "return_tokens_as_token_ids": True,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMAS["nested"]}}}
    out = cold(server, **body)["choices"][0]
    gen_ids = [int(t.split(":")[1]) for t in out["logprobs"]["tokens"]]
    prompt_ids = server.post("/tokenize", {"model": m, "prompt": "Paris is"}).json()["tokens"]
    scored = cold(server, model=m, prompt=prompt_ids + gen_ids, max_tokens=0, echo=True, logprobs=3,
                  return_tokens_as_token_ids=True)["choices"][0]
    tail = len(gen_ids)
    assert scored["logprobs"]["token_logprobs"][-tail:] == out["logprobs"]["token_logprobs"]
    assert scored["logprobs"]["top_logprobs"][-tail:] == out["logprobs"]["top_logprobs"]
    for tok, lp, top in zip(out["logprobs"]["tokens"], out["logprobs"]["token_logprobs"], out["logprobs"]["top_logprobs"]):
        assert tok in top and top[tok] == lp  # the chosen token sits in its own table with the same float


def test_constrained_alone_equals_batched_with_unconstrained(server):
    m = server.get("/v1/models").json()["data"][0]["id"]
    constrained = {"model": m, "messages": [{"role": "user", "content": "JSON please"}], "max_tokens": 60, "seed": 11,
                   "logprobs": True, "top_logprobs": 2,
                   "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMAS["ref"]}}}
    free = {"model": m, "messages": [{"role": "user", "content": "Say anything at all"}], "max_tokens": 60, "seed": 3,
            "logprobs": True, "top_logprobs": 2}
    alone = cold(server, "/v1/chat/completions", **constrained)["choices"][0]
    with concurrent.futures.ThreadPoolExecutor(4) as ex:
        futs = [ex.submit(cold, server, "/v1/chat/completions", **free) for _ in range(3)]
        mixed = ex.submit(cold, server, "/v1/chat/completions", **constrained)
        others = [f.result()["choices"][0] for f in futs]
        batched = mixed.result()["choices"][0]
    assert batched["message"]["content"] == alone["message"]["content"]
    assert batched["logprobs"] == alone["logprobs"]   # floats compared exactly (JSON round-trips float32 values)
    assert all(o["message"]["content"] == others[0]["message"]["content"] for o in others)


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city", "parameters": {
    "type": "object", "properties": {"city": NAME, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The time in a zone", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}
SCHEMA_OF = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_forced_tool_calls_parse_validate_and_stream_alike(client, tool_choice):
    m = model_id(client)
    kw = dict(model=m, messages=[{"role": "user", "content": "What is the weather?"}], tools=[WEATHER, TIME],
              tool_choice=tool_choice, max_tokens=200, seed=4, parallel_tool_calls=False)
    r = client.chat.completions.create(**kw)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    assert len(c.message.tool_calls) == 1
    call = c.message.tool_calls[0]
    if isinstance(tool_choice, dict):
        assert call.function.name == "get_time"
    jsonschema.validate(json.loads(call.function.arguments), SCHEMA_OF[call.function.name])
    calls: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(**kw, stream=True):
        for ch in chunk.choices:
            finish = ch.finish_reason or finish
            for d in ch.delta.tool_calls or []:
                acc = calls.setdefault(d.index, {"name": "", "arguments": "", "id": None})
                acc["id"] = d.id or acc["id"]
                acc["name"] += (d.function.name or "") if d.function else ""
                acc["arguments"] += (d.function.arguments or "") if d.function else ""
    assert finish == "tool_calls"
    assert [(v["name"], v["arguments"]) for _, v in sorted(calls.items())] == [
        (x.function.name, x.function.arguments) for x in c.message.tool_calls]
    assert all(v["id"].startswith("call_") for v in calls.values())


def test_parallel_calls_and_tool_results_in_the_conversation(client, server):
    m = model_id(client)
    r = client.chat.completions.create(model=m, messages=[{"role": "user", "content": "weather and time"}],
                                       tools=[WEATHER, TIME], tool_choice="required", max_tokens=400, seed=9)
    c = r.choices[0]
    if c.finish_reason == "tool_calls":
        for call in c.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), SCHEMA_OF[call.function.name])
    history = [{"role": "user", "content": "weather?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "c1", "type": "function", "function": {"name": "get_weather",
                                                                  "arguments": '{"city": "Oslo", "days": 2}'}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "snow"}]
    rendered = server.post("/v1/chat/completions", {"model": m, "messages": history, "tools": [WEATHER], "max_tokens": 1,
                                                    "prompt_logprobs": 0}).json()
    text = server.post("/detokenize", {"model": m, "tokens": rendered["prompt_token_ids"]}).json()["prompt"]
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n</tool_call>' in text
    assert "<tool_response>\nsnow\n</tool_response>" in text and '"name": "get_time"' not in text


def test_auto_keeps_text_that_is_not_a_call(client):
    r = client.chat.completions.create(model=model_id(client), messages=[{"role": "user", "content": "hello"}],
                                       tools=[WEATHER], max_tokens=12, seed=1, temperature=0)
    c = r.choices[0]
    assert c.message.tool_calls is None and c.finish_reason in ("stop", "length") and c.message.content


@pytest.mark.parametrize("body,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "strict": True, "schema": {
        "type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/$defs/gone"}}}},
     "response_format.json_schema.schema"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "tool", "tool_call_id": "zz", "content": "y"}]},
     "messages[1].tool_call_id"),
])
def test_bad_requests_are_named_before_any_engine_work(server, body, param):
    """(The engine's own counters move by the probe's work alone: the refused request ran nothing.)"""
    m = server.get("/v1/models").json()["data"][0]["id"]
    before = engine_work(server, m)
    r = server.post("/v1/chat/completions", {"model": m, "messages": [{"role": "user", "content": "x"}], **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert engine_work(server, m) == add(before, PROBE_WORK)
    health = server.get("/health").json()
    assert health["status"] == "ok" and health["engine"]["in_flight"] == 0, health


def test_a_grammar_that_cannot_begin_is_refused_and_one_that_runs_dry_ends_by_name(client, server):
    """A schema that only refers to itself admits no value: refused before ACCEPT, naming the
    schema (nothing runs, the engine serves on). A grammar whose only way on has no end
    ("a", then "b" forever with no base) accepts its first token and then cannot go on: the
    choice ends with finish_reason grammar_dead_end, never a hang."""
    import openai
    m = model_id(client)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=m, messages=[{"role": "user", "content": "x"}], max_tokens=20,
                                       response_format={"type": "json_schema", "json_schema": {
                                           "name": "loop", "schema": {"$ref": "#"}}})
    assert e.value.body["param"] == "response_format.json_schema.schema"
    assert "admits no output" in e.value.body["message"]
    r = client.completions.create(model=m, prompt="x", max_tokens=20,
                                  extra_body={"structured_outputs": {"grammar": 'start: "a" x\nx: "b" x'}})
    assert r.choices[0].finish_reason == "grammar_dead_end" and r.choices[0].text.startswith("a")
    h = server.get("/health").json()
    assert h["status"] == "ok" and h["engine"]["in_flight"] == 0
    assert client.chat.completions.create(model=m, messages=[{"role": "user", "content": "x"}],
                                          max_tokens=2).choices[0].finish_reason == "length"


def test_enormous_schema_is_refused_by_name(server):
    m = server.get("/v1/models").json()["data"][0]["id"]
    props = {f"p{i}": {"enum": [f"v{i}_{j}" for j in range(200)]} for i in range(2000)}
    r = server.post("/v1/chat/completions", {"model": m, "messages": [{"role": "user", "content": "x"}],
                                             "response_format": {"type": "json_schema", "json_schema": {
                                                 "name": "big", "schema": {"type": "object", "properties": props}}}},
                    timeout=120)
    assert r.status_code in (400, 413), r.text
    assert server.post("/v1/chat/completions", {"model": m, "messages": [{"role": "user", "content": "x"}],
                                                "max_tokens": 2}).status_code == 200


def test_anthropic_tools(aclient, server):
    m = server.get("/v1/models").json()["data"][0]["id"]
    tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
              "input_schema": t["function"]["parameters"]} for t in (WEATHER, TIME)]
    kw = dict(model=m, max_tokens=200, messages=[{"role": "user", "content": "weather?"}], tools=tools, extra_body={"temperature": 0},
              tool_choice={"type": "any", "disable_parallel_tool_use": True})
    msg = aclient.messages.create(**kw)
    assert msg.stop_reason == "tool_use"
    uses = [b for b in msg.content if b.type == "tool_use"]
    assert len(uses) == 1 and uses[0].id.startswith("toolu_")
    jsonschema.validate(uses[0].input, SCHEMA_OF[uses[0].name])
    with aclient.messages.stream(**kw) as s:
        final = s.get_final_message()
    assert final.stop_reason == "tool_use"
    def blocks(m):   # ids are fresh per answer; everything else must agree
        return [(b.type, getattr(b, "text", None), getattr(b, "name", None), getattr(b, "input", None))
                for b in m.content]
    assert blocks(final) == blocks(msg)
    named = aclient.messages.create(**{**kw, "tool_choice": {"type": "tool", "name": "get_time",
                                                              "disable_parallel_tool_use": True}})
    assert [b.name for b in named.content if b.type == "tool_use"] == ["get_time"]
    follow = aclient.messages.create(model=m, max_tokens=3, tools=tools, messages=[
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "get_weather",
                                           "input": {"city": "Rome", "days": 1}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "rain"}]}])
    assert follow.stop_reason in ("end_turn", "max_tokens")
    with_tools = aclient.messages.count_tokens(model=m, messages=[{"role": "user", "content": "w?"}], tools=tools)
    without = aclient.messages.count_tokens(model=m, messages=[{"role": "user", "content": "w?"}])
    assert with_tools.input_tokens > without.input_tokens + 50
    import anthropic
    with pytest.raises(anthropic.BadRequestError) as e:
        aclient.messages.create(model=m, max_tokens=3, tools=tools, messages=[
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "nope", "content": "x"}]}])
    assert e.value.status_code == 400


def test_chat_prompt_logprobs_equal_completion_echo(server):
    """vLLM's prompt_logprobs on chat: the rendered prompt's values, bit for bit the values
    /v1/completions' echo gives the same token ids, and the template's tokens marked."""
    m = server.get("/v1/models").json()["data"][0]["id"]
    content = "Paris is the capital of France."
    chat = cold(server, "/v1/chat/completions", model=m, messages=[{"role": "user", "content": content}],
                max_tokens=1, prompt_logprobs=2)
    ids = chat["prompt_token_ids"]
    echo = cold(server, model=m, prompt=ids, max_tokens=0, echo=True, logprobs=2,
                return_tokens_as_token_ids=True)["choices"][0]["logprobs"]
    assert chat["prompt_logprobs"][0] is None and echo["token_logprobs"][0] is None
    for j in range(1, len(ids)):
        entry = chat["prompt_logprobs"][j]
        assert entry[str(ids[j])]["logprob"] == echo["token_logprobs"][j]
        tops = {int(k.split(":")[1]): v for k, v in echo["top_logprobs"][j].items()}
        for tid, v in tops.items():
            assert entry[str(tid)]["logprob"] == v
        best = sorted((t for t in tops if t != ids[j] or len(tops) == 2), key=lambda t: (-tops[t], t))[:2]
        assert [entry[str(t)]["rank"] for t in best] == [1, 2][:len(best)]
        assert entry[str(ids[j])]["rank"] == (best.index(ids[j]) + 1 if ids[j] in best else None)
    mask = chat["prompt_template_mask"]
    content_ids = [t for t, is_template in zip(ids, mask) if not is_template]
    said = server.post("/detokenize", {"model": m, "tokens": content_ids}).json()["prompt"]
    assert said == content and any(mask)


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n</tool_call>'
OUTPUTS = [
    ("hermes", "Let me look.\n" + CALL),
    ("hermes", CALL + "\n" + CALL.replace("Oslo", "Rome")),
    ("hermes", "No call here, just <tool_ text."),
    ("hermes", "<tool_call>\n{not json}\n</tool_call>"),
    ("hermes", '<tool_call>\n{"name": "unknown", "arguments": {}}\n</tool_call>'),
    ("hermes", "trailing <tool_c"),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Oslo", "days": 1}}'),
    ("llama3_json", '<|python_tag|>{"name": "get_time", "parameters": {"zone": "UTC"}}; '
                    '{"name": "get_weather", "parameters": {"city": "X", "days": 3}}'),
    ("llama3_json", "  Plain words {not a call}"),
    ("mistral", 'Sure [TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "CET"}}]'),
]


@pytest.mark.parametrize("fmt,text", OUTPUTS)
def test_streamed_text_and_calls_equal_the_parsed_whole(fmt, text):
    """However the text arrives, what streaming sends as content plus the calls it finds equal
    find_calls on the whole output (what a non-streamed answer returns)."""
    import random
    from probity.server.tools import ToolText, find_calls, parse_tools
    spec = parse_tools([WEATHER, TIME], "auto", None, fmt)
    content, calls = find_calls(text, spec)
    for seed in range(20):
        rnd = random.Random(seed)
        t, sent, at = ToolText(spec), "", 0
        while at < len(text):
            n = rnd.randint(1, 6)
            sent += t.add(text[at:at + n])
            at += n
        found = find_calls(t.seen, spec)[1] if t.held else []
        if not found:
            sent += t.pending
        assert sent == (content if calls else text), (seed, sent)
        assert [(c.name, c.arguments) for c in found] == [(c.name, c.arguments) for c in calls]


def test_constrained_logprobs_report_the_grammars_renormalised_distribution(server):
    """The opt-in: the same tokens as without it (the draw does not change), every table entry
    an allowed token, probabilities summing to 1 where the table holds every allowed token, and
    any two tokens keeping the raw distribution's difference."""
    import math
    m = server.get("/v1/models").json()["data"][0]["id"]
    body = {"model": m, "prompt": "Answer:", "max_tokens": 8, "seed": 3, "logprobs": 32,
            "return_tokens_as_token_ids": True, "structured_outputs": {"regex": "(yes|no|maybe)[.!]"}}
    raw = cold(server, **body)["choices"][0]
    con = cold(server, **body, constrained_logprobs=True)["choices"][0]
    assert con["text"] == raw["text"] and con["logprobs"]["tokens"] == raw["logprobs"]["tokens"]
    assert con["text"].rstrip(".!") in ("yes", "no", "maybe")
    answers = [w + e for w in ("yes", "no", "maybe") for e in ".!"]
    said = ""

    def text_of(label: str) -> str:
        return server.post("/detokenize", {"model": m, "tokens": [int(label.split(":")[1])]}).json()["prompt"]
    for j, (r, c) in enumerate(zip(raw["logprobs"]["top_logprobs"], con["logprobs"]["top_logprobs"])):
        for label in c:   # only what the regex allows from here
            assert any(a.startswith(said + text_of(label)) for a in answers), (said, text_of(label))
        said += text_of(con["logprobs"]["tokens"][j])
        if len(c) < 32:   # the whole allowed set is in the table
            assert abs(sum(math.exp(v) for v in c.values()) - 1) < 1e-5
        ids = sorted(c)
        for a, b in zip(ids, ids[1:]):
            if a in r and b in r:
                assert abs((c[a] - c[b]) - (r[a] - r[b])) < 1e-5
        tok = con["logprobs"]["tokens"][j]
        assert c[tok] == con["logprobs"]["token_logprobs"][j] and c[tok] >= r[tok]
    r = server.post("/v1/completions", {"model": m, "prompt": "x", "constrained_logprobs": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "constrained_logprobs"


FORCED = [
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "O\\"s{lo}", "days": 2}}\n</tool_call>'
               '\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'),
    ("hermes", '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "[x]", "days": 7}}; '
                    '{"name": "get_time", "parameters": {"zone": "UTC"}}'),
]


@pytest.mark.parametrize("fmt,text", FORCED)
def test_forced_calls_stream_as_written_and_join_to_the_whole(fmt, text):
    """A forced call's parts go out as the model writes them; however the text arrives, the
    fragments join to the arguments find_calls gives the whole output (the model's own text)."""
    import random
    from probity.server.tools import ToolText, find_calls, parse_tools
    spec = parse_tools([WEATHER, TIME], "required", None, fmt)
    _, calls = find_calls(text, spec)
    assert calls and all(json.loads(c.arguments) for c in calls)
    for seed in range(20):
        rnd = random.Random(seed)
        t, at, names, args, ends = ToolText(spec), 0, {}, {}, []
        while at < len(text):
            n = rnd.randint(1, 7)
            assert t.add(text[at:at + n]) == ""   # a forced answer has no content
            at += n
            for ev in t.events:
                if ev[0] == "start":
                    names[ev[1]] = ev[3]
                elif ev[0] == "args":
                    args[ev[1]] = args.get(ev[1], "") + ev[2]
                else:
                    ends.append(ev[1])
            t.events.clear()
        assert [(names[i], args[i]) for i in sorted(names)] == [(c.name, c.arguments) for c in calls]
        assert ends == sorted(names)


def test_the_server_process_stays_free_of_torch():
    """Grammars are checked in the server with llguidance alone: importing the server must not
    pull in torch or the engine (the server is ~50 MiB resident; torch alone is hundreds)."""
    import subprocess
    import sys
    code = ("import sys, probity.server.app; "
            "print(sorted(m for m in ('torch', 'probity.engine.grammar', 'probity.engine.engine') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
