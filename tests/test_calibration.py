"""The startup calibration cache: measured once, read back verified, re-measured when wrong."""
from __future__ import annotations

import json

import torch

from probity.engine import calibration as C
from probity.engine.calibration import attention_min_rows, probe_linear
from probity.engine.linear import Linear
from probity.engine.runner import row_buckets


def linears() -> list[Linear]:
    gen = torch.Generator().manual_seed(3)
    return [Linear(torch.randn(96, 64, generator=gen)),
            Linear(torch.randn(64, 128, generator=gen), torch.randn(64, generator=gen), residual=True)]


def test_a_second_start_reads_the_calibration_back_and_gets_the_same_answers(tmp_path):
    first = C.Calibration(tmp_path)
    answers = [first.linear(lin) for lin in linears()] + [first.attention(16, 2, row_buckets(512))]
    assert (first.measured, first.reused) == (3, 0)
    first.save()
    assert answers[:2] == [probe_linear(lin) for lin in linears()]
    assert answers[2] == attention_min_rows(16, 2, row_buckets(512))

    second = C.Calibration(tmp_path)
    again = [second.linear(lin) for lin in linears()] + [second.attention(16, 2, row_buckets(512))]
    assert again == answers and (second.measured, second.reused, second.failed) == (0, 3, 0)
    assert "verified" in second.summary()


def test_a_cached_entry_that_no_longer_holds_is_measured_again(tmp_path):
    first = C.Calibration(tmp_path)
    lin = linears()[0]
    right = first.linear(lin)
    first.save()
    data = json.loads(first.path.read_text())
    (key,) = [k for k in data["entries"] if k.startswith("linear/")]
    # a k-block no kernel order gives: verification on fresh data must catch it
    data["entries"][key] = [right[0], 3] if right[1] is not None else [0, None]
    first.path.write_text(json.dumps(data))
    second = C.Calibration(tmp_path)
    assert second.linear(lin) == right and (second.failed, second.measured) == (1, 1)
    second.save()
    assert json.loads(second.path.read_text())["entries"][key] == list(right)


def test_the_cache_key_holds_what_the_outcome_depends_on(tmp_path, monkeypatch):
    fp = C.fingerprint()
    assert {"cpu", "cpu_flags", "torch", "torch_config", "threads", "kernels", "code"} <= set(fp)
    a = C.Calibration(tmp_path)
    a.linear(linears()[0])
    a.save()
    monkeypatch.setattr(C, "_sources", lambda: b"other kernels")  # an edited probe or kernel
    b = C.Calibration(tmp_path)
    assert b.path != a.path and not b.entries
    monkeypatch.setenv("PROBITY_CALIBRATION", "fresh")
    assert C.Calibration.default().path is None


def test_the_fused_decode_attention_is_used_only_where_it_gives_the_general_paths_bits(monkeypatch):
    """The fused decode attention claims the general path's operations in its order; the
    calibration checks the claim on this CPU. A kernel whose result is off by one part in 10^7
    is caught and not used (then every decode takes the general path)."""
    from probity.engine import kernels

    if kernels.lib() is None:
        assert C.probe_decode_attention(64, 3, 3) is not None
        return
    assert C.probe_decode_attention(64, 3, 3) is None      # the default model's shape
    assert C.probe_decode_attention(16, 2, 2) is None      # the tests' tiny model
    real = kernels.decode_attention
    monkeypatch.setattr(kernels, "decode_attention", lambda *a, **k: real(*a, **k) * (1 + 1e-7))
    assert "general path" in C.probe_decode_attention(64, 3, 3)


def test_the_fused_decode_attention_gives_the_general_paths_bits_on_random_groups():
    """Beyond the startup probe's three position sets: random item counts, key lengths and
    positions (visible ends anywhere in a 16-key vector, whole slices past an item's end),
    score scales from 0.1 to 100 (so the clamp at EXP_FLOOR is hit), several head shapes;
    the kernel's vectorized maximum, clamp and masks must give the general path's bits, as raw
    float bits. A visibility mask one key short in the kernel fails this."""
    import random

    from probity.engine import kernels
    from probity.engine.attention import KEY_ALIGN

    if kernels.lib() is None:
        return
    rnd, gen = random.Random(7), torch.Generator().manual_seed(7)
    for _ in range(120):
        hd, n_kv, group = rnd.choice([(64, 3, 3), (16, 2, 2), (128, 1, 4), (32, 2, 5)])
        items, L = rnd.randint(1, 9), KEY_ALIGN * rnd.randint(1, 4)
        positions = [rnd.randrange(L) for _ in range(items)]
        scale = rnd.choice([0.1, 1.0, 10.0, 100.0])
        fused, general = C.decode_both_ways(hd, n_kv, group, positions, L, scale, gen)
        assert torch.equal(fused.view(torch.int32), general.view(torch.int32)), (hd, items, L, positions, scale)
