"""cde/steerling/input_attribution.py against the public package's faithful input attribution
(`FaithfulOutputToInputAttributor.attribute_from_trace`, on the package's model with our weights)
for generations of our reference decoder (itself equal to the package's generate: 
tests/test_steerling_parity.py), fp32 on the CPU; and steered replays (which the package refuses)
against a brute-force one-target-at-a-time replay of the reference decoder's own steered forward."""

from __future__ import annotations

import random

import pytest
import torch

from cde.steerling.config import TINY
from cde.steerling.input_attribution import attribute, commit_groups, integrated_gradients, snapshot
from cde.steerling.model import SteeringInputs, SteerlingModel, dense_block_causal_attend
from cde.steerling.reference_decoder import generate
from cde.steerling.steering import SteeringSpec, prepare, resolve_alpha
from tests.options import decode_options
from tests.oracle import build_oracle

CFG = TINY
pytestmark = pytest.mark.parity


@pytest.fixture(scope="module")
def models():
    oracle = build_oracle(CFG, 20261205)
    ours = SteerlingModel(CFG).eval()
    ours.load_state_dict(oracle.state_dict(), strict=True)
    return oracle, ours


def package_attribution(oracle, prompt: list[int], seq_len: int, groups, n_steps: int):
    from steerling.attribution.input_attribution import FaithfulOutputToInputAttributor, OutputToInputAttributor
    from steerling.attribution.trace import CommitRecord, DiffusionTrace

    att = object.__new__(FaithfulOutputToInputAttributor)
    att.backbone, att.device = oracle, torch.device("cpu")
    att._primitive = OutputToInputAttributor.from_backbone(oracle, baseline="mask", mask_token_id=CFG.mask_id)
    records = [CommitRecord(g.order, g.order, torch.tensor(g.positions), torch.tensor(g.tokens),
                            torch.zeros(len(g.positions))) for g in groups]
    trace = DiffusionTrace(prompt_ids=torch.tensor(prompt), prompt_len=len(prompt), seq_length=seq_len,
                           mask_id=CFG.mask_id, eos_id=CFG.eos_id, device=torch.device("cpu"), groups=records)
    return att.attribute_from_trace(trace, n_steps=n_steps)


def _generation(ours, rng, prompt_len: int, new: int, per_step: int, steering=None):
    prompt = [rng.randrange(256) for _ in range(prompt_len)]
    res = generate(ours, prompt, decode_options(new, tokens_per_step=per_step, seed=rng.randrange(1 << 40)), steering)
    return prompt, len(prompt) + new, commit_groups(res.steps)


