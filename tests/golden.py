"""The golden numbers: the default model's answers to fixed requests, every reported float kept
as the hex of its float32 bits (tests/golden/default_model.json). test_golden.py requires the
served answers to equal them bit for bit on every instruction-set path the CPU runs; the
README's two examples are rendered from them (`readme_blocks`), so what a reader runs is what
the README prints.

Regenerate (only when the numerics version changes, docs/engine.md): serve the default model
(`make serve`) and run `.venv/bin/python tests/golden.py write http://127.0.0.1:8000`; then
`.venv/bin/python tests/golden.py readme` prints the README's blocks."""
from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import httpx

FILE = Path(__file__).parent / "golden" / "default_model.json"
MODEL = "SmolLM2-135M-Instruct"
LONG = " ".join(f"Item {i}: the {w} of the {v} is recorded here." for i, (w, v) in enumerate(
    [("colour", "sky"), ("weight", "stone"), ("length", "river"), ("height", "tower"), ("age", "tree")] * 15))
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                           "population": {"type": "integer"}},
          "required": ["city", "population"], "additionalProperties": False}
CAPITAL = "What is the capital of France? One word."


def _c(**body) -> tuple[str, dict]:
    return "/v1/completions", {"model": MODEL, **body}


def _chat(**body) -> tuple[str, dict]:
    return "/v1/chat/completions", {"model": MODEL, **body}


# name -> (route, body); the README's examples are "readme_completion" and "readme_chat"
REQUESTS: dict[str, tuple[str, dict]] = {
    "readme_completion": _c(prompt="The capital of France is", max_tokens=3, temperature=0, echo=True, logprobs=1),
    "readme_chat": _chat(messages=[{"role": "user", "content": CAPITAL}], max_tokens=8, temperature=0,
                         logprobs=True, top_logprobs=2),
    "echo_only": _c(prompt="Logarithms turn products into sums, which is why", max_tokens=0, echo=True,
                    logprobs=5),
    "echo_greedy_top5": _c(prompt="def fibonacci(n):\n    ", max_tokens=24, temperature=0, echo=True, logprobs=5),
    "greedy_32": _c(prompt="Once upon a time, in a small village,", max_tokens=32, temperature=0, logprobs=3),
    "seeded_n3": _c(prompt="The best thing about the ocean is", max_tokens=16, temperature=0.8, seed=1234, n=3,
                    logprobs=2),
    "seeded_top_p_top_k": _c(prompt="My favourite recipe starts with", max_tokens=16, temperature=1.1, top_p=0.9,
                             top_k=40, seed=7, n=2, logprobs=1),
    "seeded_penalties": _c(prompt="List of fruits: apple, banana,", max_tokens=20, temperature=0.7, seed=99,
                           frequency_penalty=0.5, presence_penalty=0.3, logprobs=1),
    "logit_bias": _c(prompt="The answer is", max_tokens=6, temperature=0, logit_bias={"314": 5.0}, logprobs=2),
    "stop": _c(prompt="1, 2, 3, 4,", max_tokens=30, temperature=0, stop=[" 9"], logprobs=1),
    "token_prompts": _c(prompt=[[504, 3575, 282, 4649, 314], [1, 2, 3, 4, 5, 6]], max_tokens=4, temperature=0,
                        echo=True, logprobs=2),
    "long_prompt_echo": _c(prompt=LONG, max_tokens=4, temperature=0, echo=True, logprobs=1),
    "chat_greedy_top5": _chat(messages=[{"role": "system", "content": "You are terse."},
                                        {"role": "user", "content": "Name three primary colours."}],
                              max_tokens=20, temperature=0, logprobs=True, top_logprobs=5),
    "chat_seeded_n2": _chat(messages=[{"role": "user", "content": "Write a haiku about rain."}], max_tokens=24,
                            temperature=0.9, seed=5, n=2, logprobs=True, top_logprobs=1),
    "chat_json_schema": _chat(messages=[{"role": "user", "content": "Give a city and its population as JSON."}],
                              max_tokens=40, temperature=0, logprobs=True, top_logprobs=3,
                              response_format={"type": "json_schema",
                                               "json_schema": {"name": "city", "schema": SCHEMA}}),
    "chat_prompt_logprobs": _chat(messages=[{"role": "user", "content": "Hello there!"}], max_tokens=5,
                                  temperature=0, prompt_logprobs=2, logprobs=True),
    "chat_seeded_structured": _chat(messages=[{"role": "user", "content": "Pick a colour."}], max_tokens=10,
                                    temperature=1.0, seed=11, logprobs=True,
                                    response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": {
                                        "type": "object", "properties": {"colour": {"enum": ["red", "green",
                                                                                            "blue"]}},
                                        "required": ["colour"]}}}),
    "anthropic": ("/v1/messages", {"model": MODEL, "max_tokens": 12, "temperature": 0,
                                   "messages": [{"role": "user", "content": "Say hello in French."}]}),
}


