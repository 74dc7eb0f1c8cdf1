"""probity's own engine: each step, the scheduler picks the rows, the runner computes them,
and the sampler draws; what comes out is reported through the engine core (core.py)."""
from __future__ import annotations

import dataclasses
import os
import queue
import time
import traceback

import torch

from .core import EngineCore
from .request import Choice, Request
from .flags import EngineFlags
from . import isa, kernels
from .grammar import Grammars, allowed, renormalised
from .heap import keep_freed_memory, release_freed_memory
from .loader import Loaded
from .log import log
from .model import UnsupportedModel
from .model import build as build_model
from .llama import LlamaModel
from .model import path as model_path
from .pipe import Writer, open_pipe
from .runner import ModelRunner, kv_blocks, resident_bytes
from .sampler import new_generator, sample_many
from .tables import row_reports, top_tables
from .scheduler import Scheduler
from .sequence import Sequence, Status
from .stop_text import StopText
from .vocab import Vocab

ENGINE_BUILD = "probity-engine-3"   # the numerics version: raised whenever an operation's order changes
BLOCK_SIZE = 4


class Engine(EngineCore):
    def __init__(self, loaded: Loaded, out: Writer, inbox: queue.Queue, flags: EngineFlags = EngineFlags()):
        super().__init__(out, inbox)
        if kernels.lib() is None:   # they compute every number: there is no other path
            raise isa.IsaError(f"probity's kernels could not be built or loaded here: {kernels.why_not()}")
        if flags.threads:
            torch.set_num_threads(flags.threads)
        t0 = time.monotonic()
        model = build_model(loaded.model, config=loaded.config, weights=loaded.weights, consume=True)
        loaded.model = loaded.weights = None  # the model holds its own weights; free the loader's
        log(f"weights ready in {time.monotonic() - t0:.1f}s")
        log(f"forward: {model_path(model)}")
        num_blocks = kv_blocks(model, flags.kv_cache_gib, BLOCK_SIZE)
        self.runner = ModelRunner(model, num_blocks, BLOCK_SIZE, max_rows=flags.step_tokens,
                                  kept_keys_bytes=int(flags.kept_keys_gib * (1 << 30)))
        self.scheduler = Scheduler(num_blocks, BLOCK_SIZE, flags.max_running, flags.step_tokens, flags.prefix_cache)
        self.vocab = Vocab(loaded.tokenizer, self.runner.vocab_size)
        self.context_length = min(self.runner.context_length, self.scheduler.pool.capacity_tokens)
        self.model_id, self.source, self.dtype = loaded.model_id, loaded.source, "float32"
        # what the numbers depend on: the weights, this engine's numerics (ENGINE_BUILD), the
        # dtype, and a digest of the numbers themselves on a fixed probe. probity's own forward
        # computes one order on every instruction-set path and thread count, so they are not
        # part of it; transformers' modules (the general path) compute some operations with
        # torch's own kernels, whose order follows the path and the threads, so there they are.
        path = isa.chosen()
        isa.check_held(path)
        self.numerics = self.runner.numerics_digest()
        log(f"instruction-set path: {path} (torch {torch.backends.cpu.get_cpu_capability()}, kernels: "
            f"{kernels.describe()}); numbers digest {self.numerics}")
        general = not isinstance(model, LlamaModel) or kernels.lib() is None
        self.fingerprint = (f"fp_{loaded.digest[:12]}_{ENGINE_BUILD.removeprefix('probity-')}_f32"
                            + (f"_{path}_t{torch.get_num_threads()}" if general else "") + f"_n{self.numerics}")
        self.concurrency = flags.max_running
        self.batch_invariant, self.prefix_cache = True, flags.prefix_cache
        self.row_reports, self.max_distribution_floats = True, flags.max_distribution_floats
        self.forward_passes = 0
        self.grammars = Grammars(loaded.tokenizer, self.runner.vocab_size, self.vocab.eos_ids,
                                 cache_bytes=int(flags.grammar_cache_mib * (1 << 20)))
        release_freed_memory()   # loading's and the startup probes' temporaries, before memory is measured
        self._memory = {**self.runner.memory(), "grammar_cache_max": self.grammars.cache_bytes}
        log("memory: " + ", ".join(f"{k} {v / (1 << 30):.2f} GiB" for k, v in self._memory.items()))

    # ------------------------------------------------------------ the core's hooks
    def new_choice(self, req: Request, member: int, choice: int) -> Sequence:
        return Sequence(request=req, member=member, choice=choice, prompt=req.prompts[member],
                        stop_text=StopText(list(req.sampling.stop)),
                        generator=new_generator(req.sampling.seed, choice))

    def admit(self, req: Request) -> None:
        digests = [self.scheduler.prompt_digests(ids, req.sampling.cache_salt) for ids in req.prompts]
        for seq in req.choices:
            if seq.finished:
                seq.status = Status.FINISHED
            else:
                seq.digests = list(digests[seq.member])
                self.scheduler.add(seq)

    def cached_at_accept(self, req: Request) -> list[int]:
        firsts = {q.member: q for q in reversed(req.choices)}
        return [self.scheduler.cached_tokens(ids, firsts[m].digests) for m, ids in enumerate(req.prompts)]

    def on_finish(self, q: Choice) -> None:
        self.scheduler.finish(q)

    def release(self, req: Request) -> None:
        self.scheduler.drop(req)

    def memory(self) -> dict:
        return self._memory

    def stats(self) -> dict:
        s, pool = self.scheduler, self.scheduler.pool
        return {"active": len(s.running), "waiting": len(s.waiting), "forward_passes": self.forward_passes,
                "preemptions": s.preemptions, "prefix_query_tokens": s.query_tokens,
                "prefix_hit_tokens": s.hit_tokens, "kv_blocks_used": pool.used, "kv_blocks_total": pool.num_blocks - 1,
                "resident_bytes": resident_bytes(), "grammar_cache_bytes": self.grammars.cached_bytes,
                "grammar_cache_entries": self.grammars.cached_entries}

    def timings(self, req: Request) -> dict:
        return {"queue_s": (req.t_first or time.monotonic()) - req.t_submit,
                "prefill_s": req.prefill_s, "decode_s": req.decode_s}

    # ------------------------------------------------------------ one step
    def step(self) -> None:
        batch = self.scheduler.schedule()
        if not batch:
            return
        self.steps += 1
        self.forward_passes += 1
        t0 = time.monotonic()
        for seq, _ in batch:
            if seq.request.t_first is None:
                seq.request.t_first = t0
        # the constrained choices' masks, computed while the forward runs (their matchers'
        # states do not change until a token is drawn)
        constrained = [seq for seq, _ in batch if seq.matcher is not None and not seq.finished]
        computing = self.grammars.start_masks([seq.matcher for seq in constrained])
        try:
            results = self.runner.step(batch, lambda seq: not seq.done_budget)
            mask_of = dict(zip(map(id, constrained), computing.result())) if computing is not None else {}
        except Exception as e:
            log(f"forward failed: {traceback.format_exc()}")
            for req in {id(seq.request): seq.request for seq, _ in batch}.values():
                self.fail(req, e)
            return
        dt = time.monotonic() - t0
        requests = {id(seq.request): seq.request for seq, _ in batch}
        prefilling = {id(seq.request) for seq, _ in batch if seq.remaining > 1}
        for key, req in requests.items():
            if key in prefilling:
                req.prefill_s += dt
            else:
                req.decode_s += dt
        self.prompt_tokens_computed += self.scheduler.postprocess(batch)
        for (seq, _), res in zip(batch, results):
            if res.echo:
                self.send_echo(seq.request, seq.member, res.echo)
        drawn, masks = [], []
        for (seq, _), res in zip(batch, results):
            if res.logits is None or seq.finished:
                continue
            mask = None
            if seq.matcher is not None:
                mask = allowed(mask_of[id(seq)], res.logits.shape[-1])
                if seq.matcher.is_error() or not bool(mask.any()):
                    self.dead_end(seq)
                    continue
            drawn.append((seq, res))
            masks.append(mask)
        tokens = sample_many([res.logits for _, res in drawn], [seq for seq, _ in drawn], masks)
        for (seq, res), token, mask in zip(drawn, tokens, masks):
            self.advance(seq, token, res.lp, mask)
        for req in requests.values():
            if req.finished and self.requests.get(req.id) is req:
                self.done(req)

    def advance(self, seq: Sequence, token: int, lp: torch.Tensor, mask: torch.Tensor | None = None) -> None:
        """Report the token sampled from the last position (lp: that row's log-softmax; mask:
        the tokens its grammar allowed)."""
        s = seq.request.sampling
        if s.presence_penalty or s.frequency_penalty:
            if seq.counts is None:
                seq.counts = torch.zeros(lp.shape[-1])
            seq.counts[token] += 1
        constrained = s.constrained_logprobs and mask is not None
        if constrained:
            lp = renormalised(lp, mask)
        table = top_tables(lp.unsqueeze(0), [token], s.logprobs)[0] if s.logprobs is not None else None
        if table is not None and constrained:
            table = [(i, v) for i, v in table if v != -float("inf")]   # only what the grammar allowed
        row = row_reports(lp.unsqueeze(0), s.distribution, s.score_tokens) if s.reports_rows else None
        self.accept_token(seq, token, lp[token].item(), table, row[0] if row else None)


def main(argv: list[str] | None = None) -> None:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m probity.engine", description="probity engine child (speaks the pipe on stdin/stdout)")
    ap.add_argument("--model", default="default")
    EngineFlags.add_to(ap)
    args = ap.parse_args(argv)
    flags = EngineFlags.from_args(args)

    keep_freed_memory(int(max(flags.heap_keep_gib, 0) * (1 << 30)))
    out, inbox = open_pipe()
    if flags.problem():
        log(f"error: {flags.problem()}")
        os._exit(3)
    if flags.threads is None:
        flags = dataclasses.replace(flags, threads=os.cpu_count())

    from .loader import ModelNotFound, load
    try:
        loaded = load(args.model)
    except ModelNotFound as e:
        log(f"error: {e}")
        os._exit(3)
    except Exception as e:  # a file transformers cannot read: say so plainly
        log(f"error: cannot load model {args.model!r}: {type(e).__name__}: {e}")
        os._exit(3)
    try:
        engine = Engine(loaded, out, inbox, flags)
    except (UnsupportedModel, isa.IsaError) as e:
        log(f"error: {e}")
        os._exit(3)
    engine.run()
