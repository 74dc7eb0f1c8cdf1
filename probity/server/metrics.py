"""/metrics on prometheus-client: one registry per app, vLLM's metric set with a `probity_` prefix.

Every label value comes from a bounded set chosen by the server (a route template, a status
code, a refusal code), never from the request, and the library escapes and formats every
sample — so no request can add a series or forge a sample, and counters print exactly.
"""
from __future__ import annotations

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, generate_latest
from starlette.routing import Match

# `_created` samples double every counter's series and no dashboard reads them.
prometheus_client.disable_created_metrics()

CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4
OTHER_ROUTE = "other"
REFUSALS = ("invalid_host", "invalid_api_key")

# vLLM's buckets, so the same dashboards and quantile queries apply.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0, 7680.0)

# STATS fields that count up from the engine's start: (field, metric name without _total, help)
ENGINE_COUNTERS = (
    ("prefix_query_tokens", "probity_prefix_cache_queries", "Prefix cache queries, in prompt tokens looked up."),
    ("prefix_hit_tokens", "probity_prefix_cache_hits", "Prefix cache hits, in prompt tokens served from the cache."),
    ("forward_passes", "probity_engine_forward_passes", "Forward passes the engine ran."),
    ("prompt_tokens_computed", "probity_engine_prompt_tokens_computed",
     "Prompt positions the engine ran through the model (cache hits excluded)."),
    ("generated_tokens", "probity_engine_generated_tokens", "Tokens the engine sampled."),
)
# STATS fields that are a reading of now: (field, metric name, help)
ENGINE_GAUGES = (
    ("active", "probity_num_requests_running", "Sequences in the engine's running batch."),
    ("waiting", "probity_num_requests_waiting", "Sequences submitted to the engine and waiting to run."),
    ("tokens_per_s", "probity_engine_tokens_per_second", "Tokens sampled per second since the previous report."),
    ("grammar_cache_bytes", "probity_engine_grammar_cache_bytes",
     "Memory the engine's compiled grammars hold, as measured when each was compiled."),
    ("grammar_cache_entries", "probity_engine_grammar_cache_entries", "Compiled grammars the engine keeps."),
)


def route_label(routes, scope) -> str:
    """The template of the route a request addresses ('/v1/models/{model_id:path}'), a
    method mismatch included; any path no route knows is one label."""
    partial = None
    for route in routes:
        match, _ = route.matches(scope)
        if match == Match.FULL:
            return route.path
        if match == Match.PARTIAL and partial is None:
            partial = route.path
    return partial or OTHER_ROUTE


class EngineFigures:
    """A collector for what the engine reports in STATS. Cumulative fields are carried across
    engine restarts (each new engine counts from zero); a field the engine never sent is not
    exported, rather than exported as a made-up zero."""

    def __init__(self, engine):
        self.engine = engine
        self.totals: dict[str, int] = {}
        self.last: dict[str, int] = {}
        self.now: dict = {}

    def engine_started(self) -> None:
        self.last = {}
        self.now = {}

    def report(self, stats: dict) -> None:
        for key, _, _ in ENGINE_COUNTERS:
            if key in stats:
                value = stats[key]
                self.totals[key] = self.totals.get(key, 0) + max(value - self.last.get(key, 0), 0)
                self.last[key] = value
        self.now = stats

    def collect(self):
        yield GaugeMetricFamily("probity_engine_up", "1 while the engine is up and answering.",
                                value=1 if self.engine.up else 0)
        yield CounterMetricFamily("probity_engine_restarts", "Engine restarts after a failure.",
                                  value=self.engine.restarts)
        for key, name, doc in ENGINE_COUNTERS:
            if key in self.totals:
                yield CounterMetricFamily(name, doc, value=self.totals[key])
        for key, name, doc in ENGINE_GAUGES:
            if key in self.now:
                yield GaugeMetricFamily(name, doc, value=self.now[key])
        used, total = self.now.get("kv_blocks_used"), self.now.get("kv_blocks_total")
        if used is not None and total:
            yield GaugeMetricFamily("probity_kv_cache_usage_perc", "KV-cache usage; 1 means 100 percent.",
                                    value=used / total)


