"""The engine runtime both decoders run on, by composition: `EngineRuntime(strategy, table, kv)`
runs the step loop (overlapped steps, submit, cancel, stats, warm-up helpers) over a
`DecodeStrategy` (steerling_engine.SteerlingStrategy: block diffusion; isd_engine.IsdStrategy:
causal ISD), which plans a step (`StepPlan`), executes it (`LaunchedStep`) and applies its
results, and over the shared `RequestTable`, whose hooks the strategy implements.
"""

from __future__ import annotations

import gc
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass, fields
from typing import Generic, TypeVar

import torch
from torch import Tensor

from worker_svc.engine.events import FinishEvent
from worker_svc.engine.graphs import GraphCache
from worker_svc.engine.job import Job
from worker_svc.engine.kv_cache import KVCache
from worker_svc.engine.request_table import NO_PREFIX, PrefixQuery, RequestTable, TrackedRequest

RowT = TypeVar("RowT")        # a strategy's row type
LayoutT = TypeVar("LayoutT")  # its packed-results layout (layouts.BlockResultLayout | IsdResultLayout)
InputsT = TypeVar("InputsT")

ROW_BUCKETS = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 20, 24, 28, 32, 40, 48, 56, 64, 80, 96, 112, 128)


def bucket(n: int, buckets: tuple[int, ...]) -> int:
    for b in buckets:
        if n <= b:
            return b
    return n


def to_device(inputs: InputsT, device: torch.device) -> InputsT:
    """A dataclass of host numpy arrays -> the same dataclass of device tensors, field by name
    (non-blocking copies: the host buffers stay alive until the step's results are read)."""
    return type(inputs)(**{f.name: torch.from_numpy(getattr(inputs, f.name)).to(device, non_blocking=True)
                           for f in fields(inputs)})


@dataclass
class StepPlan(Generic[RowT]):
    """One step's rows, decided on the host (plain data: what vLLM calls SchedulerOutput).
    overlapped: planned before the step in flight's results were applied; its rows then carry
    what they expect that step to do, and `DecodeStrategy.resolve_ahead` settles them."""

    rows: list[RowT]
    overlapped: bool = False


