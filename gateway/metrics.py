"""Prometheus metrics under the `cde:` prefix (vLLM-style names, DESIGN.md "Contracts").

Latencies are measured here, at the edge, because that is what a client experiences; queue and
KV gauges come from the scheduler's Stats at scrape time so they are never stale. Each gateway
instance owns its registry so several can live in one process (tests, launchers).

Several gateway processes on one port (`--processes`, gateway/processes.py) share their
latencies and counters through prometheus_client's multiprocess mode: the supervisor sets
PROMETHEUS_MULTIPROC_DIR before its children import prometheus_client, each child's values live
in memory-mapped files there, and whichever child answers a scrape sums every child's files.
The scheduler's gauges are not summed: a collector reports the Stats this process last read.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector

from cde.rpc.v1 import common_pb2, scheduler_pb2

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)

CONTENT_TYPE = CONTENT_TYPE_LATEST
MULTIPROCESS_ENV = "PROMETHEUS_MULTIPROC_DIR"   # prometheus_client reads it when first imported


def observe_many(histogram, value: float, n: int) -> None:
    """`n` observations of one value on a histogram child, at the cost of one: the inter-token
    histogram gets a block's 64 equal observations at once (64 observe() calls were ~70 us of a
    block's handling). Uses the pinned prometheus_client's bucket counters (n observe() calls
    where they are missing); tests compare the result with n observe() calls."""
    if n <= 0:
        return
    bounds, buckets, total = (getattr(histogram, a, None) for a in ("_upper_bounds", "_buckets", "_sum"))
    if bounds is None or buckets is None or total is None:
        for _ in range(n):
            histogram.observe(value)
        return
    total.inc(value * n)
    for i, bound in enumerate(bounds):
        if value <= bound:
            buckets[i].inc(n)
            break


class SchedulerStatsCollector:
    """The scheduler's Stats as gauges, built when scraped from the Stats this process read last
    (a worker that left has no sample). Not a multiprocess metric: every gateway process reads
    the same scheduler, so summing the processes' copies would be wrong."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.stats: scheduler_pb2.StatsResponse | None = None   # the last successful Stats
        self.up = False

    def describe(self) -> Iterator[Metric]:
        return self.collect()

    def collect(self) -> Iterator[Metric]:
        m, s = self.model, self.stats

        def gauge(name: str, doc: str, samples: list[tuple[list[str], float]], per_worker: bool = False):
            g = GaugeMetricFamily(name, doc, labels=["model_name", "worker_id"] if per_worker else ["model_name"])
            for labels, v in samples:
                g.add_metric(labels, v)
            return g

        workers = list(s.workers) if s is not None else []
        total = sum(w.kv_pages_total for w in workers)
        used = total - sum(w.kv_pages_free for w in workers)
        overall = [] if s is None else [("cde:num_requests_running", "Requests running on workers (scheduler Stats).",
                                         s.running),
                                        ("cde:num_requests_waiting", "Requests queued in the scheduler.", s.waiting),
                                        ("cde:kv_cache_usage_perc", "Fraction of KV pages in use over all workers (0..1).",
                                         used / total if total else 0.0),
                                        ("cde:num_workers", "Workers registered with the scheduler.", len(workers))]
        for name, doc, v in overall:
            yield gauge(name, doc, [([m], v)])
        yield gauge("cde:scheduler_up", "1 when the last Stats call succeeded.", [([m], 1 if self.up else 0)])
        # Per worker, from its last heartbeat (scheduler Stats): load balancers and autoscalers read these.
        for name, doc, value in (
                ("cde:worker_kv_cache_usage_perc", "Fraction of one worker's KV pages in use (0..1).",
                 lambda w: (w.kv_pages_total - w.kv_pages_free) / w.kv_pages_total if w.kv_pages_total else 0.0),
                ("cde:worker_num_requests_running", "Requests one worker's engine is decoding.", lambda w: w.running),
                ("cde:worker_num_requests_waiting", "Requests waiting in one worker's engine.", lambda w: w.waiting),
                ("cde:worker_draining", "1 while a worker drains (SIGTERM): it takes no new requests.",
                 lambda w: int(w.draining))):
            yield gauge(name, doc, [([m, w.worker_id], value(w)) for w in workers], per_worker=True)
        # The prefix cache, as vLLM names it (`_total` is the exposition's suffix): the sums over the
        # workers registered now and each worker's own; a restarted worker starts again from 0.
        for name, doc, value in (
                ("cde:prefix_cache_queries", "Prompt (and resumed) tokens of requests the workers admitted.",
                 lambda w: w.prefix_cache_queries),
                ("cde:prefix_cache_hits", "Of those, tokens whose K/V came from the prefix cache.",
                 lambda w: w.prefix_cache_hits)):
            if s is None:
                continue
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric([m], sum(value(w) for w in workers))
            yield c
            c = CounterMetricFamily(name.replace("cde:", "cde:worker_"), doc + " One worker's.",
                                    labels=["model_name", "worker_id"])
            for w in workers:
                c.add_metric([m, w.worker_id], value(w))
            yield c


