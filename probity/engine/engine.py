"""The engine's loop: read frames, admit requests, step the scheduler, answer in frames."""
from __future__ import annotations

import os
import queue
import time
import traceback

import torch

from .. import protocol as P
from ..protocol import finite_or_none
from .loader import Loaded, log
from .pipe import FrameHandler, Writer, open_pipe
from .model import UnsupportedModel
from .runner import ModelRunner, resident_bytes
from .sampler import new_generator, sample_many, top_tables
from .scheduler import Scheduler
from .sequence import Request, Sequence, Status, StopText
from .submit import Refusal, parse_generate
from .vocab import Vocab

STATS_EVERY = 1.0  # seconds between STATS frames while there is work
ENGINE_BUILD = "probity-engine-2"


class Engine(FrameHandler):
    def __init__(self, loaded: Loaded, out: Writer, inbox: queue.Queue, max_running: int = 64,
                 threads: int | None = None, step_tokens: int = 512, kv_cache_gib: float = 2.0,
                 prefix_cache: bool = True, kept_keys_gib: float = 1.0):
        self.loaded = loaded
        self.runner = ModelRunner(loaded.model, threads, kv_cache_gib, prefix_cache=prefix_cache, max_rows=step_tokens,
                                  kept_keys_bytes=int(kept_keys_gib * (1 << 30)))
        loaded.model = None  # the runner holds its own (prepacked) weights; free transformers' copy
        self.vocab = Vocab(loaded.tokenizer, self.runner.vocab_size)
        self.scheduler = Scheduler(self.runner.pool, max_running, step_tokens)
        self.requests: dict[int, Request] = {}
        self.inbox = inbox
        self.out = out
        self.shutting_down = False
        self.steps = 0
        self.forward_passes = 0
        self.prompt_tokens_computed = 0
        self.generated_tokens = 0
        self.tokens_since_stats = 0
        self.last_stats = time.monotonic()
        self.fingerprint = f"fp_{loaded.digest[:12]}_{ENGINE_BUILD}_f32_t{torch.get_num_threads()}"
        self.memory = self.runner.memory()
        log("memory: " + ", ".join(f"{k} {v / (1 << 30):.2f} GiB" for k, v in self.memory.items()))

    # ------------------------------------------------------------ I/O
    def ready(self) -> dict:
        tok = self.loaded.tokenizer
        return {
            "protocol": P.PROTOCOL_VERSION,
            "model": {
                "id": self.loaded.model_id,
                "context_length": self.runner.context_length,
                "vocab_size": self.vocab.size,
                "eos_token_ids": self.vocab.eos_ids,
                "bos_token": tok.bos_token if isinstance(tok.bos_token, str) else None,
                "eos_token": tok.eos_token if isinstance(tok.eos_token, str) else None,
                "pad_token": tok.pad_token if isinstance(tok.pad_token, str) else None,
                "dtype": "float32",
                "fingerprint": self.fingerprint,
                "chat_template": tok.chat_template if isinstance(tok.chat_template, str) else None,
                "source": self.loaded.source,
            },
            "capabilities": {
                "logprobs": True, "max_logprobs": P.MAX_LOGPROBS, "echo": True, "token_ids": True,
                "seed": True, "chat_template": self.vocab.has_chat_template,
                "max_members": P.MAX_MEMBERS, "max_choices": P.MAX_CHOICES,
                "batch_invariant": True, "prefix_cache": self.runner.pool.prefix_cache,
            },
            "concurrency": self.scheduler.max_running,
            "memory": self.memory,
        }

    def run(self) -> None:
        self.out.send("READY", 0, self.ready())
        busy = False
        while True:
            if not self.scheduler.has_work:
                if busy:  # idle for any reason (finished, cancelled, failed): say so now
                    self.maybe_stats(changed=True)
                    busy = False
                if self.shutting_down:
                    os._exit(0)
                self.handle(self.inbox.get())
            self.poll()  # a CANCEL takes effect before the next forward
            if self.scheduler.has_work:
                self.step()
                self.maybe_stats(changed=not busy)  # busy now: say so at once, then once a second
                busy = True

    def maybe_stats(self, changed: bool) -> None:
        now = time.monotonic()
        if now - self.last_stats < STATS_EVERY and not changed:
            return
        self.out.send("STATS", 0, {
            "active": len(self.scheduler.running), "waiting": len(self.scheduler.waiting),
            "tokens_per_s": self.tokens_since_stats / max(now - self.last_stats, 1e-6), "steps": self.steps,
            "forward_passes": self.forward_passes, "prompt_tokens_computed": self.prompt_tokens_computed,
            "generated_tokens": self.generated_tokens, "preemptions": self.scheduler.preemptions,
            "prefix_query_tokens": self.scheduler.query_tokens, "prefix_hit_tokens": self.scheduler.hit_tokens,
            "kv_blocks_used": self.runner.pool.used, "kv_blocks_total": self.runner.pool.num_blocks - 1,
            "resident_bytes": resident_bytes()})
        self.tokens_since_stats = 0
        self.last_stats = now

    # ------------------------------------------------------------ requests
    def start_generate(self, rid: int, p: dict) -> None:
        sampling, prompts = parse_generate(p, self.vocab, self.runner.context_length)
        req = Request(rid, sampling, prompts)
        for m, ids in enumerate(prompts):
            for c in range(sampling.n):
                req.sequences.append(Sequence(
                    request=req, member=m, choice=c, prompt=ids,
                    generator=new_generator(sampling.seed, c), stop_text=StopText(sampling.stop)))
        self.requests[rid] = req
        pool = self.runner.pool
        cached = [min(pool.cached_prefix(pool.digests(ids, len(ids) - 1)) * pool.block_size, len(ids)) for ids in prompts]
        self.out.send("ACCEPT", rid, {"members": [{"prompt_tokens": len(ids), "cached_tokens": c}
                                                  for ids, c in zip(prompts, cached)]})
        if sampling.echo:
            req.echo_pending = set(range(len(prompts)))
            for seq in req.sequences:
                if seq.choice == 0:
                    self.echo_first(seq)
        for seq in req.sequences:
            self.scheduler.add(seq)

    def cancel(self, rid: int) -> None:
        req = self.requests.pop(rid, None)
        if req is None:
            return  # already answered; the server drops anything late
        req.cancelled = True
        self.scheduler.drop(req)
        self.out.send("ERROR", rid, {"code": "CANCELLED", "message": "cancelled by the server"})

    # ------------------------------------------------------------ stepping
    def step(self) -> None:
        batch = self.scheduler.schedule()
        if not batch:
            return
        self.steps += 1
        self.forward_passes += 1
        t0 = time.monotonic()
        for seq, _ in batch:
            if seq.request.t_first_forward is None:
                seq.request.t_first_forward = t0
        try:
            results = self.runner.step(batch, self.wants_sample)
        except Exception as e:
            log(f"forward failed: {traceback.format_exc()}")
            for req in {id(seq.request): seq.request for seq, _ in batch}.values():
                self.fail(req, e)
            return
        dt = time.monotonic() - t0
        seen: set[int] = set()
        for (seq, n), res in zip(batch, results):
            req = seq.request
            if id(req) not in seen:
                seen.add(id(req))
                if any(s.remaining > 1 for s, _ in batch if s.request is req):
                    req.prefill_s += dt
                else:
                    req.decode_s += dt
            if seq.num_computed < len(seq.prompt):
                self.prompt_tokens_computed += min(n, len(seq.prompt) - seq.num_computed)
            seq.num_computed += n
            self.scheduler.register(seq)
            if res.echo:
                self.send_echo(seq, res.echo)
            if res.logits is None and seq.remaining == 0 and not self.wants_sample(seq):
                self.finish(seq, "length")  # max_tokens 0: the echo was all that was asked
        drawn = [(seq, res) for (seq, _), res in zip(batch, results) if res.logits is not None]
        tokens = sample_many([res.logits for _, res in drawn], [seq for seq, _ in drawn])
        for (seq, res), token in zip(drawn, tokens):
            self.advance(seq, token, res.lp)
        for req in {id(seq.request): seq.request for seq, _ in batch}.values():
            if req.finished and self.requests.get(req.id) is req:
                self.done(req)

    def wants_sample(self, seq: Sequence) -> bool:
        return not seq.done_budget

    def fail(self, req: Request, e: Exception) -> None:
        if self.requests.pop(req.id, None) is None:
            return
        self.scheduler.drop(req)
        self.refuse(req.id, Refusal("INTERNAL", f"{type(e).__name__}: {e}"))

    def send_echo(self, seq: Sequence, entries: list) -> None:
        positions = []
        for p, value, table in entries:
            t = seq.prompt[p]
            pos = {"id": t, "bytes": self.vocab.token_bytes[t].hex(), "logprob": finite_or_none(value)}
            if table is not None:
                pos["top"] = self.table(table)
            positions.append(pos)
        start = entries[0][0]
        seq.echo_next = entries[-1][0] + 1
        for i, chunk in P.entry_chunks("ECHO", positions, P.ECHO_CHUNK):
            self.out.send("ECHO", seq.request.id, {"member": seq.member, "start": start + i, "positions": chunk})
        if seq.echo_next >= len(seq.prompt):
            self.echo_complete(seq)

    def echo_first(self, seq: Sequence) -> None:
        """Position 0 has nothing to condition it: sent as soon as the sequence is accepted."""
        t = seq.prompt[0]
        self.out.send("ECHO", seq.request.id, {"member": seq.member, "start": 0, "positions": [
            {"id": t, "bytes": self.vocab.token_bytes[t].hex(), "logprob": None, "top": None}]})
        seq.echo_next = 1
        if len(seq.prompt) == 1:
            self.echo_complete(seq)

    def echo_complete(self, seq: Sequence) -> None:
        seq.echo_next = 0
        seq.request.echo_pending.discard(seq.member)
        for other in seq.request.sequences:  # tokens that waited for this member's echo
            if other.member == seq.member and other.held:
                held, other.held = other.held, []
                self.emit(other, held)

    def table(self, pairs) -> list:
        return [[i, self.vocab.token_bytes[i].hex(), finite_or_none(v)] for i, v in pairs]

    def advance(self, seq: Sequence, token: int, lp: torch.Tensor) -> None:
        """Report the token sampled from the last position (lp: that row's log-softmax)."""
        s = seq.request.sampling
        seq.out.append(token)
        self.tokens_since_stats += 1
        self.generated_tokens += 1
        if s.presence_penalty or s.frequency_penalty:
            if seq.counts is None:
                seq.counts = torch.zeros(lp.shape[-1])
            seq.counts[token] += 1
        entry = {"id": token, "bytes": self.vocab.token_bytes[token].hex(),
                 "logprob": finite_or_none(lp[token].item())}
        if s.logprobs is not None:
            entry["top"] = self.table(top_tables(lp.unsqueeze(0), [token], s.logprobs)[0])
        if token in self.vocab.eos_ids:
            # reported like every generated token (lm-eval drops the last entry as "the
            # generated one"), flagged so the server keeps it out of the text
            self.emit(seq, seq.stop_text.flush() + [{**entry, "eos": True}])
            self.finish(seq, "stop")
            return
        released, matched = seq.stop_text.push(entry, self.vocab.token_bytes[token])
        if matched is not None:
            self.emit(seq, released)
            seq.stop_matched = matched
            self.finish(seq, "stop")
        elif seq.done_budget:
            self.emit(seq, released + seq.stop_text.flush())
            self.finish(seq, "length")
        else:
            self.emit(seq, released)

    def emit(self, seq: Sequence, entries: list[dict]) -> None:
        if seq.member in seq.request.echo_pending:
            seq.held += entries  # a member's echo goes out before any of its tokens
            return
        for _, chunk in P.entry_chunks("TOKEN", entries, P.MAX_TOKEN_ENTRIES):
            self.out.send("TOKEN", seq.request.id, {"member": seq.member, "choice": seq.choice, "tokens": chunk})

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.finish_reason = reason
        self.scheduler.finish(seq)

    def done(self, req: Request) -> None:
        del self.requests[req.id]
        choices = [{"member": q.member, "choice": q.choice, "finish_reason": q.finish_reason,
                    "stop": q.stop_matched, "completion_tokens": len(q.out)} for q in req.sequences]
        now = time.monotonic()
        self.out.send("DONE", req.id, {
            "choices": choices,
            "usage": {"prompt_tokens": sum(len(p) for p in req.prompts),
                      "completion_tokens": sum(len(q.out) for q in req.sequences),
                      "cached_tokens": sum(q.cached_tokens or 0 for q in req.sequences if q.choice == 0)},
            "timings": {"queue_s": (req.t_first_forward or now) - req.t_submit,
                        "prefill_s": req.prefill_s, "decode_s": req.decode_s},
        })


