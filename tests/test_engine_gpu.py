"""The engine's GPU path (CUDA graphs, bf16) on a tiny model: skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from cde.steerling.config import TINY
from cde.steerling.model import SteerlingModel
from cde.steerling.reference_decoder import DecodeOptions
from worker_svc.engine.steerling_engine import FinishEvent, SteerlingEngine

pytestmark = pytest.mark.gpu


def test_cuda_graph_engine_runs_and_frees_pages():
    model = SteerlingModel(TINY).init_random(3, std=0.05).to("cuda", torch.bfloat16).eval()
    model.rebuild_rope("cuda")
    engine = SteerlingEngine(model, tokenizer_vocab_size=264, n_pages=64, cuda_graphs=True)
    handles = [engine.submit(f"g{i}", list(range(10 + 50 * i)), DecodeOptions(80, seed=i)) for i in range(3)]
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
    jobs = [(list(range(1, 4 + 40 * i)), DecodeOptions(90, SamplingParams(), tokens_per_step=1 + i % 2, seed=i))
            for i in range(4)]
    handles = [engine.submit(f"p{i}", p, o) for i, (p, o) in enumerate(jobs)]
    engine.run_until_idle()
    assert engine.overlapped_steps > 0
    if compile_:
        from cde.steerling import kernels
        model.use_kernels(kernels.EAGER)
    for (prompt, opts), h in zip(jobs, handles):
        (fin,) = [e for e in engine.drain(h) if isinstance(e, FinishEvent)]
        assert fin.output_tokens == generate(model, prompt, opts, tokenizer_vocab_size=264).output_tokens
