"""Per-request stage times for benchmarks: off unless CDE_TRACE_DIR names a directory.

When on, a service appends one JSON line per request to <dir>/<service>-<pid>.jsonl when the
request's first block passes it: {"rid": ..., "<stage>": unix seconds, ...}. bench.services
(--trace) joins every service's line with the load client's by request id: where a request's
time to first block goes, hop by hop. Wall-clock stamps (time.time()): one clock for every
process of a host; each service converts from the clock it measures with (`wall`).
"""

from __future__ import annotations

import json
import os
import time
from typing import TextIO

ENV = "CDE_TRACE_DIR"
_DIR = os.environ.get(ENV) or None
_files: dict[str, TextIO] = {}


def enabled() -> bool:
    return _DIR is not None


def wall(stamp: float, clock=time.monotonic) -> float:
    """A stamp of `clock` (monotonic, perf_counter) as unix seconds."""
    return time.time() - (clock() - stamp)


def record(service: str, rid: str, **stamps: float) -> None:
    if _DIR is None:
        return
    f = _files.get(service)
    if f is None:   # line-buffered: every line is on disk when the request's first block is out
        f = _files[service] = open(os.path.join(_DIR, f"{service}-{os.getpid()}.jsonl"), "a", buffering=1)  # noqa: SIM115
    f.write(json.dumps({"rid": rid, **stamps}) + "\n")
