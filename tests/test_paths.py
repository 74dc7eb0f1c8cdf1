"""Every path runs the suites that guard the numbers (issue 37): the invariance tests, the
stored-weights tests and the lm-eval fidelity tests pass under PROBITY_ISA=avx2 as they do
natively, and the invariance and numerics tests under the portable build (generic; the stored
weights are expanded there, and its numbers on the default model are test_golden's and
test_isa's). Each runs in a child pytest whose kernels and engines take the path; the
references (transformers, lm-eval `hf` in-process) keep the machine's own torch, so they stay
the same independent yardstick."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import ROOT
from probity.engine import isa

NARROWER = isa.runnable(isa.cpu_flags())[1:]
SUITES = {
    "avx512": ["tests/test_invariance.py", "tests/test_stored.py", "tests/test_lm_eval_fidelity.py"],
    "avx2": ["tests/test_invariance.py", "tests/test_stored.py", "tests/test_lm_eval_fidelity.py"],
    # the portable build emulates every FMA (~40x slower): the tiny model's tests only
    "generic": ["tests/test_invariance.py", "tests/test_numerics.py", "-m", "not default_model and not lm_eval"],
}


@pytest.mark.default_model
@pytest.mark.lm_eval
@pytest.mark.parametrize("path", NARROWER)
def test_the_numbers_suites_pass_on_every_narrower_path(path):
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *SUITES[path]],
                       cwd=ROOT, env={**os.environ, "PROBITY_ISA": path}, capture_output=True, text=True,
                       timeout=1500)
    assert r.returncode == 0, r.stdout[-4000:]
    assert " passed" in r.stdout.splitlines()[-1], r.stdout[-500:]
