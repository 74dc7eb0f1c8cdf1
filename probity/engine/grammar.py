"""Constrained decoding: a request's grammar (llguidance's grammar text, built by the server
from a JSON schema, a regex, a choice list, a Lark grammar or the tools it was given) turned
into one matcher per choice, and each step's token masks.

The mask only decides what can be drawn. The values reported for a token (tables.py) are the
model's raw distribution, computed before any mask, so a constrained token's logprob is the
same float the unconstrained model gives it (docs/api.md, Structured outputs).

Compiled grammars are cached by their text (a fresh matcher is a deep copy of the cached one,
microseconds). The masks of a step are computed by llguidance's own thread pool while the
forward runs: the matchers' states are known before it starts, and llguidance drops the GIL."""
from __future__ import annotations

import collections
import concurrent.futures
import threading

import llguidance
import llguidance.hf
import torch

from ..protocol import grammar_limits
from .work import Refusal

CACHE_GRAMMARS = 64           # compiled grammars kept (least recently used dropped first)
DEAD_END = "grammar_dead_end"  # the finish of a choice whose grammar allows no token at all


class Grammars:
    def __init__(self, tokenizer, vocab_size: int, eos_ids: list[int]):
        self.vocab_size = vocab_size
        self._tokenizer = tokenizer
        self._eos = eos_ids
        self._error: Exception | None = None
        self._lltok: llguidance.LLTokenizer | None = None
        # llguidance's view of the vocabulary takes ~0.3 s per 50k tokens: built beside the
        # engine's startup, so the first constrained request does not stall every other one
        self._building = threading.Thread(target=self._build, name="probity-lltokenizer", daemon=True)
        self._building.start()
        self._cache: collections.OrderedDict[str, llguidance.LLMatcher] = collections.OrderedDict()
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

    def matcher(self, grammar: str) -> llguidance.LLMatcher:
        """A fresh matcher for `grammar`, or Refusal BAD_REQUEST naming `grammar`."""
        m = self._cache.get(grammar)
        if m is None:
            m = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0, limits=grammar_limits())
            if m.is_error():
                raise Refusal("BAD_REQUEST", f"the grammar does not compile: {m.get_error()}", "grammar")
            self._cache[grammar] = m
            while len(self._cache) > CACHE_GRAMMARS:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(grammar)
        return m.deep_copy()

    def check_start(self, m: llguidance.LLMatcher) -> None:
        """Refusal BAD_REQUEST naming `grammar` if the grammar cannot even begin: its first mask
        allows nothing, or computing it runs past the parser's limits (a schema that only
        refers to itself does) -- so such a request is refused before ACCEPT, not ended later.
        (Computing a mask moves no matcher forward; a matcher it puts in error is refused.)"""
        if not any(m.compute_bitmask()) or m.is_error():
            why = m.get_error() or "no token can begin it"
            raise Refusal("BAD_REQUEST", f"the grammar admits no output: {why}"[:2000], "grammar")

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
    m = lp.masked_fill(~mask, -torch.inf)
    return m - torch.logsumexp(m, -1)
