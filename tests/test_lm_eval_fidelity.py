"""lm-evaluation-harness through probity equals lm-evaluation-harness in-process, sample by sample.

The reference is lm-eval's own in-process `hf` model on the float32 folder probity serves (the
tiny test model's; the default model's GGUF as transformers de-quantizes it, cached). The tasks
in tests/lm_eval_tasks (multiple choice whose one-word answers after a chat prompt are mostly
followed by <|im_end|>; rolling perplexity over documents longer than one window; greedy
generation with `until`) also run through `local-completions` against a live probity, with
tokenized and untokenized requests, batch 1 and 8. Each variant's logged samples must match the
reference's: every request's loglikelihood within 1e-3, the same `is_greedy`, the same greedy
generations, the same acc / acc_norm / exact_match, perplexities within the relative error that
1e-3 per document allows. Per-token values, which lm-eval does not log, are checked directly:
probity's answers to lm-eval's exact requests (echo, max_tokens 1, logprobs 1; the first 6
multiple-choice docs' pairs, for time, and every rolling window), every entry including the
generated one, within 1e-4 of transformers in-process. One known difference is kept apart (an xfail test):
generated special tokens other than EOS are in probity's text, lm-eval's `hf` skips them.

Exempt only where the reference itself is a near tie, so that rounding (other fp32 kernels than
transformers') may legitimately flip the outcome: `is_greedy` where a continuation token's top
two logits are within 1e-4; acc / acc_norm where the doc's two best choices score within 2e-3
(each side may be 1e-3 off); a generation where, at the token where the two texts part,
transformers' top two logits are within 1e-4 (greedy decoding in-process finds it).

lm-eval's API models keep two tokens of `max_length` free in a rolling window where `hf` keeps
none, so the probity runs get max_length + 2: both then cut the same 128-token windows and
left-truncate multiple-choice requests alike (generation contexts here are too short to be cut).
lm-eval runs in .venv-lmeval (`make setup`); nothing downloads.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import DEFAULT_ARGS, ROOT, TINY_ID
from helpers import scrape, value

TASKS_DIR = Path(__file__).parent / "lm_eval_tasks"
TASKS = ["probity_mc", "probity_ppl", "probity_gen"]
LMEVAL_PY = ROOT / ".venv-lmeval" / "bin" / "python"
RUNNER = Path(__file__).parent / "lm_eval_runner.py"
MAX_LENGTH = 128
LL_TOL, TOKEN_TOL, TIE = 1e-3, 1e-4, 1e-4
PPL_REL_TOL = 1e-4  # 4 documents x 1e-3 over >= 150 words or 700 bytes each move them < 1e-5
VARIANTS = {f"{'tokens' if tok else 'text'}-batch{b}": (tok, b) for tok in (True, False) for b in (1, 8)}
PER_TOKEN_MC_DOCS = 6  # all 20 cost minutes of in-process forwards on a loaded machine
pytestmark = pytest.mark.lm_eval


@dataclass
class Evals:
    reference: tuple  # (aggregated results, {task: {doc_id: logged sample}})
    variants: dict    # name -> the same pair
    oracle: "Oracle"
    server: object
    model_id: str


class Oracle:
    """transformers in-process on the same folder lm-eval's `hf` loads."""

    def __init__(self, model, tok):
        self.model, self.tok = model, tok

    def encode(self, text: str) -> list[int]:
        return self.tok(text, add_special_tokens=False)["input_ids"]

    def logprobs(self, ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return self.model(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def top2_gap(lp: torch.Tensor) -> float:
    top = lp.topk(2).values
    return (top[0] - top[1]).item()


def lm_eval_runs(model_dir: Path, model_id: str, url: str) -> dict:
    """The hf reference and the four probity variants of one model, as lm_eval_runner runs them."""
    runs = {"hf": {"model": "hf", "batch_size": 8,
                   "model_args": f"pretrained={model_dir},dtype=float32,max_length={MAX_LENGTH}"}}
    for name, (tokenized, batch) in VARIANTS.items():
        runs[name] = {"model": "local-completions", "batch_size": batch,
                      "model_args": f"model={model_id},base_url={url}/v1/completions,num_concurrent=1,"
                                    f"max_retries=1,tokenized_requests={tokenized},max_length={MAX_LENGTH + 2}"}
    return runs


def run_lm_eval(runs: dict, out: Path) -> dict:
    """Every run in one lm-eval process (its import and task indexing once)."""
    cfg = out / "runs.json"
    cfg.write_text(json.dumps({"tasks": TASKS, "include_path": str(TASKS_DIR), "runs": runs}))
    # one thread: the machine is shared, and oversubscribed torch threads crawl
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "OPENAI_API_KEY": "none", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    p = subprocess.run([str(LMEVAL_PY), str(RUNNER), str(cfg), str(out / "out.json")], cwd=TASKS_DIR, env=env,
                       capture_output=True, text=True, timeout=1800)
    assert p.returncode == 0, p.stderr[-4000:]
    return json.loads((out / "out.json").read_text())


def _selected_models(request) -> list[str]:
    """The `evals` params of this module's selected tests (under -m "not default_model" the
    default model's are deselected, and it is neither started nor run)."""
    return sorted({item.callspec.params["evals"] for item in request.session.items
                   if item.module is request.module and hasattr(item, "callspec")
                   and "evals" in item.callspec.params})


def _model(request, name: str) -> tuple[Path, str, object]:
    """(float32 folder, model id, live server without the prefix cache) for `name`: lm-eval's
    requests carry no cache_salt, and on a cached server the second to fourth variants (and
    every multiple-choice request after its context's first) would read the first's numbers
    back from the cache instead of computing them."""
    if name == "tiny":
        return request.getfixturevalue("tiny_model_dir"), TINY_ID, request.getfixturevalue("uncached_server")
    from probity.engine.loader import DEFAULT_ID, converted_dir, default_model_path

    server = request.getfixturevalue("default_uncached")
    return converted_dir(default_model_path())[0], DEFAULT_ID, server   # the GGUF de-quantized by transformers


@pytest.fixture(scope="module")
def default_uncached(servers):
    args = (*DEFAULT_ARGS, "--no-prefix-cache")
    yield servers.get(args, pin=True, startup=600)
    servers.release(args)


@pytest.fixture(scope="module")
def lm_eval_out(request, tmp_path_factory) -> dict:
    """One lm-eval process for every selected model: its hf reference and four probity
    variants each, keyed "model/run"."""
    assert LMEVAL_PY.exists(), "make setup installs lm-eval into .venv-lmeval"
    runs = {}
    for name in _selected_models(request):
        folder, model_id, server = _model(request, name)
        runs.update({f"{name}/{k}": v for k, v in lm_eval_runs(folder, model_id, server.url).items()})
    out = run_lm_eval(runs, tmp_path_factory.mktemp("lm_eval"))
    print("\nlm-eval: " + ", ".join(f"{name} {run['seconds']:.0f}s" for name, run in out.items()))
    return out


@pytest.fixture(scope="module", params=["tiny", pytest.param("default", marks=pytest.mark.default_model)])
def evals(request, lm_eval_out) -> Evals:
    folder, model_id, server = _model(request, request.param)
    if request.param == "tiny":
        model, tok = request.getfixturevalue("tiny_hf")
    else:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        tok = AutoTokenizer.from_pretrained(folder)
    mine = {k.split("/", 1)[1]: v for k, v in lm_eval_out.items() if k.startswith(request.param + "/")}
    assert mine, f"lm-eval ran nothing for {request.param}"
    by_doc = {name: {t: {s["doc_id"]: s for s in run["samples"][t]} for t in TASKS} for name, run in mine.items()}
    runs = {name: (mine[name]["results"], by_doc[name]) for name in mine}
    ref = runs.pop("hf")
    return Evals(ref, runs, Oracle(model, tok), server, model_id)


def parting_gap(oracle: Oracle, context: str, a: str, b: str, max_tokens: int) -> float:
    """Greedy in-process from `context`: the top-two gap at the token that first writes past
    the common prefix of the two generations, i.e. where they part."""
    common = len(os.path.commonprefix([a, b]))
    ids = oracle.encode(context)
    out: list[int] = []
    for _ in range(max_tokens):
        lp = oracle.logprobs(ids + out)[-1]
        out.append(int(lp.argmax()))
        if len(oracle.tok.decode(out)) > common:
            return top2_gap(lp)
    return math.inf


def without_special_tokens(oracle: Oracle, text: str) -> str:
    for special in oracle.tok.all_special_tokens:
        text = text.replace(special, "")
    return text


def generation_problems(evals: Evals, got: tuple, skip_special: bool) -> tuple[list[str], set]:
    """Greedy generations that differ from the reference's where it is no near tie, and the
    docs whose text differs for an excused reason. lm-eval's `hf` decodes with
    skip_special_tokens=True (as vLLM's server does by default); probity's text carries every
    generated token's bytes, a special token's too: `skip_special` drops those strings from
    probity's text first (the xfail test below keeps that difference in sight)."""
    problems, excused = [], set()
    (_, ref), (_, run) = evals.reference, got
    for doc_id, r in ref["probity_gen"].items():
        (ctx, kwargs), = r["arguments"]
        want, have = r["filtered_resps"][0], run["probity_gen"][doc_id]["filtered_resps"][0]
        if have == want:
            continue
        if skip_special and without_special_tokens(evals.oracle, have) == want:
            excused.add(doc_id)
            continue
        gap = parting_gap(evals.oracle, ctx, want, have, kwargs["max_gen_toks"])
        if gap < TIE:
            excused.add(doc_id)
        else:
            problems.append(f"probity_gen doc {doc_id}: {have!r} != {want!r}, top-2 gap {gap}")
    return problems, excused


def near_tie_choices(r: dict, metric: str) -> bool:
    """The reference's two best choices are closer than two loglikelihood tolerances."""
    scores = [x[0] for x in r["filtered_resps"]]
    if metric == "acc_norm":  # lm-eval divides by the choice's length in characters
        lengths = [len(c) for _, c in r["arguments"]]
        scores, margin = [s / n for s, n in zip(scores, lengths)], 2 * LL_TOL / min(lengths)
    else:
        margin = 2 * LL_TOL
    best2 = sorted(scores)[-2:]
    return best2[1] - best2[0] < margin


def sample_problems(evals: Evals, got: tuple) -> tuple[list[str], float, dict]:
    """Differences between a variant's samples and the reference's that no near tie explains,
    the largest |Δ loglikelihood| seen, and per task the docs whose metrics may differ."""
    problems, excused_gen = generation_problems(evals, got, skip_special=True)
    excused = {"probity_gen": excused_gen, "probity_mc": set(), "probity_ppl": set()}
    worst = 0.0
    (_, ref), (_, run) = evals.reference, got
    for task in TASKS:
        assert run[task].keys() == ref[task].keys(), task
    for task in ("probity_mc", "probity_ppl"):
        for doc_id, r in ref[task].items():
            g, where = run[task][doc_id], f"{task} doc {doc_id}"
            for i, (rr, gg) in enumerate(zip(r["filtered_resps"], g["filtered_resps"], strict=True)):
                (rll, rgreedy), (gll, ggreedy) = (rr, gg) if task == "probity_mc" else ((rr, None), (gg, None))
                worst = max(worst, abs(gll - rll))
                if abs(gll - rll) > LL_TOL:
                    problems.append(f"{where} request {i}: loglikelihood {gll} != {rll}")
                if ggreedy != rgreedy and not continuation_has_near_tie(evals.oracle, *r["arguments"][i]):
                    problems.append(f"{where} request {i}: is_greedy {ggreedy} != {rgreedy}")
            if task == "probity_mc" and any(near_tie_choices(r, m) for m in ("acc", "acc_norm")):
                excused[task].add(doc_id)
    for task in ("probity_mc", "probity_gen"):
        for doc_id, r in ref[task].items():
            for metric in r["metrics"]:
                if run[task][doc_id][metric] != r[metric] and doc_id not in excused[task]:
                    problems.append(f"{task} doc {doc_id}: {metric} {run[task][doc_id][metric]} != {r[metric]}")
    return problems, worst, excused


def lm_eval_pair(oracle: Oracle, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's TemplateLM._encode_pair: trailing whitespace moves to the continuation, the
    whole string is encoded at once and split after the context's tokens."""
    n = len(context) - len(context.rstrip())
    if n:
        context, continuation = context[:-n], context[-n:] + continuation
    whole, ctx = oracle.encode(context + continuation), oracle.encode(context)
    return whole[:len(ctx)], whole[len(ctx):]


def continuation_has_near_tie(oracle: Oracle, context: str, continuation: str) -> bool:
    ctx, cont = lm_eval_pair(oracle, context, continuation)
    ids = (ctx + cont)[-(MAX_LENGTH + 1):]
    lp = oracle.logprobs(ids)
    return any(top2_gap(lp[p - 1]) < TIE for p in range(len(ids) - len(cont), len(ids)))


def metric_problems(evals: Evals, got: tuple, excused: dict) -> tuple[list[str], dict]:
    """Aggregates: perplexities within PPL_REL_TOL; means over docs identical, or off by at
    most 1/n per doc a near tie excused."""
    (ref, ref_samples), (res, _) = evals.reference, got
    problems, deltas = [], {}
    for task in TASKS:
        for key, want in ref[task].items():
            if "," not in key or "_stderr" in key:  # "acc,none" is metric "acc" under filter "none"
                continue
            have = res[task][key]
            deltas[f"{task} {key.split(',')[0]}"] = have - want
            if task == "probity_ppl":
                ok = math.isclose(have, want, rel_tol=PPL_REL_TOL)
            else:
                ok = abs(have - want) <= len(excused[task]) / len(ref_samples[task])
            if not ok:
                problems.append(f"{task} {key}: {have} != {want}")
    return problems, deltas


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_every_sample_equals_lm_eval_in_process(evals, variant):
    got = evals.variants[variant]
    problems, worst, excused = sample_problems(evals, got)
    mproblems, deltas = metric_problems(evals, got, excused)
    print(f"\n{variant}: max |Δ loglikelihood| {worst:.3g}; metric deltas "
          + ", ".join(f"{k} {v:+.3g}" for k, v in deltas.items())
          + "; excused docs " + ", ".join(f"{t} {sorted(d)}" for t, d in excused.items() if d))
    assert not problems + mproblems, "\n".join((problems + mproblems)[:30])


def test_the_four_variants_are_bit_identical(evals):
    """Tokenized or text, batch 1 or 8: the same token sequences reach the same probity (lm-eval
    uses probity's own /tokenize and /detokenize), whose numbers do not depend on what shares a
    batch, so every logged response and every aggregate is the same float in all four -- not
    merely each within LL_TOL of the reference. (out.json holds floats in repr precision, so
    `!=` compares the floats lm-eval computed.) The server has no prefix cache, so each variant's
    numbers are its own computation. Seen failing: hidden states scaled by 1 + 2^-20 in steps of
    more than one sequence (tokens-batch8's multiple-choice loglikelihoods then differ from
    batch 1's in the 7th digit)."""
    # the server computed every request: none of its prompt tokens came from a cache
    assert value(scrape(evals.server), "probity_prompt_tokens_cached_total") == 0
    names = list(VARIANTS)
    first_res, first = evals.variants[names[0]]
    problems = []
    for name in names[1:]:
        res, samples = evals.variants[name]
        for task in TASKS:
            assert samples[task].keys() == first[task].keys(), (name, task)
            for doc_id, s in first[task].items():
                for field in ("resps", "filtered_resps"):
                    if samples[task][doc_id][field] != s[field]:
                        problems.append(f"{name} {task} doc {doc_id} {field}: "
                                        f"{samples[task][doc_id][field]} != {s[field]} ({names[0]})")
            assert res[task].keys() == first_res[task].keys(), (name, task)
            for key, v in first_res[task].items():
                if res[task][key] != v and not (isinstance(v, float) and math.isnan(v) and math.isnan(res[task][key])):
                    problems.append(f"{name} {task} {key}: {res[task][key]} != {v} ({names[0]})")
    assert not problems, "\n".join(problems[:30])


@pytest.mark.xfail(strict=True, reason="probity's generated text includes special tokens' text (e.g. "
                   "<|endoftext|>); lm-eval's hf and vLLM skip them; open decision, see the fidelity report")
def test_generations_equal_lm_eval_in_process_with_special_tokens(evals):
    if evals.model_id != TINY_ID:
        pytest.skip("only the tiny model's greedy text here contains a special token")
    problems, _ = generation_problems(evals, evals.variants["tokens-batch1"], skip_special=False)
    assert not problems


def lm_eval_requests(evals: Evals) -> list[list[int]]:
    """The loglikelihood requests lm-eval sends, as token ids: multiple-choice pairs left-cut
    to max_length + 1 tokens, and each document's rolling windows ([prefix] + tokens, cut in
    windows of max_length predicted tokens, each sent with max_length tokens before its last)."""
    oracle, (_, ref) = evals.oracle, evals.reference
    requests = []
    for s in list(ref["probity_mc"].values())[:PER_TOKEN_MC_DOCS]:
        for ctx, cont in s["arguments"]:
            c, k = lm_eval_pair(oracle, ctx, cont)
            requests.append((c + k)[-(MAX_LENGTH + 1):])
    prefix = oracle.tok.bos_token_id if oracle.tok.bos_token_id is not None else oracle.tok.eos_token_id
    for s in ref["probity_ppl"].values():
        full = [prefix] + oracle.encode(s["arguments"][0][0])
        ends = list(range(MAX_LENGTH + 1, len(full), MAX_LENGTH)) + [len(full)]
        requests += [full[max(0, e - MAX_LENGTH - 1):e] for e in ends]
    return requests


def test_every_token_logprob_equals_transformers(evals):
    """Each entry of probity's answer to lm-eval's own requests, the generated token's included
    (lm-eval drops the last entry as "the generated one"; if it were missing, a continuation
    token would be dropped instead), against transformers in-process."""
    oracle, eos = evals.oracle, evals.oracle.tok.eos_token_id
    requests = lm_eval_requests(evals)
    worst, eos_entries = 0.0, 0
    for i in range(0, len(requests), 8):
        batch = requests[i:i + 8]
        r = httpx.post(evals.server.url + "/v1/completions", timeout=300, json={
            "model": evals.model_id, "prompt": batch, "echo": True, "max_tokens": 1, "logprobs": 1,
            "temperature": 0})
        assert r.status_code == 200, r.text
        for ids, choice in zip(batch, sorted(r.json()["choices"], key=lambda c: c["index"]), strict=True):
            got = choice["logprobs"]["token_logprobs"]
            assert len(got) == len(ids) + 1, "one entry per prompt token and one for the generated token"
            lp = oracle.logprobs(ids)
            want = [lp[p - 1, t].item() for p, t in enumerate(ids) if p] + [lp[-1].max().item()]
            assert got[0] is None
            deltas = [abs(a - b) for a, b in zip(got[1:], want, strict=True)]
            worst = max(worst, *deltas)
            assert max(deltas) < TOKEN_TOL, (ids, max(deltas), deltas.index(max(deltas)))
            if int(lp[-1].argmax()) == eos and top2_gap(lp[-1]) >= TIE:
                assert choice["logprobs"]["tokens"][-1] == oracle.tok.eos_token
                eos_entries += 1
    print(f"\n{len(requests)} requests: max |Δ token logprob| {worst:.3g}; {eos_entries} end in EOS")
    if evals.model_id != TINY_ID:  # the case the issue found: the data must keep exercising it
        assert eos_entries >= len(requests) // 2
