"""The bundled trained model models/idlm-small on the CPU, through the serving loader and engine.

On held-out prompts (the bundle's training.json: documents the training never saw):
greedy ISD at N = 4 equals greedy AR token for token (float64, so no near-tie can flip an
argmax between the two batch shapes), and the tokens per forward at N = 4, T = 0 stay above
TPF_FLOOR. The R-ISD adapter loads through the PEFT path and its greedy ISD equals the
*base* model's greedy AR. The bundle is at most 20 MB. Skipped, saying why, until the
trained bundle is committed (it is trained on a GPU: README "Causal models").
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from cde.isd.decoder import generate_ar_batch, generate_isd_batch
from cde.qwen3.loading import load_lora, load_qwen3
from tests.options import isd_options
from worker_svc.engine.isd_engine import IsdEngine, IsdFinishEvent
from worker_svc.engine.job import Job


# CDE_IDLM_SMALL_DIR: check a freshly trained bundle before it is committed
BUNDLE = Path(os.environ.get("CDE_IDLM_SMALL_DIR") or Path(__file__).resolve().parents[1] / "models" / "idlm-small")
PROMPTS = 4
NEW_TOKENS = 48
# Tokens per forward at N = 4, T = 0 on these 4 prompts x 48 tokens must stay above this. The
# committed bundle gives exactly 2.00 here (greedy, float64: deterministic) and 2.12 on the full
# held-out evaluation (bench/results/eval-idlm-small-h200-897db5b.json); an untrained or unmerged
# conversion gives about 1.0, a weaker one falls below 1.9.
TPF_FLOOR = 1.9

pytestmark = [pytest.mark.parity, pytest.mark.skipif(not (BUNDLE / "model.safetensors").is_file(),
                                reason="models/idlm-small is not committed yet (trained on the GPU machine: "
                                       "python -m train.train_idlm, see README 'Causal models')")]


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    training = json.loads((BUNDLE / "training.json").read_text())
    return [list(p) for p in training["prompts"][:PROMPTS]]


def test_bundle_size_and_files():
    files = [p for p in BUNDLE.rglob("*") if p.is_file()]
    total = sum(p.stat().st_size for p in files)
    assert total <= 20_000_000, f"bundle is {total} bytes"
    names = {p.relative_to(BUNDLE).as_posix() for p in files}
    assert {"config.json", "model.safetensors", "tokenizer.json", "conversion/adapter_model.safetensors",
            "risd/adapter_model.safetensors"} <= names, names


def test_greedy_isd_equals_greedy_ar_and_tpf_floor(prompts):
    model = load_qwen3(BUNDLE, dtype=torch.float64)   # what the worker loads: conversion merged
    engine = IsdEngine(model, max_slots=PROMPTS, max_stride=4)
    outs, stats = {}, {}
    for stride in (1, 4):
        reqs = [engine.submit(Job(f"{stride}-{i}", p, isd_options(max_new_tokens=NEW_TOKENS, stride=stride)))
                for i, p in enumerate(prompts)]
        engine.run_until_idle()
        fins = [[e for e in engine.drain(r) if isinstance(e, IsdFinishEvent)][0] for r in reqs]
        outs[stride] = [f.output_tokens for f in fins]
        stats[stride] = fins
    for i, (a, b) in enumerate(zip(outs[1], outs[4])):
        assert a == b, f"prompt {i}: greedy ISD N=4 differs from greedy AR\n AR  {a}\n ISD {b}"
    tpf = sum(f.stats.generated for f in stats[4]) / sum(f.stats.forwards for f in stats[4])
    assert tpf > TPF_FLOOR, f"tokens per forward at N=4, T=0: {tpf:.3f} (floor {TPF_FLOOR})"


def test_risd_greedy_equals_base_ar(prompts):
    base = load_qwen3(BUNDLE, dtype=torch.float64, merge_adapters=False)
    risd = load_lora(BUNDLE / "risd", load_qwen3(BUNDLE, dtype=torch.float64, merge_adapters=False))
    few = prompts[:2]
    ar = generate_ar_batch(base, few, 24)
    isd = generate_isd_batch(risd, few, 24, 4, lora_gated=True)
    for i, (a, b) in enumerate(zip(ar, isd)):
        assert a.tokens == b.tokens, f"prompt {i}: R-ISD greedy differs from base greedy AR"
    assert sum(g.stats.accepted for g in isd) > 0, "the R-ISD adapter accepted no draft at all"
