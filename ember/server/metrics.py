"""Prometheus metrics of the server (prometheus-client, names prefixed ``ember_``, vLLM's set where it has one).

Per-request figures (finish reasons, tokens, TTFT / TPOT / end-to-end latency) are observed by the server as each
request ends; the engine's state (running, waiting, KV cache usage, prefix-cache hits, preemptions) is read from
``EngineClient.stats()`` when /metrics is scraped, so nothing polls between scrapes. A server of several engines
labels every series with the engine's model name.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from ember.errors import EngineDeadError

TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
TPOT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 300.0)


@dataclass(slots=True)
class RequestTiming:
    """One engine request as the server saw it (monotonic seconds)."""

    start: float
    prompt_tokens: int
    first_token: float | None = None
    generated: int = 0


@dataclass(frozen=True, slots=True)
class EngineSource:
    """Where one engine's state is read at scrape time."""

    model_name: str
    stats: Callable[[], dict]
    admitted: Callable[[], tuple[int, int]]  # (engine requests in flight, capacity)


class ServerMetrics:
    def __init__(self, engines: Sequence[EngineSource]):
        self.registry = CollectorRegistry()
        lab = ["model_name"]
        r = self.registry
        self.finished = Counter("ember_request_success", "Requests finished, by finish reason (stop, length, "
                                "abort)", lab + ["finish_reason"], registry=r)
        self.rejected = Counter("ember_request_rejected", "Requests refused before reaching the engine, by reason",
                                lab + ["reason"], registry=r)
        self.prompt_tokens = Counter("ember_prompt_tokens", "Prompt tokens of finished requests", lab, registry=r)
        self.generation_tokens = Counter("ember_generation_tokens", "Generated tokens of finished requests", lab,
                                         registry=r)
        self.ttft = Histogram("ember_time_to_first_token_seconds", "Arrival to first generated token", lab,
                              buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("ember_time_per_output_token_seconds", "Mean time between output tokens of a request",
                              lab, buckets=TPOT_BUCKETS, registry=r)
        self.e2e = Histogram("ember_e2e_request_latency_seconds", "Arrival to the last token", lab,
                             buckets=E2E_BUCKETS, registry=r)
        self.restarts = Counter("ember_engine_restarts", "Engines started again after their loop stopped", lab,
                                registry=r)
        r.register(_EngineCollector(tuple(engines)))

    def request_done(self, m: str, t: RequestTiming, finish_reason: str, end: float) -> None:
        """One engine request of model m ended."""
        self.finished.labels(m, finish_reason).inc()
        self.prompt_tokens.labels(m).inc(t.prompt_tokens)
        self.generation_tokens.labels(m).inc(t.generated)
        if t.first_token is not None:
            self.ttft.labels(m).observe(t.first_token - t.start)
            if t.generated > 1:
                self.tpot.labels(m).observe((end - t.first_token) / (t.generated - 1))
        self.e2e.labels(m).observe(end - t.start)

    def engine_restarted(self, m: str) -> None:
        self.restarts.labels(m).inc()

    def reject(self, m: str, reason: str) -> None:
        self.rejected.labels(m, reason).inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


_GAUGES = (  # (name, help, key of the engine's row)
    ("ember_num_requests_running", "Requests in the engine's running batch", "running"),
    ("ember_num_requests_waiting", "Requests waiting for a seat in the engine", "waiting"),
    ("ember_kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1)", "kv_cache_usage"),
    ("ember_prefix_cache_hit_ratio", "Prompt tokens found in the prefix cache over prompt tokens looked up (0-1)",
     "prefix_cache_hit_rate"),
    ("ember_kv_cache_blocks_total", "KV cache blocks in the pool", "kv_blocks_total"),
    ("ember_server_requests_in_flight", "Engine requests the server has admitted", "in_flight"),
    ("ember_server_request_capacity", "Engine requests the server admits at most (running + queue)", "capacity"))
_COUNTERS = (
    ("ember_num_preemptions", "Sequences preempted (KV blocks given back) since start", "preemptions"),
    ("ember_prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache since start",
     "prefix_cache_hit_tokens"))
_SPEC_COUNTERS = (  # speculative decoding, vLLM's spec_decode set; only engines that speculate have them
    ("ember_spec_decode_num_drafts", "Rows that verified a draft since start", "spec_decode_num_drafts"),
    ("ember_spec_decode_num_draft_tokens", "Drafted tokens verified since start", "spec_decode_num_draft_tokens"),
    ("ember_spec_decode_num_accepted_tokens", "Drafted tokens kept since start", "spec_decode_num_accepted_tokens"))


class _EngineCollector:
    """Every engine's state, read at scrape time: one sample per engine in each family."""

    def __init__(self, engines: tuple[EngineSource, ...]):
        self.engines = engines

    def collect(self) -> Iterator[Metric]:
        rows = []
        for e in self.engines:
            in_flight, capacity = e.admitted()
            try:
                stats = e.stats()
            except EngineDeadError:  # a stopped engine has no state to show; /health says it stopped
                continue
            rows.append((e.model_name, {**stats, "in_flight": in_flight, "capacity": capacity}))
        spec = [(model, row) for model, row in rows if "spec_decode_num_drafts" in row]
        tables = [(_GAUGES, GaugeMetricFamily, rows), (_COUNTERS, CounterMetricFamily, rows)]
        if spec:  # only engines that speculate have these families
            tables.append((_SPEC_COUNTERS, CounterMetricFamily, spec))
        for table, family, which in tables:
            for name, doc, key in table:
                m = family(name, doc, labels=["model_name"])
                for model, row in which:
                    m.add_metric([model], float(row[key]))
                yield m
        if not spec:
            return
        m = CounterMetricFamily("ember_spec_decode_num_accepted_tokens_per_pos",
                                "Drafts whose token at this position was kept, since start",
                                labels=["model_name", "position"])
        for model, row in spec:
            for pos, count in enumerate(row["spec_decode_accepted_per_position"]):
                m.add_metric([model, str(pos)], float(count))
        yield m
