"""The engine's GPU path (CUDA graphs, bf16) on a tiny model: skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from cde.steerling.config import TINY
from cde.steerling.model import SteerlingModel
from cde.steerling.reference_decoder import DecodeOptions
from worker_svc.engine.engine import Engine, FinishEvent

pytestmark = pytest.mark.gpu


def test_cuda_graph_engine_runs_and_frees_pages():
    model = SteerlingModel(TINY).init_random(3, std=0.05).to("cuda", torch.bfloat16).eval()
    model.rebuild_rope("cuda")
    engine = Engine(model, tokenizer_vocab_size=264, n_pages=64, cuda_graphs=True)
    handles = [engine.submit(f"g{i}", list(range(10 + 50 * i)), DecodeOptions(80, seed=i)) for i in range(3)]
    engine.run_until_idle()
    for h in handles:
        fin = [e for e in engine.drain(h) if isinstance(e, FinishEvent)]
        assert fin and fin[0].reason in ("stop", "length")
    assert engine.stats().pages_used == 0 and engine.stats().graphs >= 1
