"""Locustfile: a user streaming POST /v1/completions (SSE) in a closed loop, timing every block.

    CDE_LOAD_EVENTS=run.jsonl python -m locust -f bench/locust_sse.py --headless -u 8 -r 8 -t 30s \
        --host http://127.0.0.1:8000

Run by locust (it monkey-patches with gevent), never imported by the stack or the tests.
Settings come from the environment: CDE_LOAD_PROMPT_TOKENS (128; random token ids below
CDE_LOAD_TOKEN_BOUND, 256), CDE_LOAD_MAX_TOKENS (256), CDE_LOAD_MODEL (unset: the gateway's).
Besides locust's own statistics ("time to first block", "inter-block latency", "completion
(tokens)"), each finished request appends one JSON line to CDE_LOAD_EVENTS when set:
{"start", "end", "ttfb_s", "gaps_s": [...], "blocks": [[arrival, tokens], ...], "tokens", "ok", "error",
"request_id"},
times from time.time() so that several processes' lines share one clock.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from pathlib import Path

from locust import HttpUser, constant, task

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # locust puts only bench/ on the path
from cde.sse import is_sse_done, parse_sse_line  # noqa: E402

PROMPT_TOKENS = int(os.environ.get("CDE_LOAD_PROMPT_TOKENS", 128))
TOKEN_BOUND = int(os.environ.get("CDE_LOAD_TOKEN_BOUND", 256))
MAX_TOKENS = int(os.environ.get("CDE_LOAD_MAX_TOKENS", 256))
MODEL = os.environ.get("CDE_LOAD_MODEL") or None
EVENTS = os.environ.get("CDE_LOAD_EVENTS") or None


def record(line: dict) -> None:
    if EVENTS:
        with open(EVENTS, "a") as f:   # one write per line: greenlets of one process never interleave it
            f.write(json.dumps(line) + "\n")


class StreamingCompletion(HttpUser):
    wait_time = constant(0)   # closed loop: C users keep C requests in flight

    def fire(self, name: str, ms: float, length: int = 0) -> None:
        self.environment.events.request.fire(request_type="SSE", name=name, response_time=ms,
                                             response_length=length, exception=None, context={})

    @task
    def complete(self) -> None:
        rng = random.Random()
        body = {"prompt": [rng.randrange(TOKEN_BOUND) for _ in range(PROMPT_TOKENS)], "max_tokens": MAX_TOKENS,
                "seed": rng.randrange(1 << 30), "stream": True, "stream_options": {"include_usage": True}}
        if MODEL:
            body["model"] = MODEL
        start, t0 = time.time(), time.perf_counter()
        stamps: list[float] = []
        block_tokens: list[int] = []
        tokens, error, request_id = 0, None, None
        with self.client.post("/v1/completions", json=body, stream=True, catch_response=True,
                              name="POST /v1/completions (SSE)", timeout=600) as r:
            if r.status_code != 200:
                error = f"HTTP {r.status_code}: {r.text[:200]}"
            else:
                done = False
                for raw in r.iter_lines():
                    line = raw.decode("utf-8") if isinstance(raw, bytes) else raw
                    if is_sse_done(line):
                        done = True
                        break
                    ev = parse_sse_line(line)
                    if ev is None:
                        continue
                    if "error" in ev:
                        error = f"error event: {ev['error']}"
                        break
                    cde = ev.get("cde") or {}
                    request_id = request_id or cde.get("request_id")
                    if "block_index" in cde and ev.get("object") != "cde.step":
                        stamps.append(time.perf_counter())
                        block_tokens.append(len(cde.get("tokens") or ()))
                        tokens += block_tokens[-1]
                if error is None and (not done or not stamps):
                    error = "stream ended without blocks or [DONE]"
            if error is None:
                r.success()
            else:
                r.failure(error)
        end = time.perf_counter()
        gaps = [b - a for a, b in zip(stamps, stamps[1:])]
        if error is None:
            self.fire("time to first block", (stamps[0] - t0) * 1000)
            for g in gaps:
                self.fire("inter-block latency", g * 1000)
            self.fire("completion (tokens)", (end - t0) * 1000, tokens)
        record({"start": start, "end": start + (end - t0), "ttfb_s": (stamps[0] - t0) if stamps else None,
                "gaps_s": gaps, "blocks": [[start + (t - t0), n] for t, n in zip(stamps, block_tokens)],
                "tokens": tokens, "ok": error is None, "error": error, "request_id": request_id})
