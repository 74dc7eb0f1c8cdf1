"""The SUBMIT contract: every field the server may send the engine, its bounds, and the one
`Sampling` type both sides hold.

The server validates a request against the API's own rules (its field names, types and
messages) and builds a `Sampling` with these bounds; `generate_payload` turns it into
SUBMIT's fields. The engine's reader checks the frame against `SUBMIT_SCHEMA` (a field it
refuses is an ERROR BAD_REQUEST naming it, `param_of`), then `Sampling.from_wire` rebuilds
the same object. What only the engine can check (token ids against the vocabulary, the
context window, the chat template) the engine checks (engine/work.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .schema import Bool, Enum, IdMap, Int, IntOrStr, List, MiB, Num, Obj, OneKey, SchemaError, Str

MAX_LOGPROBS = 32         # alternatives in one top table (the chosen token may add one)
MAX_MEMBERS = 128         # prompts in one request
MAX_CHOICES = 16          # n
MAX_STOPS = 32            # stop strings in one request
MAX_STOP_CHARS = 4096     # characters in one stop string (DONE names the matched one)
MAX_TOKENS = 1 << 24      # max_tokens
MAX_LOGIT_BIAS = 1024     # logit_bias entries
MAX_SCORE_TOKENS = 256    # score_tokens: tokens whose values every position reports
MAX_SCORE_TEXT = 256      # characters in one score_tokens string (it must be one token's text)
MAX_CACHE_SALT = 1024     # characters in one cache_salt
TEMPERATURE = (0.0, 2.0)
TOP_P = (0.0, 1.0)        # open at 0
PENALTY = (-2.0, 2.0)     # presence_penalty, frequency_penalty
LOGIT_BIAS = (-100.0, 100.0)
SEED = (-(2**63), 2**63 - 1)
TOKEN_ID = Int(0, 2**31 - 1)
ROLES = ("system", "developer", "user", "assistant")
MAX_TOOL_CALLS = 128      # calls in one assistant message
MAX_GRAMMAR = 4 * MiB     # llguidance grammar text (a compiled JSON schema, tools, a regex, ...)
MAX_TEXT = 16 * MiB       # SUBMIT's own bound: no member can be longer
MAX_IDS = 8 * MiB


@dataclass(frozen=True)
class Sampling:
    """How one request's choices are drawn, what is reported about them, and which cached
    prompts it may share (`cache_salt`: only those sent with the same salt)."""
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                 # 0: no top-k truncation
    seed: int | None = None        # int64; None: fresh entropy
    n: int = 1
    stop: tuple[str, ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    logprobs: int | None = None    # k alternatives in each table (plus the chosen token); None: no tables
    echo: bool = False             # report the prompt's positions too
    grammar: str | None = None     # llguidance grammar text every choice's tokens must follow
    constrained_logprobs: bool = False  # report the grammar's renormalised distribution, not the raw one
    distribution: bool = False     # report each position's whole log-softmax row (float32)
    score_tokens: tuple[int | str, ...] = ()  # tokens (ids, or one token's text) whose values each position reports
    cache_salt: str | None = None  # the prefix cache shares blocks only among requests with this salt

    def wire(self) -> dict[str, Any]:
        """SUBMIT's sampling fields. Defaults are omitted, so a request that spells out a
        default produces the same bytes as one that leaves it out."""
        out: dict[str, Any] = {"max_tokens": self.max_tokens}
        for k in ("temperature", "top_p", "top_k", "n", "presence_penalty", "frequency_penalty"):
            v = getattr(self, k)
            if v != _DEFAULTS[k]:
                out[k] = v
        if self.stop:
            out["stop"] = list(self.stop)
        if self.logit_bias:
            out["logit_bias"] = {str(k): v for k, v in self.logit_bias.items()}
        if self.seed is not None:
            out["seed"] = self.seed
        if self.logprobs is not None:
            out["logprobs"] = self.logprobs
        if self.echo:
            out["echo"] = True
        if self.grammar is not None:
            out["grammar"] = self.grammar
        if self.constrained_logprobs:
            out["constrained_logprobs"] = True
        if self.distribution:
            out["distribution"] = True
        if self.score_tokens:
            out["score_tokens"] = list(self.score_tokens)
        if self.cache_salt is not None:
            out["cache_salt"] = self.cache_salt
        return out

    @property
    def reports_rows(self) -> bool:
        """Whether each reported position carries more than its token's value and table."""
        return self.distribution or bool(self.score_tokens)

    @classmethod
    def from_wire(cls, p: dict) -> "Sampling":
        """The Sampling of a SUBMIT that passed SUBMIT_SCHEMA. Raises SchemaError for what
        spans fields."""
        s = cls(max_tokens=p.get("max_tokens", 16), temperature=float(p.get("temperature", 1.0)),
                top_p=float(p.get("top_p", 1.0)), top_k=p.get("top_k", 0), seed=p.get("seed"), n=p.get("n", 1),
                stop=tuple(p.get("stop", ())), presence_penalty=float(p.get("presence_penalty", 0.0)),
                frequency_penalty=float(p.get("frequency_penalty", 0.0)),
                logit_bias={int(k): float(v) for k, v in p.get("logit_bias", {}).items()},
                logprobs=p.get("logprobs"), echo=p.get("echo", False), grammar=p.get("grammar"),
                constrained_logprobs=p.get("constrained_logprobs", False),
                distribution=p.get("distribution", False), score_tokens=tuple(p.get("score_tokens", ())),
                cache_salt=p.get("cache_salt"))
        if s.max_tokens == 0 and not s.echo:
            raise SchemaError("SUBMIT.max_tokens", "0 is only meaningful with echo")
        if s.constrained_logprobs and s.grammar is None:
            raise SchemaError("SUBMIT.constrained_logprobs", "needs a grammar")
        return s


