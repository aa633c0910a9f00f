"""steerling-small's training code on the CPU: the attention layout, the catalog copy the GPU
machine reads, and the whole pipeline at tiny sizes (stand-in data) writing a loadable bundle."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def test_noisy_clean_mask_is_what_serving_sees():
    from train.steerling_objective import noisy_clean_mask

    t, block = 256, 64
    m = noisy_clean_mask(t, block, "cpu")
    blk = torch.arange(t) // block
    for q in range(0, t, 37):
        for k in range(0, t, 29):
            # noisy query: its own block (bidirectional) + clean blocks strictly before
            assert bool(m[q, k]) == bool(blk[q] == blk[k]), (q, k)
            assert bool(m[q, t + k]) == bool(blk[k] < blk[q]), (q, k)
            # clean query: clean blocks up to its own, never the noisy half
            assert not bool(m[t + q, k]), (q, k)
            assert bool(m[t + q, t + k]) == bool(blk[k] <= blk[q]), (q, k)


def test_catalog_summary_equals_the_parquet():
    from train import build_data
    from train.steerling_data import catalog_summary_from_parquet, read_catalog_summary

    assert read_catalog_summary() == catalog_summary_from_parquet(build_data.CATALOG), \
        "train/artifacts/catalog_summary.json is stale: python -m train.steerling_data --write-catalog-summary"


@pytest.mark.slow
def test_tiny_training_run_writes_a_bundle_that_loads(tmp_path):
    from cde.steerling.loading import load_model

    out = tmp_path / "bundle"
    proc = subprocess.run([sys.executable, "-m", "train.train_steerling", "--out", str(out), "--device", "cpu",
                           "--tiny", "--time-budget-s", "25", "--reserve-s", "5", "--log-every-s", "5"],
                          cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "trained " in proc.stdout and "skipped=0" in proc.stdout, proc.stdout[-2000:]
    log = json.loads((out / "training_log.json").read_text())
    assert log["steps"] > 0 and log["skipped_steps"] == 0
    model = load_model(out)
    assert all(torch.isfinite(p).all() for p in model.parameters())
