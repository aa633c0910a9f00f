"""The engine's GPU path (CUDA graphs, bf16) on a tiny model: skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from cde.steerling.config import TINY
from cde.steerling.model import SteerlingModel
from tests.options import decode_options
from worker_svc.engine.job import Job
from worker_svc.engine.steerling_engine import FinishEvent, SteerlingEngine

pytestmark = pytest.mark.gpu


def test_cuda_graph_engine_runs_and_frees_pages():
    model = SteerlingModel(TINY).init_random(3, std=0.05).to("cuda", torch.bfloat16).eval()
    model.rebuild_rope("cuda")
    engine = SteerlingEngine(model, tokenizer_vocab_size=264, n_pages=64, cuda_graphs=True)
    handles = [engine.submit(Job(f"g{i}", list(range(10 + 50 * i)), decode_options(80, seed=i))) for i in range(3)]
    engine.run_until_idle()
    for h in handles:
        fin = [e for e in engine.drain(h) if isinstance(e, FinishEvent)]
        assert fin and fin[0].reason in ("stop", "length")
    assert engine.stats().pages_used == 0 and engine.stats().graphs >= 1


@pytest.mark.parity
@pytest.mark.parametrize("compile_", [False, True])
def test_cuda_graphs_overlap_and_compile_equal_the_reference_in_float64(compile_):
    """The whole GPU path (regional compile, CUDA graphs per bucket, overlapped steps from the
    device block-token table) against the full-recompute reference decoder, in float64 so
    the two cannot differ by summation order: token for token."""
    from cde.steerling.reference_decoder import generate
    from cde.steerling.sampling import SamplingParams

    model = SteerlingModel(TINY.replace(n_layers=2)).init_random(11, std=0.05).to("cuda", torch.float64).eval()
    model.rebuild_rope("cuda")
    engine = SteerlingEngine(model, tokenizer_vocab_size=264, n_pages=64, cuda_graphs=True, compile=compile_)
    jobs = [(list(range(1, 4 + 40 * i)), decode_options(90, sampling=SamplingParams(), tokens_per_step=1 + i % 2,
                                                        seed=i))
            for i in range(4)]
    handles = [engine.submit(Job(f"p{i}", p, o)) for i, (p, o) in enumerate(jobs)]
    engine.run_until_idle()
    assert engine.overlapped_steps > 0
    if compile_:
        from cde.steerling import kernels
        model.use_kernels(kernels.EAGER)
    for (prompt, opts), h in zip(jobs, handles):
        (fin,) = [e for e in engine.drain(h) if isinstance(e, FinishEvent)]
        assert fin.output_tokens == generate(model, prompt, opts, tokenizer_vocab_size=264).output_tokens


@pytest.mark.parity
def test_after_warmup_staggered_traffic_captures_nothing_and_equals_the_reference():
    """The warm-up captures every (trunk, heads) graph up to capture_rows rows; requests that
    start at different steps (new row, head-row and tokens-per-step buckets at every turn)
    then replay only those graphs, run eagerly above capture_rows, and still decode exactly."""
    from cde.steerling.reference_decoder import generate
    from cde.steerling.sampling import SamplingParams

    model = SteerlingModel(TINY.replace(n_layers=2)).init_random(13, std=0.05).to("cuda", torch.float64).eval()
    model.rebuild_rope("cuda")
    engine = SteerlingEngine(model, tokenizer_vocab_size=264, n_pages=96, cuda_graphs=True, capture_rows=6)
    engine.warmup(max_rows=2, max_new_tokens=8)
    captured = engine.stats().graphs
    assert captured >= len(engine.strategy.capture_plan())
    jobs = [(list(range(1, 5 + 37 * i)), decode_options(70 + 9 * i, sampling=SamplingParams(),
                                                        tokens_per_step=(1, 2, 4)[i % 3], seed=i)) for i in range(7)]
    handles = []
    for i, (p, o) in enumerate(jobs):
        handles.append(engine.submit(Job(f"s{i}", p, o)))
        for _ in range(3 + i):
            engine.step()
    engine.run_until_idle()
    assert engine.stats().graphs == captured, "a graph was captured while serving"
    assert engine.strategy.eager_steps > 0   # 7 requests plus their prompt rows go past capture_rows
    for (prompt, opts), h in zip(jobs, handles):
        (fin,) = [e for e in engine.drain(h) if isinstance(e, FinishEvent)]
        assert fin.output_tokens == generate(model, prompt, opts, tokenizer_vocab_size=264).output_tokens


@pytest.mark.parity
@pytest.mark.parametrize("capture_rows", [48, 2])
def test_a_request_arriving_before_the_plan_point_joins_the_next_step_and_output_is_exact(capture_rows):
    """Plan points (the next step planned once the step in flight's trunk is done) on every step
    with heads, from CUDA graphs and eagerly (capture_rows=2: most steps are larger): a request
    submitted while the step loop waits at a plan point is admitted into the very next step, and
    every request still equals the reference decoder token for token (float64)."""
    from cde.steerling.reference_decoder import generate
    from cde.steerling.sampling import SamplingParams

    model = SteerlingModel(TINY.replace(n_layers=2)).init_random(17, std=0.05).to("cuda", torch.float64).eval()
    model.rebuild_rope("cuda")
    engine = SteerlingEngine(model, tokenizer_vocab_size=264, n_pages=96, cuda_graphs=True, capture_rows=capture_rows,
                             plan_late_head_rows=1)
    jobs = [(list(range(1, 6 + 31 * i)), decode_options(80 + 7 * i, sampling=SamplingParams(),
                                                        tokens_per_step=1 + i % 2, seed=i))
            for i in range(4)]
    handles = {"j0": engine.submit(Job("j0", *jobs[0]))}
    arrivals = [(f"j{i}", jobs[i]) for i in range(1, 4)]
    joined_next = []
    execute = engine.strategy.device_step

    class SubmitsWhileWaiting:
        """The plan point, submitting the next arrival when the step loop starts waiting on it."""
        def __init__(self, event):
            self.event, self.pending = event, None

        def synchronize(self):
            if arrivals and engine.steps % 5 == 2:
                rid, (prompt, opts) = arrivals.pop(0)
                handles[rid] = engine.submit(Job(rid, prompt, opts))
                self.pending = rid
                waited.append(self)
            self.event.synchronize()

    def with_arrivals(*a):
        out, point = execute(*a)
        return out, (SubmitsWhileWaiting(point) if point is not None else None)

    engine.strategy.device_step = with_arrivals
    waited = []
    before = engine.stats().late_plans
    for _ in range(2000):
        if not (engine.has_work() or arrivals):
            break
        engine.step()
        while waited:   # the step launched at that plan point (now in flight) has the arrival's rows
            rid = waited.pop().pending
            joined_next.append(any(row.req.request_id == rid for row in engine.inflight.rows))
    assert joined_next == [True] * 3, joined_next
    assert engine.stats().late_plans > before
    for rid, (prompt, opts) in zip(sorted(handles), jobs):
        (fin,) = [e for e in engine.drain(handles[rid]) if isinstance(e, FinishEvent)]
        assert fin.output_tokens == generate(model, prompt, opts, tokenizer_vocab_size=264).output_tokens, rid


@pytest.mark.parity
def test_logprobs_under_cuda_graphs_equal_the_reference_in_float64():
    """The sampler's logsumexp + top-k columns ride the captured graphs: asked rows beside rows
    that did not ask, against the reference decoder's log-softmax at each committing step (both float32: 1e-5)."""
    from cde.steerling.reference_decoder import generate
    from cde.steerling.sampling import SamplingParams
    from worker_svc.engine.events import BlockEvent

    model = SteerlingModel(TINY.replace(n_layers=2)).init_random(12, std=0.05).to("cuda", torch.float64).eval()
    model.rebuild_rope("cuda")
    engine = SteerlingEngine(model, tokenizer_vocab_size=264, n_pages=64, cuda_graphs=True)
    asks = [3, None, 0, 5]
    jobs = [(list(range(2, 6 + 30 * i)), decode_options(70, sampling=SamplingParams(), tokens_per_step=1 + i % 2, seed=i))
            for i in range(4)]
    handles = [engine.submit(Job(f"l{i}", p, o, logprobs=k)) for i, ((p, o), k) in enumerate(zip(jobs, asks))]
    engine.run_until_idle()
    checked = 0
    for (prompt, opts), k, h in zip(jobs, asks, handles):
        ref = generate(model, prompt, opts, tokenizer_vocab_size=264)
        blocks = [e for e in engine.drain(h) if isinstance(e, BlockEvent)]
        assert [b.tokens for b in blocks] == [b.tokens for b in ref.blocks], f"asked {k}"
        for b in blocks:
            if k is None:
                assert b.logprobs is None
                continue
            for p, lp in zip(range(b.start, b.end), b.logprobs):
                if p not in ref.logprobs:
                    assert lp is None
                    continue
                want, want_ids, want_lps = ref.logprobs[p]
                assert abs(lp.logprob - want) <= 1e-5 * max(1.0, abs(want)), f"asked {k} position {p}"
                assert lp.top_ids == want_ids[:k], f"asked {k} position {p}"
                checked += 1
    assert checked > 50, checked


@pytest.mark.parity
def test_grammar_requests_under_cuda_graphs_equal_the_reference_under_the_same_grammar():
    """Structured output on the served GPU path: grammar requests (regex, JSON schema; left to
    right, one token a step, no overlapped steps while they run) beside unconstrained ones, with
    CUDA graphs, in float64: each equals the reference decoder under the same grammar (the
    unconstrained ones too) and a finished grammar request matches its format."""
    import json
    import re

    from cde.grammar import GrammarVocabulary, compile_response_format
    from cde.steerling.reference_decoder import generate
    from cde.steerling.sampling import SamplingParams
    from cde.steerling.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    vocab = GrammarVocabulary.of_steerling(tok, TINY.vocab_size, TINY.eot_id)
    formats = [None, {"type": "regex", "regex": r"(yes|no|maybe)-[0-9]{3}"},
               {"type": "json_schema", "json_schema": {"name": "s", "schema": {
                   "type": "object", "properties": {"k": {"type": "string", "maxLength": 4}, "b": {"type": "boolean"}},
                   "required": ["k", "b"], "additionalProperties": False}}}, None]
    model = SteerlingModel(TINY.replace(n_layers=2)).init_random(17, std=0.05).to("cuda", torch.float64).eval()
    model.rebuild_rope("cuda")
    engine = SteerlingEngine(model, tokenizer_vocab_size=264, n_pages=64, cuda_graphs=True)
    cases = []
    for i, fmt in enumerate(formats):
        grammar = None if fmt is None else compile_response_format(fmt)
        opts = decode_options(70, sampling=SamplingParams(), tokens_per_step=1 + i % 2, seed=100 + i)
        prompt = list(range(2, 6 + 30 * i))
        cases.append((fmt, grammar, prompt, opts, engine.submit(
            Job(f"g{i}", prompt, opts, constraint=None if grammar is None else vocab.constraint(grammar)))))
    engine.run_until_idle()
    assert engine.stats().graphs > 0
    for i, (fmt, grammar, prompt, opts, h) in enumerate(cases):
        (fin,) = [e for e in engine.drain(h) if isinstance(e, FinishEvent)]
        ref = generate(model, prompt, opts, tokenizer_vocab_size=264,
                       constraint=None if grammar is None else vocab.constraint(grammar))
        assert fin.output_tokens == ref.output_tokens, f"request {i} format {fmt}"
        if fmt is not None and fin.reason == "stop":
            text = tok.decode(fin.output_tokens)
            assert (re.fullmatch(fmt["regex"], text) if fmt["type"] == "regex" else json.loads(text)), text