@dataclass
class LaunchedStep(Generic[RowT, LayoutT]):
    """A step on its way: its plan, the layout of its packed results (it depends on the step's
    tokens or drafts per row) and those results, whose device-to-host copy is pending until
    `done`."""

    plan: StepPlan[RowT]
    layout: LayoutT
    host: Tensor
    done: torch.cuda.Event | None   # None on the CPU
    # per row, what the strategy promised at launch and checks when applying (Steerling: the
    # head-row bound of each row); None: nothing to check
    row_bounds: list[int] | None = None
    # an event the strategy recorded where the rest of the step outlasts the host's planning of
    # the next one (None: plan it as soon as this step is launched)
    plan_point: torch.cuda.Event | None = None

    @property
    def rows(self) -> list[RowT]:
        return self.plan.rows

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
    land in one while the step before it may still be read from the other (an overlapped step's
    copy must not overwrite the results of the step launched just before it, same shape, unread)."""

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
    prefix_cache_queries: int = 0   # known tokens of admitted requests (vLLM's name; 0 without a prefix cache)
    prefix_cache_hits: int = 0      # of those, with K/V reused from the prefix cache


class DecodeStrategy(ABC):
    """What a decoder gives the runtime: its requests (`new_request`), the table's hooks
    (`request_table.RequestHooks`) and one step as plan -> execute -> update. The runtime calls
    every method but `execute` under its lock. It also keeps what both decoders count and
    share: forwards, compilations and the CUDA-graph cache, and the pinned result buffers."""

    admission_takes_pages = True   # request_table.RequestHooks

    def __init__(self, device: torch.device):
        self.device = device
        self.forwards = 0       # device steps launched
        self.compiles = 0       # torch.compile compilations (tests fail on a recompile)
        self.applied_steps = 0  # steps whose results were applied
        self.dropped_rows = 0   # rows of a launched step whose request ended before it was applied
        self.graphs: GraphCache | None = None
        self.pinned = PinnedPairs()

    # ---- requests and the table's hooks ----------------------------------------------------------
    @abstractmethod
    def new_request(self, job: Job) -> TrackedRequest:
        """The job as this decoder's request, checked against what only this engine knows."""

    @abstractmethod
    def admission_refusal(self, req: TrackedRequest, idle: bool) -> str | None: ...

    @abstractmethod
    def pages_to_admit(self, req: TrackedRequest) -> int: ...

    def prefix_query(self, req: TrackedRequest) -> PrefixQuery:
        return NO_PREFIX   # a strategy without prefix caching: nothing reusable

    @abstractmethod
    def admission_stamp(self) -> int: ...

    def on_admit(self, req: TrackedRequest) -> None:
        pass

    def on_preempt(self, req: TrackedRequest) -> None:
        pass

    @abstractmethod
    def finish_event(self, req: TrackedRequest, reason: str, error: str) -> FinishEvent: ...

    # ---- one step ------------------------------------------------------------------------------
    @abstractmethod
    def plan(self, table: RequestTable) -> StepPlan | None:
        """The next step from the host's state (may allocate pages and preempt); None: no rows."""

    @abstractmethod
    def plan_ahead(self, table: RequestTable, inflight: StepPlan) -> StepPlan | None:
        """The step after `inflight` if it can be launched before inflight's results are applied,
        else None (it may admit waiting requests into it; it never preempts). Not called while a
        running request is cancelled: the chain of overlapped steps ends so the cancel is finished.
        Its rows keep their places through `resolve_ahead`: they index the step's results."""

    @abstractmethod
    def execute(self, plan: StepPlan) -> LaunchedStep:
        """Build the step's inputs, run it on the device, start the copy of its results."""

    @abstractmethod
    def update(self, table: RequestTable, step: LaunchedStep) -> None:
        """Apply a launched step's results to its requests (events, finishing)."""

    def resolve_ahead(self, plan: StepPlan) -> StepPlan:
        """After the step before `plan` is applied: what its rows turned out to be (the plan
        itself where the rows planned ahead already are the rows)."""
        return plan

    # ---- acceleration shared by both decoders ----------------------------------------------------
    def counting_backend(self, gm, example_inputs):
        """torch.compile backend: inductor, counting each compilation."""
        self.compiles += 1
        from torch._inductor.compile_fx import compile_fx
        return compile_fx(gm, example_inputs)

    def enable_graphs(self) -> None:
        """Device steps replay CUDA graphs from now on (`graphs`)."""
        if self.device.type != "cuda":
            raise ValueError("cuda_graphs needs a CUDA device")
        self.graphs = GraphCache()