def f32hex(v: float | None) -> str | None:
    return None if v is None else struct.pack(">f", v).hex()


def numbers(route: str, r: dict) -> dict:
    """What is compared: every float as hex (with the token it belongs to), and the text."""
    out = []
    if route == "/v1/messages":
        return {"text": [b["text"] for b in r["content"] if b["type"] == "text"], "stop": r["stop_reason"]}
    for ch in r["choices"]:
        if route == "/v1/completions":
            lp = ch["logprobs"] or {}
            out.append({"text": ch["text"], "finish": ch["finish_reason"], "tokens": lp.get("tokens"),
                        "lp": [f32hex(v) for v in lp.get("token_logprobs") or []],
                        "top": [None if t is None else {k: f32hex(v) for k, v in t.items()}
                                for t in lp.get("top_logprobs") or []]})
        else:
            content = (ch.get("logprobs") or {}).get("content") or []
            out.append({"text": ch["message"]["content"], "finish": ch["finish_reason"],
                        "tokens": [t["token"] for t in content], "lp": [f32hex(t["logprob"]) for t in content],
                        "top": [[(a["token"], f32hex(a["logprob"])) for a in t["top_logprobs"]] for t in content]})
    got = {"choices": out}
    if "prompt_logprobs" in r:
        got["prompt_logprobs"] = [None if p is None else {k: f32hex(v["logprob"]) for k, v in p.items()}
                                  for p in r["prompt_logprobs"]]
    return got


def served(base: str, skip: tuple[str, ...] = ()) -> dict:
    """Every request's numbers (but `skip`'s) from the server at `base`, with the fingerprint."""
    out, fp = {}, set()
    for name, (route, body) in REQUESTS.items():
        if name in skip:
            continue
        r = httpx.post(base + route, json=body, timeout=600)
        r.raise_for_status()
        j = r.json()
        fp.add(j.get("system_fingerprint"))
        out[name] = {"numbers": numbers(route, j)}
        if name.startswith("readme"):   # the README renders these whole
            out[name]["response"] = j
    fp.discard(None)
    return {"fingerprint": fp.pop(), "requests": out}


def readme_blocks(golden: dict) -> list[str]:
    """The README's two examples, rendered from the golden answers."""
    c = golden["requests"]["readme_completion"]["response"]
    ch = c["choices"][0]
    lp = ch["logprobs"]
    completion = (
        "$ curl -s localhost:8000/v1/completions -H 'content-type: application/json' -d '{\n"
        f"    \"model\": \"{MODEL}\", \"prompt\": \"The capital of France is\",\n"
        "    \"max_tokens\": 3, \"temperature\": 0, \"echo\": true, \"logprobs\": 1}'\n"
        f"{{\"id\": \"cmpl-…\", \"object\": \"text_completion\", \"model\": \"{MODEL}\",\n"
        f" \"system_fingerprint\": \"{c['system_fingerprint']}\",\n"
        f" \"choices\": [{{\"index\": 0, \"text\": {json.dumps(ch['text'])},\n"
        "   \"logprobs\": {\n"
        f"     \"tokens\": {json.dumps(lp['tokens'])},\n"
        f"     \"token_logprobs\": {json.dumps(lp['token_logprobs'])},\n"
        f"     \"top_logprobs\": {json.dumps(lp['top_logprobs'])},\n"
        f"     \"text_offset\": {json.dumps(lp['text_offset'])}}},\n"
        f"   \"finish_reason\": \"{ch['finish_reason']}\"}}],\n"
        f" \"usage\": {json.dumps(c['usage'])}}}")
    chat = golden["requests"]["readme_chat"]["response"]["choices"][0]
    lines = [chat["message"]["content"]]
    for t in chat["logprobs"]["content"][:3]:
        lines.append(f"{t['token']!r} {t['logprob']!r} {[(a['token'], a['logprob']) for a in t['top_logprobs']]}")
    return [completion, "\n".join(lines)]


if __name__ == "__main__":
    if sys.argv[1] == "write":
        FILE.parent.mkdir(exist_ok=True)
        FILE.write_text(json.dumps(served(sys.argv[2]), indent=1, ensure_ascii=False) + "\n")
    elif sys.argv[1] == "readme":
        for block in readme_blocks(json.loads(FILE.read_text())):
            print(block, end="\n\n")
