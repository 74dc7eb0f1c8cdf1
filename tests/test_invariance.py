"""Batch invariance, bit for bit, of the engine's own forward (probity/engine/model.py).

A sequence's logits must be the same floats whether it runs alone or beside any other
sequences, at any place in the step, as one prefill or in chunks of any size, and whether a
position is computed in a prefill (echo) or in a decode. Compared with torch.equal — raw
bits, no tolerance. The same model is checked against transformers' own forward (a different
implementation) within the fidelity budget.

These run in-process on the runner's building blocks, so hypothesis can try many batch
compositions quickly; tests/test_batching.py checks the same through the live server."""
from __future__ import annotations

import math
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from probity.engine.engine import BLOCK_SIZE as BS
from probity.engine.kv_cache import BlockPool
from probity.engine.model import build
from probity.engine.runner import ModelRunner


class Row:
    """What the runner reads of a sequence: its tokens, its block table, how far it is."""

    def __init__(self, tokens: list[int]):
        self.tokens, self.blocks, self.num_computed = tokens, [], 0


class Harness:
    """Runs sequences through the runner's forward with any chunking and any companions, and
    returns each sequence's logits for every position."""

    def __init__(self, hf_model, tokens: int = 8192):
        # + the zero block; a step of up to 1,024 rows (the longest chunk here is 700)
        num_blocks = -(-tokens // BS) + 1
        self.pool = BlockPool(num_blocks, BS)
        self.runner = ModelRunner(build(hf_model), num_blocks, BS, max_rows=1024)
        self.vocab_size = self.runner.vocab_size

    def run(self, seqs: list[list[int]], plan: list[list[tuple[int, int]]]) -> list[torch.Tensor]:
        """`plan[step]` = [(seq index, rows)], rows taken in order from each sequence."""
        rows = [Row(s) for s in seqs]
        out: list[list[torch.Tensor]] = [[] for _ in seqs]
        for step in plan:
            batch = [(rows[i], n) for i, n in step]
            for r, n in batch:
                self.pool.grow(r.blocks, r.num_computed + n)
            hidden, starts = self.runner.forward(batch)
            logits = self.runner.model.logits(hidden)
            for (i, n), a in zip(step, starts):
                out[i].append(logits[a:a + n])
                rows[i].num_computed += n
        for r in rows:
            self.pool.release(r.blocks)
        return [torch.cat(o) for o in out]


def reported_gap(ours: torch.Tensor, ref: torch.Tensor, ids: list[int]) -> float:
    """Largest difference between the two implementations' logprobs over what probity can
    report: each position's next token and the reference's top 32 alternatives."""
    a, b = torch.log_softmax(ours.float(), -1), torch.log_softmax(ref.float(), -1)
    rows = torch.arange(len(ids) - 1)
    nxt = torch.tensor(ids[1:])
    gap = (a[rows, nxt] - b[rows, nxt]).abs().max()
    top = torch.topk(b, 32, dim=-1).indices
    return max(gap.item(), (a.gather(1, top) - b.gather(1, top)).abs().max().item())


def plan_random(lengths: list[int], rng: random.Random, max_chunk: int) -> list[list[tuple[int, int]]]:
    """Interleave the sequences' rows in random steps of random chunk sizes (decode-sized
    chunks of 1 included), in random order within a step."""
    left = list(lengths)
    plan = []
    while any(left):
        step = []
        for i in rng.sample(range(len(left)), len(left)):
            if left[i] and rng.random() < 0.8:
                n = min(left[i], rng.choice([1, 1, 2, 3, rng.randint(1, max_chunk)]))
                step.append((i, n))
                left[i] -= n
        if step:
            plan.append(step)
    return plan


@pytest.fixture(scope="module")
def tiny_harness(tiny_hf):
    return Harness(tiny_hf[0])


def alone(h: Harness, ids: list[int]) -> torch.Tensor:
    return h.run([ids], [[(0, len(ids))]])[0]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32 - 1), others=st.integers(0, 5), max_chunk=st.sampled_from([4, 17, 64, 200]))
