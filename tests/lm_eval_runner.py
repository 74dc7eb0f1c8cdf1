"""Run lm-evaluation-harness, unmodified, several times in one process; run by .venv-lmeval's python.

Usage: lm_eval_runner.py RUNS.json OUT.json, where RUNS.json is
{"tasks": [...], "include_path": dir, "runs": {name: {"model", "model_args", "batch_size"}}}.
`lm_eval.simple_evaluate` is what the `lm_eval` command calls; one process for all runs saves
lm-eval's import time (tens of seconds on a loaded machine) per run.
OUT.json: {name: {"results": {task: {metric: value}}, "samples": {task: [logged sample]}, "seconds"}}.
"""
from __future__ import annotations

import json
import sys
import time

import lm_eval
from lm_eval.tasks import TaskManager


def main(runs_path: str, out_path: str) -> None:
    cfg = json.loads(open(runs_path).read())
    # only the local tasks: the ~14,000 built-in task configs are not indexed (6 s here)
    tasks = TaskManager(include_path=cfg["include_path"], include_defaults=False)
    out = {}
    for name, run in cfg["runs"].items():
        t0 = time.monotonic()
        res = lm_eval.simple_evaluate(model=run["model"], model_args=run["model_args"], tasks=cfg["tasks"],
                                      batch_size=run["batch_size"], device="cpu", log_samples=True,
                                      task_manager=tasks, bootstrap_iters=0)
        out[name] = {"results": res["results"], "samples": res["samples"], "seconds": time.monotonic() - t0}
    with open(out_path, "w") as f:
        json.dump(out, f, default=str)


if __name__ == "__main__":
    main(*sys.argv[1:])