@pytest.mark.parametrize("prompt_len,new,per_step,n_steps", [(5, 8, 4, 32), (50, 24, 3, 1), (70, 9, 3, 4)])
def test_input_attribution_equals_the_packages_faithful_replay(models, seed, prompt_len, new, per_step, n_steps):
    oracle, ours = models
    rng = random.Random(seed)
    prompt, seq_len, groups = _generation(ours, rng, prompt_len, new, per_step)
    tag = f"seed={seed} prompt {prompt_len} new {new} per step {per_step} n_steps {n_steps}"
    assert groups and sum(len(g.positions) for g in groups) <= new, tag
    got = attribute(ours, prompt, seq_len, groups, n_steps)
    want = package_attribution(oracle, prompt, seq_len, groups, n_steps)
    assert got.positions == want.target_positions.tolist() and got.orders == want.target_orders.tolist(), tag
    scale = want.attributions.abs().max().item()
    err = (got.attributions - want.attributions).abs().max().item()
    assert scale > 0 and err <= 1e-4 * scale, f"{tag}: max error {err} of {scale}"
    # nothing in a block after the target's, and no masked position of its snapshot, can matter
    for n, (p, order) in enumerate(zip(got.positions, got.orders)):
        x = snapshot(prompt, seq_len, groups, order, CFG.mask_id)
        block_end = (p // CFG.diff_block_size + 1) * CFG.diff_block_size
        assert got.attributions[n, block_end:].abs().max().item() == 0.0 if block_end < seq_len else True, tag
        assert x[p] == CFG.mask_id, tag


def _brute_force(ours, prompt, seq_len, groups, n_steps, steering):
    """One target at a time, each step's forward exactly as the reference decoder runs it: the
    sequence up to the target's block end, steering built from it."""
    out = []
    committed = 0
    blk = CFG.diff_block_size
    for g in groups:
        x = torch.tensor(snapshot(prompt, seq_len, groups, g.order, CFG.mask_id))
        for p, t in zip(g.positions, g.tokens):
            end = min((p // blk + 1) * blk, seq_len)
            tokens = x[None, :end]
            pos = torch.arange(end)[None]
            alpha = resolve_alpha(steering.schedule, steering.base_alpha, committed, steering.cutoff_tokens)
            steer = SteeringInputs(steering.direction[None], torch.tensor([alpha]), (tokens == CFG.mask_id).float(),
                                   torch.tensor([steering.inject_layer]))
            emb = ours.transformer.tok_emb
            base = emb(torch.full((end,), CFG.mask_id))[None].detach()
            inp = emb(tokens).detach()
            acc = torch.zeros_like(inp)
            for k in range(n_steps):
                e = (base + (k + 1) / n_steps * (inp - base)).requires_grad_(True)
                h = ours.hidden_states(tokens, pos, dense_block_causal_attend(pos, blk), steer, embeds=e)
                logit = ours.transformer.lm_head(h)[0, p, t]
                acc += torch.autograd.grad(logit, e)[0]
            row = torch.zeros(seq_len)
            row[:end] = ((inp - base) * acc / n_steps).sum(-1)[0]
            out.append(row)
        committed += len(g.positions)
    return torch.stack(out)


def test_steered_replay_uses_the_injection_and_equals_a_brute_force_replay(models, seed):
    _, ours = models
    rng = random.Random(seed)
    spec = SteeringSpec.amplify([rng.randrange(CFG.n_known)], inject_layer=2, cutoff_tokens=6)
    steering = prepare(spec, ours.known_head.embeddings(torch.tensor(spec.concept_ids)),
                       ours.transformer.lm_head.weight, CFG.n_layers)
    prompt, seq_len, groups = _generation(ours, rng, 60, 8, 2, steering)   # across a block edge
    steered = attribute(ours, prompt, seq_len, groups, 4, steering)
    plain = attribute(ours, prompt, seq_len, groups, 4)
    want = _brute_force(ours, prompt, seq_len, groups, 4, steering)
    scale = want.abs().max().item()
    err = (steered.attributions - want).abs().max().item()
    assert err <= 1e-4 * scale, f"seed={seed}: steered replay off by {err} of {scale}"
    assert (steered.attributions - plain.attributions).abs().max().item() > 1e-3 * scale, \
        f"seed={seed}: steering changed no attribution"


def test_integrated_gradients_is_complete_at_many_steps(models, seed):
    """IG's completeness: the attributions sum to logit(input) - logit(MASK everywhere). The
    right Riemann sum's error is O(1/n) and some paths are curved enough for it to stay near 0.05
    at 96 steps, so the check is on the Richardson extrapolation 2 S(96) - S(48) (error O(1/n^2),
    about 1e-3 over many seeds) and on the sum converging (halving error) as n doubles."""
    _, ours = models
    rng = random.Random(seed)
    x = torch.tensor([[rng.randrange(256) for _ in range(20)] + [CFG.mask_id] * 4])
    p, t = 21, rng.randrange(256)
    coarse = integrated_gradients(ours, x, torch.tensor([p]), torch.tensor([t]), 48)[0].sum().item()
    fine = integrated_gradients(ours, x, torch.tensor([p]), torch.tensor([t]), 96)[0].sum().item()

    def logit(embeds):
        pos = torch.arange(x.shape[1])[None]
        h = ours.hidden_states(x, pos, dense_block_causal_attend(pos, CFG.diff_block_size), embeds=embeds)
        return ours.transformer.lm_head(h)[0, p, t].item()

    emb = ours.transformer.tok_emb
    with torch.no_grad():
        diff = logit(emb(x)) - logit(emb(torch.full_like(x, CFG.mask_id)))
    scale = max(1.0, abs(diff))
    assert abs(2 * fine - coarse - diff) <= 0.005 * scale, f"seed={seed}: 2 x {fine} - {coarse} vs {diff}"
    assert abs(fine - diff) <= 0.6 * abs(coarse - diff) + 1e-4 * scale, \
        f"seed={seed}: error {fine - diff} at 96 steps vs {coarse - diff} at 48: not converging"
