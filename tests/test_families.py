"""Every family named in the contract, served with transformers' numbers and bit-for-bit batch
invariance: a tiny random-weight model of each (2 layers, hidden 64, weights N(0, 0.2) so the
logits are far from uniform), in-process on the runner's building blocks (no server per family).

For each: the echo logprobs and top-32 tables of a prompt against transformers' own forward
(eager attention, fp32) within 1e-4; greedy generation against transformers' `generate` for 24
tokens; and raw-bit invariance of every position alone = chunked = decoded one token at a time
= batched beside other sequences. A few families also go through the live server
(test_families_through_the_server)."""
from __future__ import annotations

import random
import uuid
import zlib

import pytest
import torch

from conftest import LiveServer
from helpers import PROBE_WORK, engine_work
from test_invariance import Harness, alone, plan_random

B = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
         num_key_value_heads=2, max_position_embeddings=256)
FAMILIES = {   # family -> (config, what it exercises, the forward that should serve it)
    "llama": (B, "the Llama family's own fast forward", "LlamaModel"),
    "qwen3": (B, "QK-norm on the fast forward", "LlamaModel"),
    "mistral": ({**B, "sliding_window": 8}, "sliding-window attention", "TransformersModel"),
    "qwen2": ({**B, "use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1},
              "window layers after full ones, QKV bias", "TransformersModel"),
    "gemma": ({**B, "head_dim": 16}, "scaled embeddings, (1 + w) norms, GeGLU", "TransformersModel"),
    "gemma2": ({**B, "head_dim": 16, "sliding_window": 8, "query_pre_attn_scalar": 24},
               "alternating local/global layers, attention and final logit soft-capping, query_pre_attn_scalar",
               "TransformersModel"),
    "gemma3_text": ({**B, "head_dim": 16, "sliding_window": 8, "sliding_window_pattern": 2},
                    "local/global layers, QK-norm", "TransformersModel"),
    "phi": (dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 max_position_embeddings=256, partial_rotary_factor=0.5),
            "partial rotary, parallel attention/MLP, LayerNorm with bias", "TransformersModel"),
    "phi3": ({**B, "pad_token_id": 0}, "fused QKV and gate/up", "TransformersModel"),
    "gpt2": (dict(n_embd=64, n_layer=2, n_head=4, n_positions=256, vocab_size=300),
             "learned absolute positions, Conv1D, tied head", "TransformersModel"),
    "gpt_neox": (dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      max_position_embeddings=256, rotary_pct=0.25),
                 "partial rotary, parallel residual", "TransformersModel"),
    "olmo2": (B, "QK-norm over the whole projection, post-norms", "TransformersModel"),
    "granite": ({**B, "embedding_multiplier": 3.0, "residual_multiplier": 0.5, "attention_multiplier": 0.3,
                 "logits_scaling": 2.0}, "Granite's four multipliers", "TransformersModel"),
    "stablelm": ({**B, "partial_rotary_factor": 0.25}, "partial rotary, LayerNorm", "TransformersModel"),
    "starcoder2": ({**B, "sliding_window": 8}, "biased linears and LayerNorm, sliding window", "TransformersModel"),
    "mixtral": ({**B, "num_local_experts": 4, "num_experts_per_tok": 2}, "mixture of experts", "TransformersModel"),
    "qwen2_moe": ({**B, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                   "shared_expert_intermediate_size": 64}, "experts with a gated shared expert", "TransformersModel"),
    "opt": (dict(ffn_dim=128, word_embed_proj_dim=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 vocab_size=300, max_position_embeddings=256),
            "learned positions with an offset, ReLU", "TransformersModel"),
    "falcon": (dict(vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_kv_heads=2,
                    new_decoder_architecture=True, max_position_embeddings=256),
               "parallel attention/MLP, attention through torch's SDPA", "TransformersModel"),
}
TOL = 1e-4


