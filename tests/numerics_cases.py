"""Fixed inputs for every kernel that computes a reported number, and the kernels' outputs on
them: test_numerics.py computes them here and under each PROBITY_ISA in a child process
(`python numerics_cases.py OUT`, the path in the environment), and checks them against an
exact reference of the documented order."""
from __future__ import annotations

import sys

import numpy as np
import torch


def inputs() -> dict[str, torch.Tensor]:
    # numpy's generator: torch's randn draws other numbers on another instruction-set path
    g = np.random.default_rng(37)
    r = lambda *s: torch.from_numpy(g.standard_normal(s, dtype=np.float32))  # noqa: E731
    return {
        # K crosses the 512-value block; 40 rows take the wide kernel, 1 and 7 the narrow ones
        "x": r(40, 544), "w": r(18, 544) / 20, "b": r(18), "res": r(40, 18),
        "q": r(2, 1, 5, 64), "keys": r(2, 1, 128, 64), "e": torch.from_numpy(g.random((2, 1, 2, 5, 64), dtype=np.float32)),
        "vals": r(2, 1, 128, 65),
        "exp_in": torch.from_numpy(np.concatenate([
            np.linspace(-90, 90, 2001, dtype=np.float32), g.standard_normal(999, dtype=np.float32) * 30,
            np.array([0.0, -0.0, np.inf, -np.inf, 88.0, -88.0, 87.99, -87.5], dtype=np.float32)])),
        "logits": r(3, 1003) * 4,
        "gu": r(6, 2 * 77) * 3,
        # rotary angles: positions times inverse frequencies, as the forward makes them (numpy:
        # torch's vectorized pow differs between paths, which is why inv_freq is computed once)
        "angles": torch.from_numpy((np.arange(0, 4096, 7, dtype=np.float32)[:, None]
                                    * (1.0 / 10000.0 ** (np.arange(0, 64, 2) / 64)).astype(np.float32)[None, :])
                                   .reshape(-1)),
        "norm_x": r(5, 101), "norm_w": r(101),
    }


def outputs() -> dict[str, torch.Tensor]:
    from probity.engine import kernels as K
    i = inputs()
    packed = K.pack(i["w"])
    out = {}
    for m in (1, 7, 40):
        out[f"linear{m}"] = K.linear(i["x"][:m], packed, 18, K.KB, i["b"], i["res"][:m])
    out["score"] = K.score_gemm(i["keys"], i["q"])
    out["value"] = K.value_gemm(i["e"], i["vals"])
    out["exp"] = K.exp_(i["exp_in"].clone())
    out["log_softmax"] = K.log_softmax(i["logits"])
    out["silu_mul"] = K.silu_mul(i["gu"])
    out["cos"], out["sin"] = K.cos_sin(i["angles"])
    out["rms_norm"] = K.rms_norm(i["norm_x"], i["norm_w"], 1e-5)
    return out


if __name__ == "__main__":
    from probity.engine.isa import apply
    apply()
    from probity.engine import kernels
    torch.save({"build": kernels.describe(), **outputs()}, sys.argv[1])
