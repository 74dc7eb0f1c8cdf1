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


def test_without_the_kernels_numbers_stay_invariant_and_faithful(tiny_hf, monkeypatch):
    """Where kernels.c cannot be built or loaded (no gcc, no AVX2/FMA), every op falls back to
    oneDNN, MKL or torch, with the floors the probes measure for those: a sequence's logits
    are still the same bits one token at a time, in one prefill and chunked beside others,
    and still within the budget of transformers' forward."""
    from probity.engine import kernels

    monkeypatch.setattr(kernels, "_lib", None)
    monkeypatch.setattr(kernels, "_loaded", True)
    monkeypatch.setattr(kernels, "_why_not", "switched off by the test")
    h = Harness(tiny_hf[0])
    model = h.runner.model
    assert model.head.packed is None and model.head.kb is None and not model.fused_decode
    ids = list(range(3, 200))
    want = alone(h, ids)
    assert torch.equal(h.run([ids], [[(0, 1)] for _ in ids])[0], want)
    rng = random.Random(3)
    seqs = [ids] + [[rng.randrange(h.vocab_size) for _ in range(rng.randint(1, 120))] for _ in range(3)]
    assert torch.equal(h.run(seqs, plan_random([len(s) for s in seqs], rng, 17))[0], want)
    with torch.no_grad():
        ref = tiny_hf[0](torch.tensor([ids])).logits[0]
    assert reported_gap(want, ref, ids) < 1e-4


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


ATTENTION_SHAPES = [(16, 2), (64, 3), (64, 1), (128, 4)]
LINEAR_SHAPES = [
    (3072, 576, False), (960, 576, False), (576, 576, True), (576, 1536, True), (49152, 576, False),  # default model
    (128, 64, False), (64, 64, True), (256, 64, False), (64, 128, True), (400, 64, False),          # tests' tiny model
]