def tiny(family: str, seed: int = 0, **extra):
    """A random-weight float32 model of `family` at its tiny size (FAMILIES; `extra` overrides
    config fields), matrices N(0, 0.2)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(family, **{**FAMILIES[family][0], **extra})
    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)
    return hf


@torch.inference_mode()
def reference(hf, ids: list[int], new: int) -> tuple[torch.Tensor, list[int], torch.Tensor]:
    """transformers' own logprobs for `ids` (eager attention), and its greedy continuation of
    `new` tokens with the logits it chose them from."""
    hf.set_attn_implementation("eager")
    lp = torch.log_softmax(hf(torch.tensor([ids]), use_cache=False).logits[0].float(), -1)
    out = hf.generate(torch.tensor([ids]), max_new_tokens=new, min_new_tokens=new, do_sample=False,
                      output_scores=True, return_dict_in_generate=True, pad_token_id=0, eos_token_id=None)
    return lp, out.sequences[0, len(ids):].tolist(), torch.stack(out.scores)[:, 0]


def table_gap(ours: torch.Tensor, ref: torch.Tensor, k: int = 32) -> float:
    """Largest |difference| between two rows' top-k tables: the values at the reference's top-k
    ids, and the k-th values (so a table holding other ids than the reference's would show)."""
    top = torch.topk(ref, k, dim=-1)
    gap = (ours.gather(-1, top.indices) - top.values).abs().max().item()
    return max(gap, (torch.topk(ours, k, dim=-1).values - top.values).abs().max().item())


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_has_transformers_numbers_and_bit_invariance(family):
    from probity.engine.model import path

    rng = random.Random(zlib.crc32(family.encode()))   # the same data in every process (hash() is salted)
    hf = tiny(family)
    ids = [rng.randrange(1, 300) for _ in range(40)]
    ref_lp, ref_tokens, ref_scores = reference(hf, ids, 24)
    h = Harness(hf, 2048)
    assert type(h.runner.model).__name__ == FAMILIES[family][2], path(h.runner.model)

    # echo: each position's value for the next prompt token, and its top-32 table
    want = alone(h, ids)
    lp = torch.log_softmax(want.float(), -1)
    nxt = torch.tensor(ids[1:])
    rows = torch.arange(len(ids) - 1)
    assert (lp[rows, nxt] - ref_lp[rows, nxt]).abs().max().item() < TOL
    assert table_gap(lp, ref_lp) < TOL

    # invariance, bit for bit: chunked, decoded one token at a time, batched beside others
    assert torch.equal(h.run([ids], [[(0, 7)] for _ in range(5)] + [[(0, 5)]])[0], want)
    assert torch.equal(h.run([ids], [[(0, 1)] for _ in ids])[0], want)
    seqs = [ids] + [[rng.randrange(300) for _ in range(rng.randint(1, 60))] for _ in range(3)]
    assert torch.equal(h.run(seqs, plan_random([len(s) for s in seqs], rng, 13))[0], want)

    # greedy generation, token by token through the decode path, against transformers' generate
    tokens = list(ids)
    for step in range(24):
        logits = h.run([tokens], [[(0, len(tokens))]])[0][-1]
        tok = int(torch.argmax(logits))
        if tok != ref_tokens[step]:
            top2 = torch.topk(ref_scores[step].float(), 2).values
            assert (top2[0] - top2[1]).item() < TOL, f"token {step}: {tok} != {ref_tokens[step]} (no near tie)"
            break
        tokens.append(tok)


def test_families_refused_by_name():
    """What cannot be made exact here is refused at startup, by name, pointing at vLLM."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from probity.engine.model import UnsupportedModel, build

    for family, kw, why in [
        ("falcon", dict(vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, alibi=True), "ALiBi"),
        ("bloom", dict(vocab_size=100, hidden_size=32, n_layer=1, n_head=2), "attention"),
        ("gpt_oss", dict(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=8, intermediate_size=32, num_local_experts=4), "sinks"),
    ]:
        hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(family, **kw)).eval()
        with pytest.raises(UnsupportedModel) as e:
            build(hf)
        assert family in str(e.value) and why in str(e.value) and "--backend vllm" in str(e.value)


# ---------------------------------------------------------------- through the server

SERVED = ["gpt2", "gemma2", "mixtral"]


@pytest.fixture(scope="module", params=SERVED)
def family_server(request, tiny_model_dir, tmp_path_factory):
    """A tiny model of the family with the tests' real BPE tokenizer and chat template, saved
    as sharded safetensors (model.safetensors.index.json), served by `probity serve --model`."""
    from transformers import AutoTokenizer

    family = request.param
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    hf = tiny(family, seed=1, vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
              pad_token_id=tok.pad_token_id)
    folder = tmp_path_factory.mktemp(family) / family
    hf.save_pretrained(folder, max_shard_size="200KB")
    tok.save_pretrained(folder)
    assert (folder / "model.safetensors.index.json").is_file()
    s = LiveServer(["--model", str(folder), "--threads", "1", "--kv-cache-gib", "0.05"])
    yield family, hf, tok, s
    s.stop()


def test_families_through_the_server(family_server):
    """The general path end to end: echo logprobs against transformers in-process, the same
    floats alone, in a prompt array (computed there, in one forward pass with the other member)
    and from the prefix cache, and a chat answer from the checkpoint's own template."""
    family, hf, tok, s = family_server
    model_id = s.get("/v1/models").json()["data"][0]["id"]
    prompt = "The quick brown fox jumps over the lazy dog. Paris is the capital of France."
    salt = f"{family}-{uuid.uuid4()}"   # the first request's blocks are shared only by `again`
    body = {"model": model_id, "prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 5}
    r = s.post("/v1/completions", json={**body, "cache_salt": salt}).json()
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    first = r["choices"][0]["logprobs"]
    ids = tok(prompt)["input_ids"]
    hf.set_attn_implementation("eager")
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)
    want = [ref[i - 1, t].item() for i, t in enumerate(ids) if i > 0]
    got = first["token_logprobs"][1:]
    assert max(abs(a - b) for a, b in zip(got, want)) < TOL, family
    again = s.post("/v1/completions", json={**body, "cache_salt": salt}).json()   # now from the prefix cache
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert again["choices"][0]["logprobs"] == first
    before = engine_work(s, model_id)
    batch = s.post("/v1/completions", json={**body, "prompt": ["Hello there, friend.", prompt],
                                            "cache_salt": f"{salt}-array"}).json()
    passes = engine_work(s, model_id)[0] - before[0] - PROBE_WORK[0]
    assert batch["usage"]["prompt_tokens_details"]["cached_tokens"] == 0 and passes == 1, (batch["usage"], passes)
    assert batch["choices"][1]["logprobs"] == first
    chat = s.post("/v1/chat/completions", json={"model": model_id, "max_tokens": 5, "temperature": 0,
                                               "messages": [{"role": "user", "content": "Hi"}]})
    assert chat.status_code == 200 and chat.json()["usage"]["completion_tokens"] >= 1


def test_a_refused_family_is_one_named_line_and_a_non_zero_exit(tiny_model_dir, tmp_path):
    """`probity serve` on a model the engine cannot serve exactly: the engine's one line names the
    family, the reason and vLLM; the server adds one line and exits 3; no traceback."""
    import subprocess
    import sys

    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from conftest import ROOT

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    folder = tmp_path / "tiny-bloom"
    AutoModelForCausalLM.from_config(AutoConfig.for_model("bloom", vocab_size=len(tok), hidden_size=32, n_layer=1,
                                                          n_head=2)).save_pretrained(folder)
    tok.save_pretrained(folder)
    p = subprocess.run([sys.executable, "-m", "probity", "serve", "--model", str(folder), "--port", "1"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 3 and "Traceback" not in p.stderr
    line = next(l for l in p.stderr.splitlines() if "error:" in l)
    assert "model type 'bloom'" in line and "--backend vllm" in line
