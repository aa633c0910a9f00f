"""EngineRuntime driven by a strategy written here: a counting decoder whose token i of a request
is a function of (prompt, i), so every output is known in advance, over the real RequestTable and
PagePool. It checks what the runtime itself owns, whatever the decoder: every request gets exactly
its tokens in order with and without overlapped steps (a step applied twice, skipped or out of
order shows up as a wrong token), steps planned ahead are settled when their requests end,
preemption under a small pool, cancellation frees pages, and admission refusals finish with an
error. Seeds are in every failure message."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
import torch

from tests.options import decode_options
from worker_svc.engine.events import FinishEvent
from worker_svc.engine.job import Job
from worker_svc.engine.kv_cache import KVCache
from worker_svc.engine.request_table import RequestTable, TrackedRequest
from worker_svc.engine.runtime import DecodeStrategy, EngineRuntime, LaunchedStep, StepPlan

TOKENS_PER_PAGE = 4
MAX_TOKENS = 40   # a request longer than this can never fit: refused at admission


def expected_token(prompt: list[int], i: int) -> int:
    return (sum(prompt) * 31 + i * 7) % 997


def is_stop(prompt: list[int], i: int) -> bool:
    """Token i is a stop token the planner cannot foresee (rows planned ahead of it are dropped):
    about one token in 25, fixed by (prompt, i)."""
    return i >= 2 and random.Random(sum(prompt) * 1000 + i).random() < 0.04


def expected_output(prompt: list[int], max_new: int) -> tuple[list[int], str]:
    out = []
    for i in range(max_new):
        out.append(expected_token(prompt, i))
        if is_stop(prompt, i):
            return out, "stop"
    return out, "length"


@dataclass
class TokenEvent:
    request_id: str
    index: int
    token: int


@dataclass(eq=False, kw_only=True)
class CountingRequest(TrackedRequest):
    max_new: int
    output: list[int] = field(default_factory=list)
    steps: int = 0

    def forget_kv(self) -> None:
        pass   # the fake keeps nothing on a device


@dataclass(frozen=True)
class Row:
    req: CountingRequest
    index: int          # the output index this row produces
    live: bool = True   # False: planned ahead for a request that ended meanwhile (its result is dropped)


class CountingStrategy(DecodeStrategy):
    def __init__(self):
        super().__init__(torch.device("cpu"))
        self.stamp = 0
        self.rows_planned = 0

    def new_request(self, job: Job) -> CountingRequest:
        return CountingRequest(request_id=job.request_id, prompt=job.prompt, max_new=job.options.max_new_tokens)

    def admission_refusal(self, req, idle):
        return "too long" if len(req.prompt) + req.max_new > MAX_TOKENS else None

    def pages_to_admit(self, req) -> int:
        return self._pages_for(req, len(req.output) + 1)

    def admission_stamp(self) -> int:
        self.stamp += 1
        return self.stamp

    def finish_event(self, req, reason, error) -> FinishEvent:
        return FinishEvent(req.request_id, reason, list(req.output), len(req.prompt), len(req.output), req.steps,
                           error)

    @staticmethod
    def _pages_for(req, n_out: int) -> int:
        return -(-(len(req.prompt) + n_out) // TOKENS_PER_PAGE)

    def plan(self, table: RequestTable):
        rows = []
        for req in list(table.running):
            if req.running and table.ensure_pages(req, self._pages_for(req, len(req.output) + 1),
                                                  may_preempt_itself=True):
                rows.append(Row(req, len(req.output)))
        rows = [r for r in rows if r.req.running]   # a later row's pages may have preempted an earlier one
        return StepPlan(rows) if rows else None

    def plan_ahead(self, table, inflight: StepPlan):
        # rows that will still be running after the step in flight, if their pages are there already
        rows = [Row(r.req, r.index + 1) for r in inflight.rows if r.req.running and r.index + 1 < r.req.max_new]
        need = sum(max(0, self._pages_for(r.req, r.index + 2) - len(r.req.pages)) for r in rows)
        if not rows or need > table.pool.free:   # ahead of the results, never preempt
            return None
        for r in rows:
            table.ensure_pages(r.req, self._pages_for(r.req, r.index + 2), may_preempt_itself=False)
        return StepPlan(rows, overlapped=True)

    def execute(self, plan: StepPlan) -> LaunchedStep:
        self.forwards += 1
        self.rows_planned += len(plan.rows)
        host = torch.tensor([expected_token(r.req.prompt, r.index) for r in plan.rows], dtype=torch.long)
        return LaunchedStep(plan, None, host, None)

    def update(self, table, step: LaunchedStep) -> None:
        for row, token in zip(step.rows, step.results().tolist()):
            req = row.req
            if not row.live:
                self.dropped_rows += 1
                continue
            # the runtime settles a step planned ahead (resolve_ahead) before applying it
            assert req.running and row.index == len(req.output), (req.request_id, req.status, row.index,
                                                                  len(req.output))
            req.output.append(token)
            req.steps += 1
            req.events.append(TokenEvent(req.request_id, row.index, token))
            if is_stop(req.prompt, row.index):
                table.finish(req, "stop")
            elif len(req.output) == req.max_new:
                table.finish(req, "length")

    def resolve_ahead(self, plan: StepPlan) -> StepPlan:
        # rows keep their places: they index the launched step's results
        return StepPlan([Row(r.req, r.index, r.req.running and r.index == len(r.req.output)) for r in plan.rows],
                        overlapped=True)


def runtime(n_pages: int, max_slots: int, overlap: bool) -> EngineRuntime:
    strategy = CountingStrategy()
    kv = KVCache(1, n_pages, 1, TOKENS_PER_PAGE, 1, torch.float32, "cpu")
    return EngineRuntime(strategy, RequestTable(kv.pool, max_slots, strategy), kv, overlap=overlap)


def jobs(seed: int, n: int) -> list[Job]:
    rng = random.Random(seed)
    return [Job(f"r{i}", [rng.randrange(100) for _ in range(rng.randint(1, 9))],
                decode_options(rng.randint(1, MAX_TOKENS - 10))) for i in range(n)]


def events_of(rt: EngineRuntime, reqs) -> dict[str, list]:
    return {r.request_id: list(rt.drain(r)) for r in reqs}


def check_outputs(seed, js, got: dict[str, list], tag: str) -> None:
    for job in js:
        evs = got[job.request_id]
        want, reason = expected_output(job.prompt, job.options.max_new_tokens)
        tokens = [e for e in evs if isinstance(e, TokenEvent)]
        assert [e.index for e in tokens] == list(range(len(want))), f"seed={seed} {tag} {job.request_id}"
        assert [e.token for e in tokens] == want, f"seed={seed} {tag} {job.request_id}"
        fin = evs[-1]
        assert isinstance(fin, FinishEvent) and fin.reason == reason and fin.output_tokens == want, \
            f"seed={seed} {tag} {job.request_id}: {fin}"


@pytest.mark.parametrize("overlap", [False, True])
def test_every_request_gets_its_tokens_in_order_with_and_without_overlap(overlap, seed):
    js = jobs(seed, 12)
    rt = runtime(n_pages=256, max_slots=5, overlap=overlap)
    reqs = [rt.submit(j) for j in js]
    rt.run_until_idle()
    check_outputs(seed, js, events_of(rt, reqs), f"overlap={overlap}")
    stats = rt.stats()
    assert stats.pages_used == 0 and stats.running == stats.waiting == 0 and not rt.requests, f"seed={seed}"
    assert stats.admitted == len(js) and stats.preemptions == 0, f"seed={seed}: {stats}"
    assert rt.steps == stats.forwards, f"seed={seed}: every launched step is applied once"
    if overlap:
        assert stats.overlapped_steps > 0, f"seed={seed}: {stats}"
        # with pages to spare every step is planned ahead: one row is planned past each early stop
        early = [j for j in js if len(expected_output(j.prompt, j.options.max_new_tokens)[0]) < j.options.max_new_tokens]
        assert rt.strategy.dropped_rows == len(early), f"seed={seed}: rows planned past a stop are dropped"
    else:
        assert stats.overlapped_steps == 0 and rt.strategy.dropped_rows == 0, f"seed={seed}"


@pytest.mark.parametrize("overlap", [False, True])
def test_a_small_pool_preempts_and_every_request_still_finishes_exactly(overlap, seed):
    js = jobs(seed, 10)
    rt = runtime(n_pages=14, max_slots=6, overlap=overlap)   # 13 usable pages, requests need up to 10
    reqs = [rt.submit(j) for j in js]
    rt.run_until_idle()
    check_outputs(seed, js, events_of(rt, reqs), f"overlap={overlap}")
    stats = rt.stats()
    assert stats.preemptions > 0 and stats.pages_used == 0, f"seed={seed}: {stats}"


@pytest.mark.parametrize("overlap", [False, True])
def test_a_cancel_mid_decode_finishes_it_frees_its_pages_and_leaves_the_others_exact(overlap, seed):
    never_stop = [p for p in range(1000) if expected_output([p], 30)[1] == "length"]
    js = [Job(f"r{i}", [p], decode_options(30)) for i, p in enumerate(random.Random(seed).sample(never_stop, 4))]
    rt = runtime(n_pages=256, max_slots=8, overlap=overlap)
    reqs = [rt.submit(j) for j in js]
    for _ in range(5):
        rt.step()
    assert rt.cancel("r1") and not rt.cancel("nope"), f"seed={seed}"
    assert reqs[1].pages, f"seed={seed}"
    rt.step()
    rt.step()
    held = sum(len(r.pages) for r in rt.running)
    assert "r1" not in rt.requests and not reqs[1].pages and rt.stats().pages_used == held, f"seed={seed}"
    rt.run_until_idle()
    got = events_of(rt, reqs)
    check_outputs(seed, [j for j in js if j.request_id != "r1"], got, f"overlap={overlap}")
    cancelled = got["r1"]
    fin = cancelled[-1]
    assert isinstance(fin, FinishEvent) and fin.reason == "cancelled", f"seed={seed}: {fin}"
    toks = [e.token for e in cancelled if isinstance(e, TokenEvent)]
    assert 5 <= len(toks) < 30 and toks == [expected_token(js[1].prompt, i) for i in range(len(toks))], f"seed={seed}"
    assert rt.stats().pages_used == 0, f"seed={seed}"


def test_a_request_that_can_never_fit_finishes_with_an_error_and_others_run():
    rt = runtime(n_pages=64, max_slots=2, overlap=True)
    bad = rt.submit(Job("big", [1] * 20, decode_options(MAX_TOKENS)))
    good = rt.submit(Job("ok", [1, 2], decode_options(3)))
    rt.run_until_idle()
    fin = list(rt.drain(bad))[-1]
    assert fin.reason == "error" and fin.error == "too long" and fin.output_tokens == []
    assert [e.token for e in rt.drain(good) if isinstance(e, TokenEvent)] == [expected_token([1, 2], i)
                                                                            for i in range(3)]
    with pytest.raises(ValueError, match="duplicate"):
        rt.submit(Job("ok2", [1], decode_options(1)))
        rt.submit(Job("ok2", [1], decode_options(1)))