@pytest.mark.parametrize("head_dim,group", ATTENTION_SHAPES)
def test_attention_gemms_agree_from_the_measured_floor(head_dim, group):
    """The runner pads every item's attention rows to a floor it measures at startup, because
    narrow GEMM calls may take another kernel (on an AMD EPYC both sliced attention GEMMs give
    rows 1-3 of a call other bits than from 4 on). Here, on other key lengths, item counts and
    data than the startup probe uses, every row count the runner can give an item from that
    floor up returns the bits of the widest call, row by row."""
    from probity.engine.attention import KEY_ALIGN
    from probity.engine.calibration import attention_min_rows
    from probity.engine.kernels import score_gemm, value_gemm
    from probity.engine.runner import PROBE_ROWS, row_buckets

    buckets = row_buckets(PROBE_ROWS)
    floor = attention_min_rows(head_dim, group, buckets)
    gen = torch.Generator().manual_seed(head_dim * 10 + group)
    widest = buckets[-1] * group
    for L, items in ((256, 2), (1024, 1), (128, 5)):
        keys = torch.randn(3, items, L, head_dim, generator=gen)
        vals = torch.randn(3, items, L, head_dim + 1, generator=gen)
        qs = torch.randn(3, items, widest, head_dim, generator=gen)
        e = torch.rand(3, items, L // KEY_ALIGN, widest, KEY_ALIGN, generator=gen)
        s_ref, v_ref = score_gemm(keys, qs), value_gemm(e, vals)
        for r in buckets:
            c = r * group
            same = (torch.equal(score_gemm(keys, qs[:, :, :c]), s_ref[..., :c, :])
                    and torch.equal(value_gemm(e[..., :c, :].contiguous(), vals), v_ref[..., :c, :]))
            if r >= floor:
                assert same, f"{c} GEMM rows differ from the widest call although the floor is {floor} rows"


@pytest.mark.parametrize("head_dim,group", ATTENTION_SHAPES)
def test_attention_floor_on_this_cpu_is_not_higher_than_needed(head_dim, group):
    """Where this CPU's measured floor is above the lowest bucket, the bucket below it does
    differ from the widest call on the probe's own key length. Where it is the lowest bucket
    there is no narrower count to check, and the test says so (the probe's minimality is
    checked on every CPU with a simulated GEMM: test_attention_min_rows_finds_...)."""
    from probity.engine.attention import KEY_ALIGN
    from probity.engine.calibration import attention_min_rows
    from probity.engine.kernels import score_gemm, value_gemm
    from probity.engine.runner import PROBE_ROWS, row_buckets

    buckets = row_buckets(PROBE_ROWS)
    floor = attention_min_rows(head_dim, group, buckets)
    if floor == buckets[0]:
        pytest.skip(f"this CPU's attention floor for head dim {head_dim}, group {group} is the lowest bucket "
                    f"({floor}): no narrower call exists")
    r = max(b for b in buckets if b < floor)
    c, widest = r * group, buckets[-1] * group
    gen = torch.Generator().manual_seed(0)   # as the probe: its key lengths, its data
    differs = False
    for L, items in ((KEY_ALIGN, 1), (3 * KEY_ALIGN, 3)):
        keys = torch.randn(2, items, L, head_dim, generator=gen)
        vals = torch.randn(2, items, L, head_dim + 1, generator=gen)
        qs = torch.randn(2, items, widest, head_dim, generator=gen)
        e = torch.rand(2, items, L // KEY_ALIGN, widest, KEY_ALIGN, generator=gen)
        s_ref, v_ref = score_gemm(keys, qs), value_gemm(e, vals)
        differs |= not (torch.equal(score_gemm(keys, qs[:, :, :c]), s_ref[..., :c, :])
                        and torch.equal(value_gemm(e[..., :c, :].contiguous(), vals), v_ref[..., :c, :]))
    assert differs, f"the floor {floor} is higher than needed: {r} rows agree"


@pytest.mark.parametrize("out_f,in_f,residual", LINEAR_SHAPES)
def test_linears_agree_from_the_measured_floor(out_f, in_f, residual):
    """A linear call narrower than the floor measured at startup for its shape is padded,
    because a CPU's kernel may reduce a lone row differently; calls of up to kernels.MAX_ROWS
    rows run through the kernel where the probe found it gives oneDNN's bits. Here, on other
    weights and inputs than the probe's, every row count from 1 to 40 and a few wide ones,
    called as the model calls it, returns the bits of the same rows of a 700-row oneDNN call."""
    from probity.engine.calibration import probe_linear
    from probity.engine.linear import Linear

    gen = torch.Generator().manual_seed(out_f * 7 + in_f)
    lin = Linear(torch.randn(out_f, in_f, generator=gen) / in_f ** 0.5, torch.randn(out_f, generator=gen),
                 residual=residual)
    floor, kb = probe_linear(lin)
    lin.calibrated(floor, kb)
    x = torch.randn(700, in_f, generator=gen)
    r = torch.randn(700, out_f, generator=gen) if residual else None
    wide = lin(x, r)
    for m in [*range(1, 41), 100, 333]:
        got = lin(x[:m], None if r is None else r[:m])
        assert torch.equal(got, wide[:m]), f"{m} rows differ from a wide call although the floor is {floor}"


@pytest.mark.parametrize("out_f,in_f,residual", LINEAR_SHAPES)
def test_linear_floor_on_this_cpu_is_not_higher_than_needed(out_f, in_f, residual):
    """Where this CPU's measured floor for a shape is above 1, the widest probed count below it
    does differ from a wide call. Where it is 1 there is no narrower call, and the test says so
    (the probe's minimality is checked on every CPU with a simulated GEMM:
    test_probe_linear_finds_...)."""
    from probity.engine.calibration import LINEAR_PROBE, LINEAR_PROBE_WIDE, probe_linear
    from probity.engine.linear import Linear

    gen = torch.Generator().manual_seed(out_f * 7 + in_f)
    lin = Linear(torch.randn(out_f, in_f, generator=gen) / in_f ** 0.5, torch.randn(out_f, generator=gen),
                 residual=residual)
    floor, _ = probe_linear(lin)
    if floor == 1:
        pytest.skip(f"this CPU's linear floor for {out_f}x{in_f} is 1: no narrower call exists")
    m = max(c for c in LINEAR_PROBE if c < floor)   # the widest probed count below the floor
    x = torch.randn(LINEAR_PROBE_WIDE, in_f, generator=gen)
    r = torch.randn(LINEAR_PROBE_WIDE, out_f, generator=gen) if residual else None
    assert not torch.equal(lin.gemm(x[:m], None if r is None else r[:m]), lin.gemm(x, r)[:m]), \
        f"the floor {floor} is higher than needed: {m} rows agree"


def _differs_below(real, rows_of, need: int):
    """`real`, except that a call narrower than `need` rows gives other bits (each output the
    next float up): what a CPU whose kernel reduces narrow calls differently looks like."""
    def gemm(*args, **kw):
        y = real(*args, **kw)
        return torch.nextafter(y, torch.full_like(y, math.inf)) if rows_of(args, y) < need else y
    return gemm


@pytest.mark.parametrize("need,floor", [(1, 1), (2, 2), (5, 5), (17, 17), (20, 24), (24, 24), (100, 128), (128, 128)])
@pytest.mark.parametrize("residual", [False, True])
def test_probe_linear_finds_exactly_the_floor_a_gemm_needs(need, floor, residual, monkeypatch):
    """On every CPU, whatever its own floors: a GEMM that gives calls narrower than `need` rows
    other bits gets from the probe the smallest count it probes that is not below `need` --
    not less (narrower calls would go unpadded), not more -- and the layer calibrated with it
    pads narrower calls and returns the bits of the real wide call for every count."""
    from probity.engine.calibration import LINEAR_PROBE, probe_linear
    from probity.engine.linear import Linear

    assert floor == min(c for c in LINEAR_PROBE if c >= need)
    gen = torch.Generator().manual_seed(need)
    lin = Linear(torch.randn(96, 64, generator=gen), torch.randn(96, generator=gen), residual=residual)
    real = lin.gemm
    monkeypatch.setattr(lin, "gemm", _differs_below(real, lambda a, y: a[0].shape[0], need))
    assert probe_linear(lin)[0] == floor
    lin.calibrated(floor, None)   # oneDNN for every call: the padding path is what is checked
    x = torch.randn(300, 64, generator=gen)
    r = torch.randn(300, 96, generator=gen) if residual else None
    wide = real(x, r)   # the unmodified GEMM
    for m in [*range(1, 41), 100, 127, 128, 129]:
        assert torch.equal(lin(x[:m], None if r is None else r[:m]), wide[:m]), m


@pytest.mark.parametrize("which", ["score_gemm", "value_gemm"])
@pytest.mark.parametrize("need", [1, 2, 4, 16, 48])
def test_attention_min_rows_finds_exactly_the_floor_a_gemm_needs(which, need, monkeypatch):
    """A score or value GEMM that gives calls of fewer than `need` rows per item other bits
    gets exactly the floor `need` (a row bucket) from the probe."""
    from probity.engine import kernels
    from probity.engine.calibration import attention_min_rows
    from probity.engine.runner import PROBE_ROWS, row_buckets

    group, buckets = 2, row_buckets(PROBE_ROWS)
    assert need in buckets
    monkeypatch.setattr(kernels, which, _differs_below(getattr(kernels, which), lambda a, y: y.shape[-2], need * group))
    assert attention_min_rows(64, group, buckets) == need


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
