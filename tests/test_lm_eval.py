"""Unmodified lm-evaluation-harness `local-completions` against the default model: tokenized and
not, batch 1 and 8. lm-eval lives in its own venv (.venv-lmeval, made by `make setup`) so its
dependencies cannot move probity's pins. The tasks read local files; nothing downloads."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from conftest import ROOT

TASKS = Path(__file__).parent / "lm_eval_tasks"
LM_EVAL = ROOT / ".venv-lmeval" / "bin" / "lm_eval"
pytestmark = pytest.mark.default_model


def run_lm_eval(server, tokenized: bool, batch: int, out: Path) -> dict:
    args = [str(LM_EVAL), "--model", "local-completions", "--model_args",
            f"model=SmolLM2-135M-Instruct,base_url={server.url}/v1/completions,num_concurrent=1,max_retries=1,"
            f"tokenized_requests={tokenized}",
            "--batch_size", str(batch), "--tasks", "probity_mc,probity_gen", "--include_path", ".",
            "--output_path", str(out), "--log_samples"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OPENAI_API_KEY": "none"}
    p = subprocess.run(args, cwd=TASKS, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-4000:]
    samples = {}
    for f in out.rglob("samples_probity_mc_*.jsonl"):
        for line in f.read_text().splitlines():
            s = json.loads(line)
            samples[s["doc_id"]] = s["resps"]
    assert len(samples) == 9
    return samples


@pytest.mark.parametrize("tokenized", [True, False])
def test_lm_eval_local_completions_batch_1_and_8_agree(default_server, tmp_path, tokenized):
    assert LM_EVAL.exists(), "make setup installs lm-eval into .venv-lmeval"
    one = run_lm_eval(default_server, tokenized, 1, tmp_path / "b1")
    eight = run_lm_eval(default_server, tokenized, 8, tmp_path / "b8")
    # the same loglikelihoods and greedy flags, bit for bit, whether requests came alone or batched
    assert one == eight