def keep_freed_memory(keep_bytes: int = 1 << 30) -> None:
    """glibc hands large freed blocks back to the kernel (munmap, heap trimming) and maps them
    anew for the next allocation, so a step's temporaries (MBs each) fault their pages in again
    every step, and how often depends on the allocation history: the same workload ran 8%
    slower in one engine than in another. Allocations below 32 MiB come from the heap, and
    the heap is not trimmed below `keep_bytes` of free space (--heap-keep-gib). Glibc only;
    elsewhere nothing changes."""
    import ctypes
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
    libc.mallopt(M_MMAP_THRESHOLD, 32 << 20)
    libc.mallopt(M_TRIM_THRESHOLD, min(keep_bytes, 2**31 - 1))


def main(argv: list[str] | None = None) -> None:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m probity.engine", description="probity engine child (speaks the pipe on stdin/stdout)")
    ap.add_argument("--model", default="default")
    ap.add_argument("--max-running", type=int, default=64)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--step-tokens", type=int, default=512)
    ap.add_argument("--kv-cache-gib", type=float, default=2.0)
    ap.add_argument("--no-prefix-cache", action="store_true")
    ap.add_argument("--kept-keys-gib", type=float, default=1.0)
    ap.add_argument("--heap-keep-gib", type=float, default=1.0)
    args = ap.parse_args(argv)

    keep_freed_memory(int(max(args.heap_keep_gib, 0) * (1 << 30)))
    out, inbox = open_pipe()

    from .loader import ModelNotFound, load
    try:
        loaded = load(args.model)
    except ModelNotFound as e:
        log(f"error: {e}")
        os._exit(3)
    except Exception as e:  # a file transformers cannot read: say so plainly
        log(f"error: cannot load model {args.model!r}: {type(e).__name__}: {e}")
        os._exit(3)
    if (args.step_tokens < 1 or args.max_running < 1 or not args.kv_cache_gib > 0 or args.kept_keys_gib < 0
            or args.heap_keep_gib < 0):
        log("error: --step-tokens and --max-running must be positive, --kv-cache-gib above 0, "
            "--kept-keys-gib and --heap-keep-gib at least 0")
        os._exit(3)
    try:
        engine = Engine(loaded, out, inbox, max_running=args.max_running, threads=args.threads or os.cpu_count(),
                        step_tokens=args.step_tokens, kv_cache_gib=args.kv_cache_gib,
                        prefix_cache=not args.no_prefix_cache, kept_keys_gib=args.kept_keys_gib)
    except UnsupportedModel as e:
        log(f"error: {e}")
        os._exit(3)
    engine.run()
