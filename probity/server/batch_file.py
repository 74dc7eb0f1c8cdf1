"""`probity batch IN.jsonl OUT.jsonl`: a batch file run without a server. The same application
as `probity serve` is built in-process (its engine child, its routes, its batch runner), the
file is run as one batch job in a scratch batch store, and every line's result — answers and
errors alike, in the order of the input — is written to OUT, as vLLM's run-batch does. A
progress bar counts lines on stderr."""
from __future__ import annotations

import asyncio
import json
import shutil
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

from .batches import BatchLimits, line_of


async def run_file(config, inp: Path, out: Path, progress: bool = True) -> dict:
    """Run `inp`'s lines through a server built from `config`; write OUT; the batch object."""
    from tqdm import tqdm

    from .app import create_app

    scratch = Path(tempfile.mkdtemp(prefix="probity-batch-"))
    try:
        config = replace(config, batch=BatchLimits(scratch, disk_bytes=1 << 62, max_file_bytes=1 << 62))
        app = create_app(config)
        async with app.router.lifespan_context(app):
            jobs = app.state.batches
            tmp = jobs.store.scratch()
            shutil.copyfile(inp, tmp)
            f = jobs.store.add_file(tmp, inp.name, "batch")
            b = jobs.create({"input_file_id": f["id"], "endpoint": "/v1/completions", "completion_window": "24h"})
            task = jobs.tasks[b["id"]]
            total = b["request_counts"]["total"]
            with tqdm(total=total, unit="line", file=sys.stderr, disable=not progress) as bar:
                while not task.done():
                    await asyncio.wait({task}, timeout=0.25)
                    c = jobs.get(b["id"])["request_counts"]
                    bar.n = c["completed"] + c["failed"]
                    bar.refresh()
            await task
            b = jobs.get(b["id"])
            lines = []
            for key in ("output_file_id", "error_file_id"):
                if b[key]:
                    lines += jobs.store.data(b[key]).read_bytes().splitlines()
            lines.sort(key=lambda x: line_of(json.loads(x)["id"]))
            tmp_out = out.with_name(out.name + ".part")
            tmp_out.write_bytes(b"".join(x + b"\n" for x in lines))
            tmp_out.replace(out)
            return b
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
