"""The engine runtime both decoders run on: the step loop with overlapped steps, the request
table, cancel, stats, warm-up helpers, compile counting and the CUDA-graph cache.

A decoder (steerling_engine.SteerlingEngine: block diffusion; isd_engine.IsdEngine: causal
ISD) subclasses `EngineRuntime` and implements `DecodeStrategy`: how requests are admitted,
which rows a step has, how a step is launched on the device and how its results are applied.
"""

from __future__ import annotations

import gc
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import Tensor

from worker_svc.engine.events import FinishEvent
from worker_svc.engine.graphs import GraphCache
from worker_svc.engine.kv_cache import KVCache
from worker_svc.engine.request_table import RequestTable, TrackedRequest

ROW_BUCKETS = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 20, 24, 28, 32, 40, 48, 56, 64, 80, 96, 112, 128)


def bucket(n: int, buckets: tuple[int, ...]) -> int:
    for b in buckets:
        if n <= b:
            return b
    return n


def to_device(inputs: Any, device: torch.device) -> Any:
    """A dataclass of host numpy arrays -> the same dataclass of device tensors, field by name
    (non-blocking copies: the host buffers stay alive until the step's results are read)."""
    return type(inputs)(**{f.name: torch.from_numpy(getattr(inputs, f.name)).to(device, non_blocking=True)
                           for f in fields(inputs)})


@dataclass
class LaunchedStep:
    """A step on its way: its rows, the layout of its packed results (it depends on the step's
    tokens or drafts per row) and those results, whose device-to-host copy is pending until
    `done`."""

    rows: list
    layout: Any   # layouts.BlockResultLayout | layouts.IsdResultLayout
    host: Tensor
    done: object | None   # torch.cuda.Event, None on the CPU
    host_plan: Any = None  # what the strategy decided at launch and checks when applying (optional)
    # torch.cuda.Event the strategy recorded where the rest of the step outlasts the host's
    # planning of the next one (None: plan it as soon as this step is launched)
    plan_point: object | None = None

    def wait(self) -> None:
        """Until the results' copy has landed (the GIL released meanwhile)."""
        if self.done is not None:
            self.done.synchronize()

    def results(self) -> Tensor:
        """The packed results on the host, once their copy has landed."""
        self.wait()
        return self.host


