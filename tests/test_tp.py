"""Tensor parallel (cde/tp.py) on CPU processes over gloo: 2 and 4 ranks, each holding its shard
of a float64 model, equal the single-process model on every rank. Qwen3: logits to 1e-10 (only
the order of the all-reduce's sums differs), greedy AR and ISD (N = 3) from the reference decoders
and the paged ISD engine (strides 1-3, KV cache of the rank's heads) token for token. Steerling:
a steered reference generation (tokens, concept records) and the paged engine's blocks (tokens,
records; one request steered). Processes talk over loopback and end with the test (60 s
collective timeout)."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.multiprocessing as mp

from tests.tp_child import model_for, results, run

TOL = 1e-9


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a - b).abs().max().item() <= TOL * max(1.0, b.abs().max().item())


@pytest.mark.parametrize("family", ["qwen3", "steerling"])
@pytest.mark.parametrize("world", [2, 4])
def test_tensor_parallel_ranks_equal_the_single_process_model(family, world, seed, tmp_path):
    s = seed % 1000
    mp.spawn(run, args=(world, _free_port(), family, s, str(tmp_path)), nprocs=world, join=True)
    want = results(family, model_for(family, world, s), s)
    for rank in range(world):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        tag = f"seed={s} {family} world {world} rank {rank}"
        if family == "qwen3":
            assert _close(got["logits"], want["logits"]), tag
            assert got["ar"] == want["ar"] and got["isd"] == want["isd"], tag
            assert got["engine"] == want["engine"], f"{tag}: the paged ISD engine"
            continue
        assert got["ref_tokens"] == want["ref_tokens"], tag
        assert torch.equal(got["ref_known_idx"], want["ref_known_idx"]) and _close(got["ref_known"], want["ref_known"]), tag
        assert len(got["engine"]) == len(want["engine"]), tag
        for (t, p, k, tl), (wt, wp, wk, wtl) in zip(got["engine"], want["engine"]):
            assert t == wt and p == wp and _close(k, wk) and _close(tl, wtl), f"{tag}: the paged engine's blocks"


def test_a_shape_the_ranks_cannot_split_is_refused():
    from cde.qwen3.config import preset
    from cde.tp import check_shardable
    check_shardable(preset("tiny"), 2)
    with pytest.raises(ValueError, match="divisible by 4"):
        check_shardable(preset("tiny"), 4)   # 2 KV heads over 4 ranks
