"""Weights as stored: bf16/f16 and GGUF-quantized weights stay that size in memory and are
expanded, where they are used, to the very float32 values of the reference de-quantization;
so a model served as stored gives the raw bits of the same model served from its float32
de-quantization, and transformers' numbers on the file within the fidelity budget."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from conftest import LiveServer
from test_invariance import Harness, alone, plan_random, reported_gap
from tiny_gguf import K_QUANTS, dequantized_model, write_tiny_gguf

from probity.engine.stored import TYPES, pack

GGUF_TYPES = [t for t in TYPES if t not in ("F16",)] + ["F16"]


def _f16_bits(rng, shape) -> np.ndarray:
    """Finite float16 bit patterns: normal and subnormal values of both signs, zeros, the
    largest and the smallest."""
    v = rng.integers(0, 0x7C00, size=shape, dtype=np.uint16) | (rng.integers(0, 2, size=shape, dtype=np.uint16) << 15)
    pick = rng.random(shape)
    v[pick < 0.05] = 0
    v[(pick >= 0.05) & (pick < 0.08)] = 0x7BFF
    v[(pick >= 0.08) & (pick < 0.12)] = 0x0001
    v[(pick >= 0.12) & (pick < 0.14)] = 0x8001
    return v


def _random_blocks(kind: str, rng, n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """An [n, k] weight of `kind` as raw random blocks whose scales are every kind of finite
    float16 (normal, subnormal, zero, extreme), and gguf-py's float32 de-quantization of it."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

    qt = getattr(GGMLQuantizationType, kind)
    per, size = GGML_QUANT_SIZES[qt]
    nb = n * k // per
    if kind == "F16":
        raw = _f16_bits(rng, (n * k,)).view(np.uint8)
    elif kind == "BF16":
        raw = (rng.integers(0, 0x7F80, size=n * k, dtype=np.uint16)
               | (rng.integers(0, 2, size=n * k, dtype=np.uint16) << 15)).view(np.uint8)
    else:
        raw = rng.integers(0, 256, size=(nb, size), dtype=np.uint8)
        for off in {"Q4_1": (0, 2), "Q5_1": (0, 2), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}.get(kind, (0,)):
            raw[:, off:off + 2] = _f16_bits(rng, (nb,)).view(np.uint8).reshape(nb, 2)
    raw = raw.reshape(n, -1)
    return raw, quants.dequantize(raw, qt).reshape(n, k).astype(np.float32)


@pytest.mark.parametrize("kind", list(TYPES))
def test_expansion_equals_gguf_py_bit_for_bit(kind):
    """Random blocks of every type (every scale finite: normal, subnormal, zero, extreme) expand
    to gguf-py's de-quantization exactly, whole and row by row."""
    n, k = 37, 512
    raw, ref = _random_blocks(kind, np.random.default_rng(list(TYPES).index(kind)), n, k)
    w = pack(kind, raw, (n, k))
    got = w.expand().numpy()
    assert np.array_equal(got.view(np.uint32), ref.view(np.uint32))
    ids = torch.tensor([36, 0, 17, 16, 15])
    assert np.array_equal(w.rows(ids).numpy().view(np.uint32), ref[ids.numpy()].view(np.uint32))


def _harness_of(model) -> Harness:
    h = Harness.__new__(Harness)
    from probity.engine.engine import BLOCK_SIZE
    from probity.engine.kv_cache import BlockPool
    from probity.engine.runner import ModelRunner

    h.pool = BlockPool(400, BLOCK_SIZE)
    h.runner = ModelRunner(model, 400, BLOCK_SIZE, max_rows=1024)
    h.vocab_size = h.runner.vocab_size
    return h


