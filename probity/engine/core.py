"""The engine core both backends share: read frames, turn a SUBMIT into a request of member ×
choice outputs, and answer in frames — ACCEPT, the members' ECHO, each choice's TOKENs, and
one terminal DONE or ERROR. Everything between a sampled token and the frame that reports it
lives here once: a member's tokens held until its echo is out, the EOS → stop string → length
order of endings, cutting frames to their bounds, usage, cancellation, and STATS.

A backend (probity's own engine, engine/engine.py; vLLM, vllm_engine/engine.py) supplies only
what runs the model: `admit` (take a request's choices), `step` (run once, then report through
`send_echo`, `accept_token` and `finish`), `on_finish` and `release` (let go of a choice or a
request), and its figures (`stats`, `timings`, READY's model facts)."""
from __future__ import annotations

import concurrent.futures
import os
import queue
import time
import traceback
from dataclasses import dataclass, replace

from .. import protocol as P
from ..protocol import finite_or_none
from .log import log
from .pipe import Refused, Writer
from .grammar import DEAD_END
from .request import Choice, Request
from .stop_text import StopText
from .vocab import Vocab
from .work import Refusal, parse_generate, run_op

STATS_EVERY = 1.0  # seconds between STATS frames while there is work


@dataclass
class Compiled:
    """In the inbox: request `id`'s grammar has compiled (or failed to): `future.result()`."""
    id: int
    future: concurrent.futures.Future