class GatewayMetrics:
    def __init__(self, model: str) -> None:
        self.model = model
        # set for the processes of a multi-process gateway (gateway/processes.py), before import
        self._multiprocess_dir = os.environ.get(MULTIPROCESS_ENV)
        r = self.registry = CollectorRegistry(auto_describe=True)
        lbl = ["model_name"]
        self.scheduler_stats = SchedulerStatsCollector(model)
        r.register(self.scheduler_stats)
        self.in_flight = Gauge("cde:gateway_requests_in_flight", "Generations this gateway is streaming now.", lbl,
                               registry=r, multiprocess_mode="livesum")
        self.ttft = Histogram("cde:time_to_first_token_seconds", "Request received -> first token (step or block).", lbl,
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.ttfb = Histogram("cde:time_to_first_block_seconds", "Request received -> first committed block.", lbl,
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.inter_block = Histogram("cde:inter_block_latency_seconds", "Between consecutive committed blocks.", lbl,
                                     buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("cde:inter_token_latency_seconds", "Inter-block latency spread over the block's tokens.", lbl,
                             buckets=_TOKEN_BUCKETS, registry=r)
        self.e2e = Histogram("cde:e2e_request_latency_seconds", "Request received -> finished.", lbl,
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.success = Counter("cde:request_success", "Finished generations by finish reason.", lbl + ["finished_reason"], registry=r)
        self.failures = Counter("cde:request_failure", "Requests that failed, by HTTP status.", lbl + ["status"], registry=r)
        self.prompt_tokens = Counter("cde:prompt_tokens", "Prompt tokens of accepted requests.", lbl, registry=r)
        self.generation_tokens = Counter("cde:generation_tokens", "Output tokens streamed to clients.", lbl, registry=r)
        # Causal models (decode.stride): how many tokens each forward produced, and how many drafts passed.
        self.tokens_per_forward = Histogram("cde:tokens_per_forward", "Output tokens per model forward, per request.",
                                            lbl, buckets=(1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 8.0,
                                                          12.0, 16.0), registry=r)
        self.isd_acceptance = Histogram("cde:isd_acceptance_rate", "Accepted / proposed ISD drafts, per request.", lbl,
                                        buckets=tuple(i / 10 for i in range(11)), registry=r)

    def request(self) -> RequestTimer:
        return RequestTimer(self)

    def failed(self, status: int) -> None:
        self.failures.labels(self.model, str(status)).inc()

    def update_from_stats(self, stats: scheduler_pb2.StatsResponse | None) -> None:
        """A Stats call's result; None = it failed (scheduler_up 0, the last figures kept)."""
        self.scheduler_stats.up = stats is not None
        if stats is not None:
            self.scheduler_stats.stats = stats

    def render(self) -> bytes:
        if not self._multiprocess_dir:
            return generate_latest(self.registry)
        # several processes: every process's latencies and counters, summed from their files
        scrape = CollectorRegistry(auto_describe=False)
        MultiProcessCollector(scrape, path=self._multiprocess_dir)
        scrape.register(self.scheduler_stats)
        return generate_latest(scrape)


@dataclass
class RequestTimer:
    """Per-request latency bookkeeping; `t0` is when the gateway received the request."""

    metrics: GatewayMetrics
    t0: float = field(default_factory=time.perf_counter)
    first_token: float | None = None
    last_block: float | None = None

    def step(self, n_tokens: int) -> None:
        if n_tokens and self.first_token is None:
            self.first_token = time.perf_counter()
            self.metrics.ttft.labels(self.metrics.model).observe(self.first_token - self.t0)

    def block(self, n_tokens: int) -> None:
        m, now = self.metrics, time.perf_counter()
        label = m.model
        if self.last_block is None:
            m.ttfb.labels(label).observe(now - self.t0)
        else:
            gap = now - self.last_block
            m.inter_block.labels(label).observe(gap)
            if n_tokens:   # one observation per token of the block
                observe_many(m.itl.labels(label), gap / n_tokens, n_tokens)
        self.last_block = now
        self.step(n_tokens)
        m.generation_tokens.labels(label).inc(n_tokens)

    def finished(self, reason: str, usage: common_pb2.Usage | None = None, isd: bool = False) -> None:
        m = self.metrics
        m.e2e.labels(m.model).observe(time.perf_counter() - self.t0)
        m.success.labels(m.model, reason).inc()
        if usage is not None and usage.tokens_per_forward > 0:
            m.tokens_per_forward.labels(m.model).observe(usage.tokens_per_forward)
            if isd:
                m.isd_acceptance.labels(m.model).observe(usage.isd_acceptance)
