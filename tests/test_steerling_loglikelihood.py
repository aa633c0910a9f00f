"""cde/steerling/loglikelihood.py against Guide Labs' lm-eval wrapper
(`steerling.evaluation.lm_harness_wrapper.SteerlingLM._compute_mc_loglikelihood`) on the oracle
model with our weights loaded: the same seed gives the same estimate, fp32 on the CPU."""

from __future__ import annotations

import random

import pytest
import torch

from cde.steerling.config import TINY
from cde.steerling.loglikelihood import mc_loglikelihood, mc_token_shares
from cde.steerling.model import SteerlingModel
from tests.oracle import build_oracle

CFG = TINY


@pytest.fixture(scope="module")
def models():
    seed = 20261204
    oracle = build_oracle(CFG, seed)
    ours = SteerlingModel(CFG).eval()
    ours.load_state_dict(oracle.state_dict(), strict=True)
    return oracle, ours


def package_lm(oracle, mc_num: int, mc_batch_size: int, cfg_scale: float):
    """The package's SteerlingLM around the oracle, without its from_pretrained loading."""
    from steerling.evaluation.lm_harness_wrapper import SteerlingLM

    lm = object.__new__(SteerlingLM)
    lm.model, lm.is_interpretable, lm.mask_token_id = oracle, True, CFG.mask_id
    lm.mc_num, lm.mc_batch_size, lm.cfg = mc_num, mc_batch_size, cfg_scale
    lm._torch_device = torch.device("cpu")
    return lm


@pytest.mark.parity
@pytest.mark.parametrize("mc_num,mc_batch_size,cfg_scale", [(1, 32, 0.0), (40, 16, 0.0), (24, 8, 0.5)])
def test_mc_loglikelihood_equals_the_packages_lm_eval_wrapper(models, seed, mc_num, mc_batch_size, cfg_scale):
    oracle, ours = models
    rng = random.Random(seed)
    block = CFG.diff_block_size
    # contexts and continuations inside one block and across block edges
    for ctx_len, cont_len in [(5, 3), (block - 4, 10), (block + 7, block + 3), (0, 12)]:
        ctx = [rng.randrange(256) for _ in range(ctx_len)]
        cont = [rng.randrange(256) for _ in range(cont_len)]
        draw = rng.randrange(1 << 30)
        torch.manual_seed(draw)
        want, _ = package_lm(oracle, mc_num, mc_batch_size, cfg_scale)._compute_mc_loglikelihood(ctx, cont)
        got = mc_loglikelihood(ours, ctx, cont, mc_num=mc_num, mc_batch_size=mc_batch_size,
                               generator=torch.Generator().manual_seed(draw), cfg_scale=cfg_scale)
        tag = f"seed={seed} draw={draw} context {ctx_len} continuation {cont_len}"
        assert abs(got - want) <= 1e-4 * max(1.0, abs(want)), f"{tag}: ours {got} vs package {want}"
        if mc_num > 1 or cont_len > 1:
            # the draw matters; one other draw can mask the same few positions, so eight are tried
            others = {mc_loglikelihood(ours, ctx, cont, mc_num=mc_num, mc_batch_size=mc_batch_size,
                                       generator=torch.Generator().manual_seed(draw + k), cfg_scale=cfg_scale)
                      for k in range(1, 9)}
            assert others != {got}, f"{tag}: eight other draws all gave the same estimate"


def test_mc_loglikelihood_edge_cases(models):
    _, ours = models
    assert mc_loglikelihood(ours, [1, 2], []) == 0.0
    with pytest.raises(ValueError, match="mc_num"):
        mc_loglikelihood(ours, [1], [2], mc_num=0)
    # more samples, closer to the truth: the estimate's spread falls
    g = torch.Generator().manual_seed(7)
    few = [mc_loglikelihood(ours, [5, 6, 7], [8, 9, 10, 11], mc_num=2, generator=g) for _ in range(12)]
    many = [mc_loglikelihood(ours, [5, 6, 7], [8, 9, 10, 11], mc_num=64, generator=g) for _ in range(12)]
    assert torch.tensor(many).std() < torch.tensor(few).std(), (few, many)


@pytest.mark.parity
def test_token_shares_add_up_to_the_estimate(models, seed):
    """What echo serves per token (`mc_token_shares`) sums to `mc_loglikelihood` from the same
    draws, and every share is minus a sum of non-negative terms."""
    _, ours = models
    rng = random.Random(seed)
    for ctx_len, cont_len in [(3, 1), (9, 30), (70, 20)]:
        ctx = [rng.randrange(256) for _ in range(ctx_len)]
        cont = [rng.randrange(256) for _ in range(cont_len)]
        draw = rng.randrange(1 << 30)
        want = mc_loglikelihood(ours, ctx, cont, mc_num=40, mc_batch_size=16,
                                generator=torch.Generator().manual_seed(draw))
        shares = mc_token_shares(ours, ctx, cont, mc_num=40, mc_batch_size=16,
                                 generator=torch.Generator().manual_seed(draw))
        tag = f"seed={seed} draw={draw} context {ctx_len} continuation {cont_len}"
        assert len(shares) == cont_len and all(s <= 0 for s in shares), tag
        assert abs(sum(shares) - want) <= 1e-5 * max(1.0, abs(want)), f"{tag}: {sum(shares)} vs {want}"