@pytest.mark.parametrize("kind", GGUF_TYPES)
def test_a_gguf_in_each_type_is_served_as_its_float32_dequantization(kind, tiny_model_dir, tmp_path):
    """A tiny Llama written in `kind` is read as stored (no float32 copy of its weights) and gives
    the raw bits of the same model de-quantized to float32 by transformers' GGUF loader: alone,
    chunked, decoded and batched; and within the fidelity budget of transformers' forward."""
    from probity.engine.loader import load
    from probity.engine.model import build

    path = write_tiny_gguf(tmp_path / f"tiny-{kind}.gguf", kind, tiny_model_dir,
                           hidden=256 if kind in K_QUANTS else 64)
    loaded = load(str(path))
    assert loaded.model is None and loaded.weights is not None   # read as stored, nothing converted
    stored = build(config=loaded.config, weights=loaded.weights)
    reference = dequantized_model(path)
    rng = random.Random(3)
    ids = [rng.randrange(loaded.config.vocab_size) for _ in range(60)]
    with torch.no_grad():
        want_hf = reference(torch.tensor([ids])).logits[0].float()
    ours = _harness_of(stored)
    fp32 = _harness_of(build(reference))
    memory = ours.runner.memory()
    assert memory["weights_kernels"] == 0 and memory["weights_stored"] > 0
    want = alone(fp32, ids)
    assert torch.equal(alone(ours, ids), want)
    assert torch.equal(ours.run([ids], [[(0, 1)] for _ in ids])[0], want)
    seqs = [ids] + [[rng.randrange(loaded.config.vocab_size) for _ in range(rng.randint(1, 50))] for _ in range(3)]
    assert torch.equal(ours.run(seqs, plan_random([len(s) for s in seqs], rng, 17))[0], want)
    assert reported_gap(want, want_hf, ids) < 1e-4


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_a_16_bit_checkpoint_is_served_as_its_exact_upcast(family, dtype, tiny_model_dir, tmp_path):
    """A checkpoint saved in 16 bits is loaded in 16 bits, its linear weights kept so, and gives
    the raw bits of the same checkpoint upcast to float32 (an exact conversion): on probity's
    own forward (llama) and on the general path (gemma2)."""
    from transformers import AutoModelForCausalLM

    from probity.engine.loader import load
    from probity.engine.model import build
    from test_families import tiny

    from transformers import AutoTokenizer

    hf = tiny(family).to(dtype)
    folder = tmp_path / f"{family}-{dtype}"
    hf.save_pretrained(folder)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(folder)
    loaded = load(str(folder))
    assert loaded.model.dtype == dtype
    upcast = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ours, ref = _harness_of(build(loaded.model)), _harness_of(build(upcast))
    memory = ours.runner.memory()
    assert memory["weights_kernels"] == 0 and memory["weights_stored"] > 0
    rng = random.Random(5)
    ids = [rng.randrange(300) for _ in range(50)]
    want = alone(ref, ids)
    assert torch.equal(alone(ours, ids), want)
    assert torch.equal(ours.run([ids], [[(0, 1)] for _ in ids])[0], want)


@pytest.mark.default_model
def test_the_default_model_is_served_from_its_gguf_blocks_within_its_memory_bound():
    """The default model's Q4_1/Q8_0 blocks are what the engine holds (about the file's size),
    nothing is converted into the cache, and its engine stays within 1.2 GiB resident with
    --kv-cache-gib 0.25 after answering."""
    import os
    import shutil
    import tempfile

    from probity.engine.cache_dir import cache_dir
    from probity.engine.loader import default_model_path

    with tempfile.TemporaryDirectory() as cache:
        shutil.copytree(cache_dir("kernels"), os.path.join(cache, "kernels"))   # the compiled kernels, as make setup leaves them
        s = LiveServer(["--threads", "1", "--kv-cache-gib", "0.25"], env={"PROBITY_CACHE_DIR": cache})
        try:
            r = s.post("/v1/completions", json={"model": "SmolLM2-135M-Instruct", "prompt": "The capital of France is",
                                                "max_tokens": 8, "temperature": 0, "echo": True, "logprobs": 5})
            assert r.status_code == 200
            m = s.get("/health").json()["engine"]["memory"]
            size = default_model_path().stat().st_size
            assert m["weights_kernels"] == 0
            assert 0.9 * size <= m["weights_stored"] <= 1.1 * size
            assert m["resident"] <= 1.2 * 2**30, m
            assert sorted(os.listdir(cache)) == ["kernels"]   # no converted model
        finally:
            s.stop()