class EngineRuntime:
    """The step loop over a strategy, its request table and its KV cache: overlapped steps,
    submit and cancel from other threads, stats, warm-up helpers."""

    def __init__(self, strategy: DecodeStrategy, table: RequestTable, kv: KVCache, *, overlap: bool):
        self.strategy = strategy
        self.table = table
        self.kv = kv
        self.steps = 0
        self._lock = threading.Lock()
        # Overlap: in steady decoding the next step is launched before this one's results reach
        # the host, so the host's scheduling, input building and bookkeeping hide behind the GPU.
        self.overlap = overlap
        self._inflight: LaunchedStep | None = None
        self.overlapped_steps = 0
        self.late_plans = self.late_plan_misses = 0

    @property
    def device(self) -> torch.device:
        return self.strategy.device

    @property
    def cuda_graphs(self) -> bool:
        """Whether device steps replay CUDA graphs."""
        return self.strategy.graphs is not None

    @property
    def inflight(self) -> LaunchedStep | None:
        """The launched step whose results are not applied yet (overlap), if any."""
        return self._inflight

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
        strategy, table = self.strategy, self.table
        if self._inflight is None:
            with self._lock:
                table.finish_cancelled()
                table.admit()
                plan = strategy.plan(table)
            if plan is None:
                return
            self._inflight = strategy.execute(plan)
        current, nxt = self._inflight, None
        if self.overlap:
            late = current.plan_point is not None
            if late:   # GIL released: requests arriving until then join the next step, not the one after
                current.plan_point.synchronize()
            with self._lock:   # submit/cancel (other threads) touch waiting/cancelled; launch unlocked
                # a cancel ends the chain of overlapped steps: it is finished (pages freed) below
                cancelled = any(r.cancel_requested for r in table.running)
                ahead = None if cancelled else strategy.plan_ahead(table, current.plan)
            if ahead is not None:
                nxt = strategy.execute(ahead)
                self.overlapped_steps += 1
                if late:
                    self.late_plans += 1
                    if current.done is not None and current.done.query():
                        self.late_plan_misses += 1
        # Wait for the results before taking the lock: submit and cancel take it from the gRPC
        # event loop's thread, which must never wait for the GPU (waiting inside the lock froze
        # the worker's whole loop, every stream and Submit, for the rest of a step).
        current.wait()
        with self._lock:
            strategy.update(table, current)
            strategy.applied_steps += 1
            self.steps += 1
            if nxt is not None:
                nxt.plan = strategy.resolve_ahead(nxt.plan)
            else:   # nothing in flight: a cancel frees its pages now, not a step later
                table.finish_cancelled()
        self._inflight = nxt

    def submit(self, job: Job) -> TrackedRequest:
        """Queue a job; its request (with the events it reports) comes back."""
        req = self.new_request(job)
        self.add(req)
        return req

    def new_request(self, job: Job) -> TrackedRequest:
        """The request of a job, checked, not queued yet (`add` queues it)."""
        return self.strategy.new_request(job)

    def add(self, req: TrackedRequest) -> None:
        with self._lock:
            self.table.add(req)

    def cancel(self, request_id: str) -> bool:
        with self._lock:
            return self.table.cancel(request_id)

    def has_work(self) -> bool:
        return bool(self.table.waiting or self.table.running or self._inflight is not None)

    def stats(self) -> EngineStats:
        pool, s = self.kv.pool, self.strategy
        return EngineStats(pages_total=pool.usable, pages_used=pool.used, pages_free=pool.free,
                           running=len(self.table.running), waiting=len(self.table.waiting), steps=self.steps,
                           forwards=s.forwards, compiles=s.compiles, preemptions=self.table.preemptions,
                           graphs=s.graphs.captures if s.graphs is not None else 0,
                           overlapped_steps=self.overlapped_steps, late_plans=self.late_plans,
                           late_plan_misses=self.late_plan_misses, admitted=self.table.admitted,
                           queue_s_sum=self.table.queue_s_sum,
                           prefix_cache_queries=self.table.prefix_cache_queries,
                           prefix_cache_hits=self.table.prefix_cache_hits)

    def run_until_idle(self, max_steps: int = 1_000_000) -> None:
        for _ in range(max_steps):
            if not self.has_work():
                return
            self.step()
        raise RuntimeError("engine did not become idle")

    def drain(self, req: TrackedRequest) -> Iterator:
        while req.events:
            yield req.events.popleft()

    def run_throwaway(self, jobs: list[Job]) -> None:
        """Warm-up: run the jobs to the end and forget them. The prefix cache is off meanwhile: the
        jobs' shapes (prefill rows included) must all run, and nothing of them stays cached."""
        pool = self.kv.pool
        cache, pool.cache = pool.cache, None
        try:
            for job in jobs:
                self.submit(job)
            self.run_until_idle()
        finally:
            pool.cache = cache
        for job in jobs:
            self.table.requests.pop(job.request_id, None)

    @staticmethod
    def freeze_heap() -> None:
        """After warm-up: move every object alive now (model, graphs, compiled code, tables) out
        of the garbage collector's view. They live as long as the process, and a full
        collection that walks them all stalls the step loop for tens of milliseconds at a time."""
        gc.collect()
        gc.freeze()