def test_logits_bit_identical_alone_batched_chunked_or_decoded(tiny_harness, seed, others, max_chunk):
    rng = random.Random(seed)
    target = [rng.randrange(tiny_harness.vocab_size) for _ in range(rng.randint(1, 150))]
    want = alone(tiny_harness, target)
    seqs = [target] + [[rng.randrange(tiny_harness.vocab_size) for _ in range(rng.randint(1, 120))]
                       for _ in range(others)]
    rng.shuffle(seqs)
    got = tiny_harness.run(seqs, plan_random([len(s) for s in seqs], rng, max_chunk))
    for s, g in zip(seqs, got):
        if s is target:
            assert torch.equal(g, want)


def test_one_token_at_a_time_equals_one_prefill(tiny_harness):
    ids = list(range(5, 205))
    want = alone(tiny_harness, ids)
    got = tiny_harness.run([ids], [[(0, 1)] for _ in ids])[0]
    assert torch.equal(got, want)


def test_matches_transformers_forward_within_budget(tiny_harness, tiny_hf):
    model, _ = tiny_hf
    ids = list(range(3, 200))
    ours = alone(tiny_harness, ids)
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0]
    assert reported_gap(ours, ref, ids) < 1e-4


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "mistral"])
def test_other_families_match_transformers_and_stay_invariant(family, tiny_model_dir):
    """Tiny random-weight models of other supported families (QKV bias, per-head q/k norms,
    rope variants) against transformers' own forward, and chunked == one-shot."""
    from transformers import AutoConfig, AutoModelForCausalLM

    kw = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False)
    if family == "qwen3":
        kw["head_dim"] = 32
    cfg = AutoConfig.for_model(family, **kw)
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)  # biases and norms away from their 0/1 init
    ids = [random.Random(1).randrange(300) for _ in range(120)]
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    h = Harness(hf, 1024)   # the general path (Mistral's sliding window) takes the transformers model over
    ours = alone(h, ids)
    assert reported_gap(ours, ref, ids) < 1e-4
    chunked = h.run([ids], [[(0, 7)] for _ in range(17)] + [[(0, 1)]])[0]
    assert torch.equal(chunked, ours)


@pytest.mark.default_model
def test_default_model_logits_bit_identical_batched_and_chunked():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from probity.engine.loader import converted_dir, default_model_path

    folder, _ = converted_dir(default_model_path())
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    h = Harness(hf, 4096)
    rng = random.Random(7)
    for _ in range(3):
        target = [rng.randrange(49152) for _ in range(rng.randint(40, 300))]
        want = alone(h, target)
        seqs = [target] + [[rng.randrange(49152) for _ in range(rng.randint(1, 200))] for _ in range(3)]
        got = h.run(seqs, plan_random([len(s) for s in seqs], rng, 96))
        assert torch.equal(got[0], want)
    text = "The quick brown fox jumps over the lazy dog. Paris is the capital of France. " * 6
    ids = AutoTokenizer.from_pretrained(folder)(text)["input_ids"]
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    assert reported_gap(alone(h, ids), ref, ids) < 1e-4


@pytest.fixture(scope="module", params=[2, 4], ids=["gqa", "no-gqa"])
def wide_head_harness(request):
    """Head dim 64 like the default model, tiny otherwise: the value GEMM of attention reduces
    over the key length, and a kernel may change how it reduces with that length. With one
    query head per KV head ("no-gqa"), a decode row is a single GEMM row unless padded, and a
    single row takes another kernel."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("llama", vocab_size=300, hidden_size=256, intermediate_size=256, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=request.param, max_position_embeddings=4096)
    torch.manual_seed(1)
    return Harness(AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval(), 4096)


def test_long_sequences_bit_identical_beside_longer_ones_and_decoded(wide_head_harness):
    """A sequence hundreds of tokens long decoded beside a longer one (its keys padded to the
    companion's length) and token by token (its keys as long as it is) equals its one-shot
    prefill (its keys padded to the whole prompt)."""
    h = wide_head_harness
    rng = random.Random(5)
    target = [rng.randrange(300) for _ in range(700)]
    companion = [rng.randrange(300) for _ in range(1000)]
    want = alone(h, target)
    plan = [[(1, 512)], [(1, 438)], [(0, 650)]] + [[(0, 1), (1, 1)] for _ in range(50)]
    got = h.run([target, companion], plan)[0]
    assert torch.equal(got, want)
    stepwise = h.run([target], [[(0, 300)]] + [[(0, 1)] for _ in range(400)])[0]
    assert torch.equal(stepwise, want)