class EngineCore:
    """Set by the backend before `run`: vocab, context_length, model_id, source, dtype,
    fingerprint, concurrency, batch_invariant, prefix_cache."""

    def __init__(self, out: Writer, inbox: queue.Queue):
        self.out = out
        self.inbox = inbox
        self.requests: dict[int, Request] = {}
        self.shutting_down = False
        self.steps = 0
        self.generated_tokens = 0
        self.prompt_tokens_computed = 0
        self.tokens_since_stats = 0
        self.last_stats = time.monotonic()
        self.vocab: Vocab
        self.context_length: int
        self.model_id = self.source = self.dtype = self.fingerprint = ""
        self.concurrency = 1
        self.batch_invariant = self.prefix_cache = False
        self.grammars = None  # engine/grammar.py Grammars where the backend applies grammars
        # whole log-softmax rows: whether the backend has them (SUBMIT's distribution and
        # score_tokens), and the most distribution floats (rows x vocabulary) one request may ask for
        self.row_reports = False
        self.max_distribution_floats = 0
        self._ids_of_bytes: dict[bytes, list[int]] | None = None
        self.compiling: dict[int, Request] = {}  # requests whose grammar is being compiled

    # ------------------------------------------------------------ what a backend provides
    def new_choice(self, req: Request, member: int, choice: int) -> Choice:
        return Choice(request=req, member=member, choice=choice, prompt=req.prompts[member],
                      stop_text=StopText(list(req.sampling.stop)))

    def admit(self, req: Request) -> None:
        """Take the request's unfinished choices (raise Refusal to refuse it: nothing was sent)."""
        raise NotImplementedError

    def cached_at_accept(self, req: Request) -> list[int]:
        """Per member, the prompt tokens the prefix cache holds now (ACCEPT's cached_tokens)."""
        return [0] * len(req.prompts)

    def step(self) -> None:
        raise NotImplementedError

    def on_finish(self, q: Choice) -> None:
        """A choice has ended (its last frame may still be on its way): stop running it."""

    def release(self, req: Request) -> None:
        """The request is answered, cancelled or failed: let go of whatever still runs for it."""

    def stats(self) -> dict:
        return {}

    def timings(self, req: Request) -> dict:
        return {}

    def memory(self) -> dict | None:
        return None

    # ------------------------------------------------------------ the loop
    def ready(self) -> dict:
        tok = self.vocab.tok

        def text(v):
            return v if isinstance(v, str) else None

        out = {
            "protocol": P.PROTOCOL_VERSION,
            "model": {
                "id": self.model_id, "context_length": self.context_length, "vocab_size": self.vocab.size,
                "eos_token_ids": self.vocab.eos_ids, "bos_token": text(tok.bos_token),
                "eos_token": text(tok.eos_token), "pad_token": text(tok.pad_token), "dtype": self.dtype,
                "fingerprint": self.fingerprint, "chat_template": text(tok.chat_template), "source": self.source,
            },
            "capabilities": {
                "logprobs": True, "max_logprobs": P.MAX_LOGPROBS, "echo": True, "token_ids": True,
                "seed": True, "chat_template": self.vocab.has_chat_template,
                "max_members": P.MAX_MEMBERS, "max_choices": P.MAX_CHOICES,
                "batch_invariant": self.batch_invariant, "prefix_cache": self.prefix_cache,
                "grammar": self.grammars is not None, "tool_format": self.vocab.tool_format,
                "tools_in_template": self.vocab.tools_in_template,
                "distribution": self.offers_distribution, "score_tokens": self.row_reports,
                "max_distribution_floats": self.max_distribution_floats if self.offers_distribution else 0,
            },
            "concurrency": self.concurrency,
        }
        memory = self.memory()
        if memory is not None:
            out["memory"] = memory
        return out

    @property
    def offers_distribution(self) -> bool:
        return self.row_reports and self.max_distribution_floats > 0 and self.vocab.size <= P.MAX_DIST_VOCAB

    def run(self) -> None:
        self.out.send("READY", 0, self.ready())
        busy = False
        while True:
            if not self.requests:
                busy = False
                if self.shutting_down and not self.compiling:
                    os._exit(0)
                self.handle(self.inbox.get())
            self.poll()  # a CANCEL takes effect before the next step
            if self.requests:
                with self.out.held():   # the step's frames in one write
                    self.step()
                self.maybe_stats(changed=not busy)  # busy now: say so at once, then once a second
                busy = True

    def poll(self) -> None:
        while True:
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                return
            self.handle(item)

    def handle(self, item: P.Frame | Refused) -> None:
        if isinstance(item, Refused):
            self.refuse(item.id, item.refusal)
        elif isinstance(item, Compiled):
            self.compiled(item)
        elif item.kind == "SUBMIT":
            self.submit(item.id, item.payload)
        elif item.kind == "CANCEL":
            self.cancel(item.id)
        elif item.kind == "SHUTDOWN":
            self.shutting_down = True

    def maybe_stats(self, changed: bool) -> None:
        now = time.monotonic()
        if now - self.last_stats < STATS_EVERY and not changed:
            return
        self.out.send("STATS", 0, {
            "tokens_per_s": self.tokens_since_stats / max(now - self.last_stats, 1e-6), "steps": self.steps,
            "generated_tokens": self.generated_tokens, "prompt_tokens_computed": self.prompt_tokens_computed,
            **self.stats()})
        self.tokens_since_stats = 0
        self.last_stats = now

    def answer(self, rid: int, kind: str, payload: dict) -> None:
        """A request's terminal frame. When it leaves the engine idle the idle STATS goes
        first, so a server that has seen the answer has seen the figures it left behind."""
        if not self.requests:
            self.maybe_stats(changed=True)
        self.out.send(kind, rid, payload)

    # ------------------------------------------------------------ requests
    def refuse(self, rid: int, r: Refusal) -> None:
        self.out.send("ERROR", rid, r.payload())

    def submit(self, rid: int, p: dict) -> None:
        if rid == 0 or rid in self.requests or rid in self.compiling:
            self.refuse(rid, Refusal("BAD_REQUEST", "request id 0 or already in use", "id"))
            return
        if self.shutting_down:
            self.refuse(rid, Refusal("OVERLOADED", "engine is shutting down"))
            return
        try:
            if p["op"] == "generate":
                self.start_generate(rid, p)
            else:
                self.answer_op(rid, p)
        except Refusal as r:
            self.refuse(rid, r)
        except Exception as e:
            log(f"request {rid} failed before acceptance: {traceback.format_exc()}")
            self.refuse(rid, Refusal("INTERNAL", f"{type(e).__name__}: {e}"))

    def answer_op(self, rid: int, p: dict) -> None:
        result = run_op(p["op"], p, self.vocab)
        try:  # encoded before anything is sent: an answer too big for DONE is refused by name
            done = P.encode("DONE", rid, {"result": result})
        except P.FrameTooLarge:
            raise Refusal("TOO_LARGE", "the answer would exceed the pipe's 16 MiB bound for one result",
                          "ids" if p["op"] == "detokenize" else "members[0]",
                          None if p["op"] == "detokenize" else 0) from None
        self.out.send("ACCEPT", rid, {"members": [{"prompt_tokens": result.get("count", 0), "cached_tokens": 0}]})
        self.out.send_encoded(done)

    def start_generate(self, rid: int, p: dict) -> None:
        sampling, prompts, template = parse_generate(p, self.vocab, self.context_length)
        if sampling.reports_rows:
            sampling = self.rows_asked(sampling, prompts)
        req = Request(rid, sampling, prompts, template=template)
        for m in range(len(prompts)):
            for c in range(sampling.n):
                q = self.new_choice(req, m, c)
                if sampling.max_tokens == 0 and c > 0:
                    q.finish_reason = "length"  # echo only: choice 0 scores the prompt, the others have nothing to do
                req.choices.append(q)
        matcher = None
        if sampling.grammar is not None:
            if self.grammars is None:
                raise Refusal("BAD_REQUEST", "this engine does not apply grammars", "grammar")
            matcher = self.grammars.cached(sampling.grammar)
            if matcher is None:  # compiled beside the step; the request starts when it is ready
                self.compiling[rid] = req
                self.grammars.compile(sampling.grammar).add_done_callback(
                    lambda f: self.inbox.put(Compiled(rid, f)))
                return
        self.start_request(req, matcher)

    def rows_asked(self, s: P.Sampling, prompts: list[list[int]]) -> P.Sampling:
        """A request's distribution and score_tokens, checked (the vocabulary, the backend, the
        distribution bound); its score_tokens as ids."""
        if not self.row_reports:
            raise Refusal("BAD_REQUEST", "this engine does not report whole rows",
                          "distribution" if s.distribution else "score_tokens")
        if s.distribution:
            if not self.offers_distribution:
                raise Refusal("BAD_REQUEST", f"this engine does not report distributions (a vocabulary of "
                              f"{self.vocab.size}, a bound of {self.max_distribution_floats} floats)", "distribution")
            rows = sum((len(ids) - 1 if s.echo else 0) + s.n * s.max_tokens for ids in prompts)
            floats = rows * self.vocab.size
            if floats > self.max_distribution_floats:
                raise Refusal("BAD_REQUEST", f"{rows} positions x {self.vocab.size} tokens = {floats} distribution "
                              f"floats exceeds the engine's bound of {self.max_distribution_floats} "
                              "(--max-distribution-floats): ask for fewer positions", "distribution")
        ids = tuple(self.score_id(t, j) for j, t in enumerate(s.score_tokens))
        return replace(s, score_tokens=ids)

    def score_id(self, t: int | str, j: int) -> int:
        """A score_tokens entry as a token id: an id below the vocabulary size, or the text of
        exactly one token (its UTF-8 bytes are that token's bytes)."""
        where = f"score_tokens[{j}]"
        if type(t) is int:
            if t >= self.vocab.size:
                raise Refusal("BAD_REQUEST", f"token ids must be below the vocabulary size {self.vocab.size}", where)
            return t
        if self._ids_of_bytes is None:
            self._ids_of_bytes = {}
            for i, b in enumerate(self.vocab.token_bytes):
                self._ids_of_bytes.setdefault(b, []).append(i)
        ids = self._ids_of_bytes.get(t.encode("utf-8"), [])
        if not ids:
            raise Refusal("BAD_REQUEST", f"{t!r} is not the text of one token of this vocabulary: name a token by "
                          "its id, or use the tokenize route to see how the text splits", where)
        if len(ids) > 1:
            raise Refusal("BAD_REQUEST", f"{t!r} is the text of several tokens (ids {ids[:8]}): name one by its id",
                          where)
        return ids[0]

    def compiled(self, item: Compiled) -> None:
        req = self.compiling.pop(item.id, None)
        if req is None:
            return  # cancelled while it compiled
        try:
            m, cost = item.future.result()
            self.start_request(req, self.grammars.keep(req.sampling.grammar, m, cost))
        except Refusal as r:
            self.refuse(item.id, r)
        except Exception as e:
            log(f"request {item.id} failed before acceptance: {traceback.format_exc()}")
            self.refuse(item.id, Refusal("INTERNAL", f"{type(e).__name__}: {e}"))

    def start_request(self, req: Request, matcher) -> None:
        """Admit a request (its choices' matchers `matcher`, a compiled grammar's fresh
        matcher, and copies of it) and ACCEPT it."""
        rid, sampling, prompts = req.id, req.sampling, req.prompts
        if matcher is not None:
            for q in req.choices:
                q.matcher = matcher if q is req.choices[0] else matcher.deep_copy()
        self.admit(req)
        self.requests[rid] = req
        accept: dict = {"members": [{"prompt_tokens": len(ids), "cached_tokens": c}
                                    for ids, c in zip(prompts, self.cached_at_accept(req))]}
        if sampling.score_tokens:
            accept["score_ids"] = list(sampling.score_tokens)
        self.out.send("ACCEPT", rid, accept)
        if sampling.echo:
            for m in range(len(prompts)):
                req.echo_next[m] = 0
                self.send_echo(req, m, [(0, None, None)])  # nothing conditions position 0: sent at once
        if req.finished:
            self.done(req)

    def cancel(self, rid: int) -> None:
        if self.compiling.pop(rid, None) is not None:
            self.answer(rid, "ERROR", {"code": "CANCELLED", "message": "cancelled by the server"})
            return
        req = self.requests.pop(rid, None)
        if req is None:
            return  # already answered; the server drops anything late
        self.release(req)
        self.answer(rid, "ERROR", {"code": "CANCELLED", "message": "cancelled by the server"})

    def fail(self, req: Request, e: Exception) -> None:
        """The backend could not run this request: an ERROR INTERNAL for it alone."""
        if self.requests.pop(req.id, None) is None:
            return
        self.release(req)
        self.answer(req.id, "ERROR", Refusal("INTERNAL", f"{type(e).__name__}: {e}").payload())

    def done(self, req: Request) -> None:
        del self.requests[req.id]
        self.release(req)
        self.answer(req.id, "DONE", {
            "choices": [{"member": q.member, "choice": q.choice, "finish_reason": q.finish_reason,
                         "stop": q.stop_matched, "completion_tokens": len(q.out)} for q in req.choices],
            "usage": {"prompt_tokens": sum(len(p) for p in req.prompts),
                      "completion_tokens": sum(len(q.out) for q in req.choices),
                      "cached_tokens": sum(q.cached_tokens or 0 for q in req.choices if q.choice == 0)},
            "timings": self.timings(req),
        })

    # ------------------------------------------------------------ reporting
    def entry(self, token: int, value: float | None, table: list[tuple[int, float]] | None,
              row: dict | None = None) -> dict:
        """A position's pipe entry: the token, its bytes, its value and, when asked for, its
        table (the chosen token's value there is the same float) and its row reports
        (tables.row_reports: the whole distribution, score_tokens' values)."""
        tb = self.vocab.token_bytes
        e = {"id": token, "bytes": tb[token].hex(), "logprob": None if value is None else finite_or_none(value)}
        if table is not None:
            e["top"] = [[i, tb[i].hex(), finite_or_none(v)] for i, v in table]
        if row:
            e.update(row)
        return e

    def send_echo(self, req: Request, member: int, positions: list[tuple]) -> None:
        """The member's next prompt positions, (position, value, table[, row reports]) in order
        from where its echo stands; its held tokens follow once the last position is out."""
        if not positions:
            return
        start = req.echo_next[member]
        assert positions[0][0] == start, "echo positions out of order"
        prompt = req.prompts[member]
        entries = []
        for p, value, table, *row in positions:
            e = self.entry(prompt[p], value, table, row[0] if row else None)
            if p == 0:
                e["top"] = None
            if member in req.template:
                e["template"] = req.template[member][p]
            entries.append(e)
        for i, chunk in P.entry_chunks("ECHO", entries, P.ECHO_CHUNK):
            self.out.send("ECHO", req.id, {"member": member, "start": start + i, "positions": chunk})
        req.echo_next[member] = start + len(entries)
        if req.echo_next[member] >= len(prompt):
            self.echo_complete(req, member)

    def echo_complete(self, req: Request, member: int) -> None:
        del req.echo_next[member]
        for q in req.choices:
            if q.member != member:
                continue
            if q.held:  # tokens that waited for this member's echo
                held, q.held = q.held, []
                self.emit(q, held)
            if req.sampling.max_tokens == 0 and not q.finished:
                self.finish(q, "length")  # the echo was all that was asked

    def accept_token(self, q: Choice, token: int, value: float | None, table: list | None,
                     row: dict | None = None) -> None:
        """Report a generated token and decide how the choice goes on: an EOS ends it (reported
        like every token, flagged so the server keeps it out of the text), then a stop string,
        then the token budget."""
        q.out.append(token)
        self.generated_tokens += 1
        self.tokens_since_stats += 1
        entry = self.entry(token, value, table, row)
        if token in self.vocab.eos_ids:
            self.emit(q, q.stop_text.flush() + [{**entry, "eos": True}])
            self.finish(q, "stop")
            return
        refused = q.matcher is not None and not q.matcher.consume_token(token)
        released, matched = q.stop_text.push(entry, self.vocab.token_bytes[token])
        if matched is not None:
            self.emit(q, released)
            q.stop_matched = matched
            self.finish(q, "stop")
        elif refused:  # a backend that drew outside the mask: the grammar cannot go on
            self.emit(q, released + q.stop_text.flush())
            self.finish(q, DEAD_END)
        elif q.matcher is not None and q.matcher.is_stopped():  # the grammar is complete: nothing may follow
            self.emit(q, released + q.stop_text.flush())
            self.finish(q, "stop")
        elif q.done_budget:
            self.emit(q, released + q.stop_text.flush())
            self.finish(q, "length")
        else:
            self.emit(q, released)

    def dead_end(self, q: Choice) -> None:
        """The choice's grammar allows no token at all (not even EOS): it ends by name."""
        self.emit(q, q.stop_text.flush())
        self.finish(q, DEAD_END)

    def finish(self, q: Choice, reason: str) -> None:
        q.finish_reason = reason
        self.on_finish(q)

    def emit(self, q: Choice, entries: list[dict]) -> None:
        if not entries:
            return
        if q.member in q.request.echo_next:
            q.held += entries  # a member's echo goes out before any of its tokens
            return
        for _, chunk in P.entry_chunks("TOKEN", entries, P.MAX_TOKEN_ENTRIES):
            self.out.send("TOKEN", q.request.id, {"member": q.member, "choice": q.choice, "tokens": chunk})