_DEFAULTS = {k: f.default for k, f in Sampling.__dataclass_fields__.items()}


def grammar_limits():
    """llguidance's parser bounds for one request's grammar, the same on both sides: the server
    refuses by name a grammar that needs more (before any engine work), so what it lets through
    compiles in the engine; a step that needs more ends its choice. (llguidance is imported
    here only: the contract itself stays free of it.)"""
    import llguidance
    return llguidance.LLParserLimits(max_grammar_size=200_000, max_lexer_states=100_000,
                                     step_max_items=50_000, verbose_errors=False)


def grammar_reason(message: str) -> str:
    """The library's reason for refusing a grammar, on one line: a Rust panic's text without
    its backtrace and markup (both sides refuse with this, so the same grammar reads the same)."""
    text = message.replace("<non-verbose/>", " ").split("<backtrace>")[0]
    line = " ".join(part.strip() for part in text.splitlines() if part.strip())
    if line.startswith("panic: "):
        line = "the grammar library failed on it (" + line[len("panic: "):] + ")"
    return line[:500] or "no reason given"


def choice_seed(seed: int, choice: int) -> int:
    """The seed of choice `choice` of n: choice 0 uses the seed itself, so n=1 and the first of n
    choices agree; the others are spread by the golden-ratio constant. In [0, 2^64)."""
    return (seed + choice * 0x9E3779B97F4A7C15) % 2**64


def generate_payload(members: list[dict], sampling: Sampling, max_prompt_tokens: int | None = None,
                     tools: str | None = None) -> dict:
    """A generate SUBMIT: members are {"text"}, {"ids"} or {"messages"}; `tools`: the JSON text
    of the tools a messages member's template renders."""
    p = {"op": "generate", "members": members, **sampling.wire()}
    if max_prompt_tokens is not None:
        p["max_prompt_tokens"] = max_prompt_tokens
    if tools is not None:
        p["tools"] = tools
    return p


_CALL = Obj({"id": Str(256), "name": Str(256), "arguments": Str(MAX_TEXT)})
_MESSAGE = Obj({"role": Enum(*ROLES, "tool"), "content": Str(MAX_TEXT)},
               {"tool_calls": List(_CALL, MAX_TOOL_CALLS, 1), "tool_call_id": Str(256), "name": Str(256)})
MEMBER = OneKey({"text": Str(MAX_TEXT), "ids": List(TOKEN_ID, MAX_IDS), "messages": List(_MESSAGE, MAX_IDS, 1)})

SUBMIT_SCHEMA = Obj({"op": Enum("generate", "tokenize", "detokenize", "render")}, {
    "members": List(MEMBER, MAX_MEMBERS, 1),
    "max_tokens": Int(0, MAX_TOKENS),
    "temperature": Num(*TEMPERATURE),
    "top_p": Num(*TOP_P, lo_open=True),
    "top_k": Int(0, 2**31 - 1),
    "seed": Int(*SEED),
    "n": Int(1, MAX_CHOICES),
    "stop": List(Str(MAX_STOP_CHARS, min_len=1), MAX_STOPS),
    "presence_penalty": Num(*PENALTY),
    "frequency_penalty": Num(*PENALTY),
    "logit_bias": IdMap(Num(*LOGIT_BIAS), MAX_LOGIT_BIAS),
    "logprobs": Int(0, MAX_LOGPROBS),
    "echo": Bool(),
    "grammar": Str(MAX_GRAMMAR, min_len=1),
    "constrained_logprobs": Bool(),
    "distribution": Bool(),
    "score_tokens": List(IntOrStr(TOKEN_ID, Str(MAX_SCORE_TEXT, min_len=1)), MAX_SCORE_TOKENS, 1),
    "cache_salt": Str(MAX_CACHE_SALT, min_len=1),
    "tools": Str(MAX_GRAMMAR, min_len=2),   # JSON text: OpenAI's tools array, for messages members
    "max_prompt_tokens": Int(1),       # the members' prompt tokens together, at most (batches)
    "add_special_tokens": Bool(),      # tokenize, render
    "count_only": Bool(),              # tokenize: answer the count alone
    "ids": List(TOKEN_ID, MAX_IDS),    # detokenize
})


def param_of(path: str) -> tuple[str, int | None]:
    """(param, member) an ERROR BAD_REQUEST names for a SUBMIT field refused at `path`: the
    top-level field, or `members[i]` with its member index."""
    rest = path.removeprefix("SUBMIT").lstrip(".")
    if rest.startswith("members["):
        head = rest[: rest.index("]") + 1]
        return head, int(head[len("members["):-1])
    for i, c in enumerate(rest):
        if c in ".[":
            return rest[:i], None
    return rest or "op", None
