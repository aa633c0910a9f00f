"""Prometheus metrics under the `cde:` prefix (vLLM-style names, DESIGN.md "Contracts").

Latencies are measured here, at the edge, because that is what a client experiences; queue and
KV gauges come from the scheduler's Stats at scrape time so they are never stale. Each gateway
instance owns its registry so several can live in one process (tests, launchers).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST

from cde.rpc.v1 import common_pb2, scheduler_pb2

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)

CONTENT_TYPE = CONTENT_TYPE_LATEST


class GatewayMetrics:
    def __init__(self, model: str) -> None:
        self.model = model
        r = self.registry = CollectorRegistry(auto_describe=True)
        lbl = ["model_name"]
        self.running = Gauge("cde:num_requests_running", "Requests running on workers (scheduler Stats).", lbl, registry=r)
        self.waiting = Gauge("cde:num_requests_waiting", "Requests queued in the scheduler.", lbl, registry=r)
        self.kv_usage = Gauge("cde:kv_cache_usage_perc", "Fraction of KV pages in use over all workers (0..1).", lbl, registry=r)
        self.workers = Gauge("cde:num_workers", "Workers registered with the scheduler.", lbl, registry=r)
        self.scheduler_up = Gauge("cde:scheduler_up", "1 when the last Stats call succeeded.", lbl, registry=r)
        # Per worker, from its last heartbeat (scheduler Stats): load balancers and autoscalers read these.
        wl = lbl + ["worker_id"]
        self.worker_kv_usage = Gauge("cde:worker_kv_cache_usage_perc", "Fraction of one worker's KV pages in use (0..1).",
                                     wl, registry=r)
        self.worker_running = Gauge("cde:worker_num_requests_running", "Requests one worker's engine is decoding.", wl,
                                    registry=r)
        self.worker_waiting = Gauge("cde:worker_num_requests_waiting", "Requests waiting in one worker's engine.", wl,
                                    registry=r)
        self.worker_draining = Gauge("cde:worker_draining", "1 while a worker drains (SIGTERM): it takes no new requests.",
                                     wl, registry=r)
        self.in_flight = Gauge("cde:gateway_requests_in_flight", "Generations this gateway is streaming now.", lbl, registry=r)
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
        m = self.model
        self.scheduler_up.labels(m).set(0 if stats is None else 1)
        if stats is None:
            return
        self.running.labels(m).set(stats.running)
        self.waiting.labels(m).set(stats.waiting)
        self.workers.labels(m).set(len(stats.workers))
        total = sum(w.kv_pages_total for w in stats.workers)
        free = sum(w.kv_pages_free for w in stats.workers)
        self.kv_usage.labels(m).set((total - free) / total if total else 0.0)
        per_worker = (self.worker_kv_usage, self.worker_running, self.worker_waiting, self.worker_draining)
        for gauge in per_worker:
            gauge.clear()   # a worker that left must not keep its last figures
        for w in stats.workers:
            used = (w.kv_pages_total - w.kv_pages_free) / w.kv_pages_total if w.kv_pages_total else 0.0
            for gauge, value in zip(per_worker, (used, w.running, w.waiting, int(w.draining))):
                gauge.labels(m, w.worker_id).set(value)

    def render(self) -> bytes:
        return generate_latest(self.registry)


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
            itl = m.itl.labels(label)   # once: one observation per token of the block
            for _ in range(n_tokens):
                itl.observe(gap / n_tokens)
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