class GrammarFigures:
    """The server's grammar check (grammar_check.GrammarCheck): its verdict cache and its worker."""

    def __init__(self, check):
        self.check = check

    def collect(self):
        c = self.check
        yield GaugeMetricFamily("probity_grammar_verdicts_cached_bytes",
                                "Bytes the server's cached grammar verdicts hold.", value=c.cached_bytes)
        yield GaugeMetricFamily("probity_grammar_verdicts_cached", "Grammar verdicts the server keeps.",
                                value=c.cached)
        yield CounterMetricFamily("probity_grammar_compiles", "Grammars the server's compile worker checked.",
                                  value=c.compiled)
        yield CounterMetricFamily("probity_grammar_workers_replaced",
                                  "Grammar compile workers ended by their time or memory limit, and replaced.",
                                  value=c.workers_replaced)


class Metrics:
    def __init__(self, admission, engine, grammar=None):
        self.registry = CollectorRegistry()
        r = self.registry
        self.routes: list = []  # the app's route table, set once the app exists
        self.requests = Counter("probity_http_requests", "HTTP requests by route template and status code.",
                                ("route", "status"), registry=r)
        self.refusals = Counter("probity_refused_requests", "Requests refused before routing, by error code.",
                                ("code",), registry=r)
        for code in REFUSALS:
            self.refusals.labels(code)
        self.prompt_tokens = Counter("probity_prompt_tokens", "Prompt tokens of finished requests.", registry=r)
        self.cached_tokens = Counter("probity_prompt_tokens_cached",
                                     "Prompt tokens of finished requests served from the prefix cache.", registry=r)
        self.generation_tokens = Counter("probity_generation_tokens", "Generated tokens of finished requests.",
                                         registry=r)
        self.ttft = Histogram("probity_time_to_first_token_seconds",
                              "Time from the request's arrival to its first generated token.",
                              buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("probity_time_per_output_token_seconds",
                              "Per generated sequence: time between its first and last token / (tokens - 1).",
                              buckets=TPOT_BUCKETS, registry=r)
        self.e2e = Histogram("probity_e2e_request_latency_seconds",
                             "Time from the request's arrival to its last frame.",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.queue = Histogram("probity_request_queue_time_seconds",
                               "Time waiting: for a slot in the server's queue, then in the engine's.",
                               buckets=LATENCY_BUCKETS, registry=r)
        self.prefill = Histogram("probity_request_prefill_time_seconds", "Engine time spent in prefill.",
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.decode = Histogram("probity_request_decode_time_seconds", "Engine time spent in decode.",
                                buckets=LATENCY_BUCKETS, registry=r)
        Gauge("probity_queue_depth", "Requests waiting in the server's queue for a slot.",
              registry=r).set_function(lambda: admission.queued)
        Gauge("probity_requests_active", "Requests holding a slot (submitted to the engine).",
              registry=r).set_function(lambda: admission.active)
        self.engine = EngineFigures(engine)
        r.register(self.engine)
        if grammar is not None:
            r.register(GrammarFigures(grammar))

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def request(self, scope, status: int) -> None:
        self.requests.labels(route_label(self.routes, scope), str(status)).inc()

    def refused(self, scope, code: str, status: int) -> None:
        self.refusals.labels(code).inc()
        self.request(scope, status)

    def finished(self, gen, done: dict, now: float) -> None:
        """A generate request's DONE: its tokens and timings (`gen` is its Generation)."""
        u = done.get("usage", {})
        self.prompt_tokens.inc(u.get("prompt_tokens", 0))
        self.cached_tokens.inc(u.get("cached_tokens", 0))
        self.generation_tokens.inc(u.get("completion_tokens", 0))
        self.e2e.observe(now - gen.t0)
        if gen.first_token_at is not None:
            self.ttft.observe(gen.first_token_at - gen.t0)
        t = done.get("timings", {})
        self.queue.observe(gen.queue_s + t.get("queue_s", 0.0))
        if "prefill_s" in t:
            self.prefill.observe(t["prefill_s"])
        if "decode_s" in t:
            self.decode.observe(t["decode_s"])
        for c in done.get("choices", []):
            span = gen.token_span.get((c["member"], c["choice"]))
            if span is not None and c["completion_tokens"] > 1:
                self.tpot.observe((span[1] - span[0]) / (c["completion_tokens"] - 1))