class PinnedPairs:
    """Two pinned host buffers per (shape, dtype), handed out in turn: a launched step's results
    land in one while the step before it may still be read from the other. (An earlier version
    handed out the first buffer twice in a row: an overlapped step's copy could then overwrite
    the results of the step launched just before it, with the same shape, before they were read.)"""

    def __init__(self, pin: bool = True):
        self.pin = pin   # False: plain host memory (tests without a GPU)
        self._bufs: dict[tuple, list[Tensor]] = {}

    def next(self, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
        bufs = self._bufs.setdefault((tuple(shape), dtype), [])
        if len(bufs) < 2:
            bufs.append(torch.empty(shape, dtype=dtype, pin_memory=self.pin))
        else:
            bufs.append(bufs.pop(0))
        return bufs[-1]

    def start_copy(self, out: Tensor) -> tuple[Tensor, object | None]:
        """A launched step's one device-to-host copy of its results, started now (before a later
        step can reuse a CUDA graph's output buffer) into the next pinned buffer: (host tensor,
        event to wait on). On the CPU the results are already there: (out, None)."""
        if out.device.type != "cuda":
            return out, None
        host = self.next(out.shape, out.dtype)
        host.copy_(out, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return host, done


@dataclass
class EngineStats:
    pages_total: int
    pages_used: int
    pages_free: int
    running: int
    waiting: int
    steps: int
    forwards: int
    compiles: int
    preemptions: int
    graphs: int = 0
    overlapped_steps: int = 0
    late_plans: int = 0          # overlapped steps planned at the step in flight's plan point
    late_plan_misses: int = 0    # of those, launched after that step had already finished (GPU idle)
    admitted: int = 0            # requests admitted for the first time
    queue_s_sum: float = 0.0     # their time from submit to admission (joining a step), summed


class DecodeStrategy(ABC):
    """What a decoder gives the runtime. Admission hooks are called by the request table;
    step hooks by `EngineRuntime.step`, under the engine's lock except `_launch`."""

    # ---- requests ----------------------------------------------------------------------------
    @abstractmethod
    def submit(self, request_id: str, prompt: list[int], options: Any, steering: Any = None,
               committed: list[int] | None = None, next_step: int = 0, stream_steps: bool = True,
               records: bool = True) -> TrackedRequest:
        """Queue a request; `committed` and `next_step` resume one that stopped elsewhere;
        stream_steps=False drops the events only a live view of every step needs; records=False
        the concept records only attributions need."""

    @abstractmethod
    def warmup(self, max_rows: int = 4, max_new_tokens: int = 8) -> None:
        """Compile / capture the shapes traffic will use, before the worker serves."""

    # ---- admission and the table (RequestTable calls these) ----------------------------------
    @abstractmethod
    def _admission_refusal(self, req: TrackedRequest) -> str | None:
        """Why the request can never be admitted (it then finishes with an error), else None."""

    @abstractmethod
    def _pages_to_admit(self, req: TrackedRequest) -> int:
        """Free pages the request needs before it is admitted."""

    @abstractmethod
    def _admission_stamp(self) -> int:
        """`admitted_at` of a request admitted now (preemption picks the largest)."""

    def _on_admit(self, req: TrackedRequest) -> None:
        """The request just got a slot: set up its device-side state."""

    def _on_preempt(self, req: TrackedRequest) -> None:
        """The request is about to lose its slot and pages: keep what it needs back."""

    @abstractmethod
    def _finish_event(self, req: TrackedRequest, reason: str, error: str) -> FinishEvent:
        """The event a finishing request reports."""

    # ---- one step ------------------------------------------------------------------------------
    @abstractmethod
    def _plan(self) -> list:
        """The rows of the next step (may allocate pages and preempt)."""

    @abstractmethod
    def _rows_ahead(self, rows: list) -> list | None:
        """The next step's rows if it can be launched before `rows`' results are applied, else None
        (it may admit waiting requests into them)."""

    @abstractmethod
    def _launch(self, rows: list, overlapped: bool = False) -> LaunchedStep:
        """Build the step's inputs, run it on the device, start the copy of its results."""

    @abstractmethod
    def _apply_step(self, launched: LaunchedStep) -> None:
        """Apply a launched step's results to its requests (events, finishing)."""

    def _resolve_ahead(self, launched: LaunchedStep) -> None:
        """After the step before `launched` is applied: what its rows turned out to be (a no-op
        where the rows launched ahead already are the rows)."""


class EngineRuntime(DecodeStrategy):
    """The shared step loop. A subclass builds its KV cache, calls this `__init__`, builds its
    runner, then `_accelerate(compile, cuda_graphs)`."""

    def __init__(self, kv: KVCache, device: torch.device, *, max_slots: int, overlap: bool):
        self.kv = kv
        self.device = device
        self.table = RequestTable(kv.pool, max_slots, self)
        self.steps = self.forwards = self.compiles = 0
        self._lock = threading.Lock()
        # Overlap: in steady decoding the next step is launched before this one's results reach
        # the host, so the host's scheduling, input building and bookkeeping hide behind the GPU.
        self.overlap = overlap
        self._inflight: LaunchedStep | None = None
        self.overlapped_steps = 0
        self.late_plans = self.late_plan_misses = 0
        self.dropped_rows = 0      # rows of a launched step whose request ended before it was applied
        self._pinned = PinnedPairs()
        self._graphs: GraphCache | None = None

    def _accelerate(self, compile: bool, cuda_graphs: bool) -> None:
        """Regional compilation (the subclass's `_compile`), then CUDA graphs of the device step."""
        if compile:
            self._compile()
        if cuda_graphs:
            if self.device.type != "cuda":
                raise ValueError("cuda_graphs needs a CUDA device")
            self._graphs = GraphCache()

    def _compile(self) -> None:
        raise NotImplementedError(f"{type(self).__name__} has no compiled path")

    def _counting_backend(self, gm, example_inputs):
        """torch.compile backend: inductor, counting each compilation (tests fail on a recompile)."""
        self.compiles += 1
        from torch._inductor.compile_fx import compile_fx
        return compile_fx(gm, example_inputs)

    @property
    def cuda_graphs(self) -> bool:
        """Whether device steps replay CUDA graphs."""
        return self._graphs is not None

    # ---- the table, as callers see it -----------------------------------------------------------
    @property
    def requests(self) -> dict[str, TrackedRequest]:
        return self.table.requests

    @property
    def waiting(self):
        return self.table.waiting

    @property
    def running(self) -> list:
        return self.table.running

    @property
    def preemptions(self) -> int:
        return self.table.preemptions

    # ---- the loop ------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self) -> None:
        """Apply one step's results, launching it first unless it is already running. With
        overlap, in steady decoding the next step is launched before this one's results are
        read, so the host's bookkeeping and the device-to-host copy hide behind the GPU."""
        if self._inflight is None:
            with self._lock:
                self.table.finish_cancelled()
                self.table.admit()
                rows = self._plan()
            if not rows:
                return
            self._inflight = self._launch(rows)
        current, nxt = self._inflight, None
        if self.overlap:
            late = current.plan_point is not None
            if late:   # GIL released: requests arriving until then join the next step, not the one after
                current.plan_point.synchronize()
            with self._lock:   # submit/cancel (other threads) touch waiting/cancelled; launch unlocked
                ahead = self._rows_ahead(current.rows)
            if ahead is not None:
                nxt = self._launch(ahead, overlapped=True)
                self.overlapped_steps += 1
                if late:
                    self.late_plans += 1
                    if current.done is not None and current.done.query():
                        self.late_plan_misses += 1
        # Wait for the results before taking the lock: submit and cancel take it from the gRPC
        # event loop's thread, which must never wait for the GPU (waiting inside the lock froze
        # the worker's whole loop, every stream and Submit, for the rest of a step: ~40 ms of a
        # 60 ms step for a third of the requests arriving at C = 32, eb100ee's trace).
        current.wait()
        with self._lock:
            self._apply_step(current)
            self.steps += 1
            if nxt is not None:
                self._resolve_ahead(nxt)
            else:   # nothing in flight: a cancel frees its pages now, not a step later
                self.table.finish_cancelled()
        self._inflight = nxt

    def _queue(self, req: TrackedRequest) -> TrackedRequest:
        with self._lock:
            self.table.add(req)
        return req

    def cancel(self, request_id: str) -> bool:
        with self._lock:
            return self.table.cancel(request_id)

    def has_work(self) -> bool:
        return bool(self.table.waiting or self.table.running or self._inflight is not None)

    def stats(self) -> EngineStats:
        pool = self.kv.pool
        return EngineStats(pages_total=pool.usable, pages_used=pool.used, pages_free=pool.free,
                           running=len(self.table.running), waiting=len(self.table.waiting), steps=self.steps,
                           forwards=self.forwards, compiles=self.compiles, preemptions=self.table.preemptions,
                           graphs=self._graphs.captures if self._graphs is not None else 0,
                           overlapped_steps=self.overlapped_steps, late_plans=self.late_plans,
                           late_plan_misses=self.late_plan_misses, admitted=self.table.admitted,
                           queue_s_sum=self.table.queue_s_sum)

    def run_until_idle(self, max_steps: int = 1_000_000) -> None:
        for _ in range(max_steps):
            if not self.has_work():
                return
            self.step()
        raise RuntimeError("engine did not become idle")

    def drain(self, req: TrackedRequest) -> Iterator:
        while req.events:
            yield req.events.popleft()

    def _run_throwaway(self, jobs) -> None:
        """Warm-up: submit (request_id, prompt, options) jobs, run them to the end, forget them."""
        for request_id, prompt, options in jobs:
            self.submit(request_id, prompt, options)
        self.run_until_idle()
        for request_id, _, _ in jobs:
            self.table.requests.pop(request_id, None)

    @staticmethod
    def freeze_heap() -> None:
        """After warm-up: move every object alive now (model, graphs, compiled code, tables) out
        of the garbage collector's view. They live as long as the process, and a full
        collection that walks them all stalls the step loop for tens of milliseconds at a time."""
        gc.collect()
        gc.freeze()
