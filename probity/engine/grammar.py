"""Constrained decoding: a request's grammar (llguidance's grammar text, built by the server
from a JSON schema, a regex, a choice list, a Lark grammar or the tools it was given) turned
into one matcher per choice, and each step's token masks.

The mask only decides what can be drawn. The values reported for a token (tables.py) are the
model's raw distribution, computed before any mask, so a constrained token's logprob is the
same float the unconstrained model gives it (docs/api.md, Structured outputs).

A grammar is compiled in a thread of its own, beside the step (llguidance drops the GIL): its
request waits, the others keep stepping, and it joins the batch when its grammar is ready.
Compiled grammars are cached by their text (a fresh matcher is a deep copy of the cached one,
microseconds), the cache bounded by the memory each took to compile, as measured then (glibc's
bytes in use before and after). The masks of a step are computed by llguidance's own thread pool
while the forward runs: the matchers' states are known before it starts."""
from __future__ import annotations

import collections
import concurrent.futures
import os
import threading

import llguidance
import llguidance.hf
import torch

from ..protocol import grammar_limits, grammar_reason
from . import kernels
from .heap import heap_in_use, release_freed_memory
from .work import Refusal

DEAD_END = "grammar_dead_end"  # the finish of a choice whose grammar allows no token at all


class Grammars:
    def __init__(self, tokenizer, vocab_size: int, eos_ids: list[int], cache_bytes: int = 256 << 20):
        self.vocab_size = vocab_size
        self._tokenizer = tokenizer
        self._eos = eos_ids
        self._error: Exception | None = None
        self._lltok: llguidance.LLTokenizer | None = None
        # llguidance's view of the vocabulary takes ~0.3 s per 50k tokens: built beside the
        # engine's startup, so the first constrained request does not stall every other one
        self._building = threading.Thread(target=self._build, name="probity-lltokenizer", daemon=True)
        self._building.start()
        # grammar -> (its compiled matcher, the bytes compiling it took)
        self._cache: collections.OrderedDict[str, tuple[llguidance.LLMatcher, int]] = collections.OrderedDict()
        self.cache_bytes = cache_bytes
        self.cached_bytes = 0
        self._freed = 0   # bytes dropped from the cache since the heap was last trimmed
        # at a low priority: a compile takes what the step leaves of the cores, not the reverse
        self._compiler = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="probity-grammar",
                                                               initializer=_lower_priority)
        self._executor: llguidance.LLExecutor | None = None
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="probity-masks")
        self.words = (vocab_size + 31) // 32

    def _build(self) -> None:
        try:
            self._lltok = llguidance.hf.from_tokenizer(self._tokenizer, n_vocab=self.vocab_size,
                                                       eos_token=self._eos or None)
        except Exception as e:  # noqa: BLE001 -- said when a grammar needs it
            self._error = e

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        """llguidance's view of the vocabulary (waits for its build if a request needs it first)."""
        self._building.join()
        if self._lltok is None:
            raise Refusal("INTERNAL", f"llguidance cannot read this tokenizer: {self._error}", "grammar")
        return self._lltok

    @property
    def cached_entries(self) -> int:
        return len(self._cache)

    def cached(self, grammar: str) -> llguidance.LLMatcher | None:
        """A fresh matcher for `grammar` if it is compiled already (the cache's order refreshed)."""
        hit = self._cache.get(grammar)
        if hit is None:
            return None
        self._cache.move_to_end(grammar)
        return hit[0].deep_copy()

    def compile(self, grammar: str) -> concurrent.futures.Future:
        """Compile `grammar` beside the step; `.result()` is (matcher, bytes) or raises Refusal
        BAD_REQUEST naming `grammar` (the library's reason on one line, as the server says it).
        Pass the result to `keep` on the engine's own thread."""
        return self._compiler.submit(self._compile, grammar)

    def _compile(self, grammar: str) -> tuple[llguidance.LLMatcher, int]:
        before = heap_in_use()
        try:
            m = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0, limits=grammar_limits())
        except BaseException as e:  # a Rust panic arrives as a BaseException
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
            raise Refusal("BAD_REQUEST", f"the grammar does not compile: {grammar_reason(str(e))}", "grammar") from None
        if m.is_error():
            raise Refusal("BAD_REQUEST", f"the grammar does not compile: {grammar_reason(m.get_error())}", "grammar")
        self.check_start(m)
        return m, max(heap_in_use() - before, len(grammar))

    def keep(self, grammar: str, m: llguidance.LLMatcher, cost: int) -> llguidance.LLMatcher:
        """Cache a compiled grammar (least recently used dropped past the bound); a fresh matcher."""
        if grammar not in self._cache and cost <= self.cache_bytes:
            self._cache[grammar] = (m, cost)
            self.cached_bytes += cost
            while self.cached_bytes > self.cache_bytes:
                _, (_, old) = self._cache.popitem(last=False)
                self.cached_bytes -= old
                self._freed += old
            if self._freed >= 16 << 20:   # hand what the dropped grammars held back to the kernel
                self._freed = 0
                self._compiler.submit(release_freed_memory)
        return m.deep_copy()

    def check_start(self, m: llguidance.LLMatcher) -> None:
        """Refusal BAD_REQUEST naming `grammar` if the grammar cannot even begin: its first mask
        allows nothing, or computing it runs past the parser's limits (a schema that only
        refers to itself does) -- so such a request is refused before ACCEPT, not ended later.
        (Computing a mask moves no matcher forward; a matcher it puts in error is refused.)"""
        if not any(m.compute_bitmask()) or m.is_error():
            why = grammar_reason(m.get_error() or "no token can begin it")
            raise Refusal("BAD_REQUEST", f"the grammar admits no output: {why}", "grammar")

    # ------------------------------------------------------------ masks
    def start_masks(self, matchers: list[llguidance.LLMatcher]) -> concurrent.futures.Future | None:
        """Begin computing the masks of these matchers (one int32 bit-row each) in the
        background; `.result()` is the [len, words] tensor."""
        if not matchers:
            return None
        if self._executor is None:
            self._executor = llguidance.LLExecutor(num_threads=1)
        out = torch.empty((len(matchers), self.words), dtype=torch.int32)

        def fill():
            self._executor.unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(matchers)],
                                                   out.data_ptr(), self.words * 4, len(matchers))
            return out
        return self._pool.submit(fill)


_BITS = torch.arange(32, dtype=torch.int32)


def allowed(words: torch.Tensor, vocab: int) -> torch.Tensor:
    """One row of mask words -> a bool row over the vocabulary (bit i of word w: token 32w + i)."""
    return ((words.unsqueeze(-1) >> _BITS) & 1).reshape(-1)[:vocab].bool()


def renormalised(lp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """A row's log-softmax restricted to the tokens its grammar allows and renormalised over
    them (the opt-in `constrained_logprobs`): the others -inf, the allowed keep their
    differences, and their probabilities sum to 1. One row at a time, so batch-invariant."""
    return kernels.log_softmax(lp.masked_fill(~mask, -torch.inf))


COMPILE_NICE = 10


def _lower_priority() -> None:
    """This thread alone at nice COMPILE_NICE (on Linux a thread's priority is its own)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), COMPILE_NICE)
    except (OSError, AttributeError):
        pass