@pytest.mark.parametrize("kind", list(TYPES))
def test_the_kernels_read_each_weight_as_the_reference_expands_it(kind):
    """The kernels' own in-register expansion (a few rows: fused; more: block by block), over
    random blocks with extreme, subnormal and zero scales: multiplying by one-hot inputs gives
    each weight back alone (1 * w + 0, exact), and it equals gguf-py's value bit for bit. This
    guards the single-rounding (FMA) forms of (s * q) + m and (s * q) - t, exact only because
    s * q is."""
    from probity.engine import kernels

    if kernels.lib() is None:
        pytest.skip(f"no kernel here: {kernels.why_not()}")
    n, k = 48, 256
    raw, ref = _random_blocks(kind, np.random.default_rng(11 + list(TYPES).index(kind)), n, k)
    ref = torch.from_numpy(ref)
    w = pack(kind, raw, (n, k))
    eye = torch.eye(k)
    for rows in (1, 3, 6, 12, 32):   # fused with 4, 2 and 1 panels side by side (12: AVX-512's most); wide
        for k0 in range(0, k, rows):
            got = kernels.linear_stored(eye[k0:k0 + rows], w, k)
            want = ref[:, k0:k0 + rows].T
            assert torch.equal(got, want), (rows, k0)   # +0 and -0 compare equal: 0 * w may be either


@pytest.mark.parametrize("kind", list(TYPES))
def test_the_stored_kernel_gives_the_float32_kernels_bits(kind):
    """A narrow call on a stored weight (expanded panel by panel, or position by position into
    registers for up to 12 rows on AVX-512 and 6 on AVX2, one to four panels side by side) equals the float32 kernel on the expanded weight, bit
    for bit, at every row count it serves, with several k-blocks (kernels.KB among them), with
    bias and residual."""
    from tiny_gguf import _k_blocks

    from probity.engine import kernels

    if kernels.lib() is None:
        pytest.skip(f"no kernel here: {kernels.why_not()}")
    rng = np.random.default_rng(7)
    n, k = 1000, 512
    raw = (_k_blocks(kind, n, k, rng) if kind in K_QUANTS
           else rng.integers(0, 256, size=(n, k // TYPES[kind][1] * TYPES[kind][2]), dtype=np.uint8))
    if kind not in K_QUANTS and kind not in ("F16", "BF16"):
        blocks = raw.reshape(-1, TYPES[kind][2])
        blocks[:, 0:2] = (rng.random(len(blocks)) * 0.01).astype(np.float16).view(np.uint8).reshape(-1, 2)
        if kind in ("Q4_1", "Q5_1"):
            blocks[:, 2:4] = (rng.random(len(blocks)) * -0.05).astype(np.float16).view(np.uint8).reshape(-1, 2)
    elif kind == "F16":
        raw = (rng.standard_normal((n, k)) * 0.05).astype(np.float16).view(np.uint8)
    elif kind == "BF16":
        raw = torch.randn(n, k).mul(0.05).to(torch.bfloat16).view(torch.uint16).numpy().view(np.uint8)
    w = pack(kind, raw, (n, k))
    packed = kernels.pack(w.expand())
    x = torch.randn(32, k)
    bias, res = torch.randn(n), torch.randn(32, n)
    for kb in (128, 256, 512):
        for m in (1, 2, 3, 4, 5, 6, 7, 8, 12, 13, 32):
            assert torch.equal(kernels.linear_stored(x[:m], w, kb), kernels.linear(x[:m], packed, n, kb)), (kb, m)
        assert torch.equal(kernels.linear_stored(x[:3], w, kb, bias, res[:3]),
                           kernels.linear(x[:3], packed, n, kb, bias, res[:3]))
        assert torch.equal(kernels.linear_stored(x[:9], w, kb, bias, res[:9]),
                           kernels.linear(x[:9], packed, n, kb, bias, res[:9]))
