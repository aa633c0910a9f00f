"""The log-likelihood of a continuation under a block-diffusion model, as lm-eval's
`loglikelihood` asks for it.

A masked-diffusion model has no left-to-right factorisation to read a log-probability from;
Guide Labs' lm-eval wrapper (`steerling.evaluation.lm_harness_wrapper.SteerlingLM`) defines it
as a Monte Carlo estimate of the ELBO, and this module computes that estimate the same way, draw
for draw, so a score from this server equals the package's for the same seed:

* ``mc_num`` noisy copies of ``context + continuation`` in batches of ``mc_batch_size``; per
  batch one ``k`` in 1..L (L = continuation length) drawn, row i masks
  ``x_i = ((round(k + i * L / bsz) - 1) mod L) + 1`` continuation positions chosen by a random
  permutation (a stratified sweep of mask rates x_i / L over the batch);
* one dense block-causal forward per batch; at every masked position the cross-entropy of the
  true token divided by that row's mask rate, summed and divided by the batch size;
* the estimate is minus the mean of those batch losses (batches with no masked position skipped).

The draws come from ``generator`` in the order the package makes them from torch's global
generator (randint, then one randperm per row), so a generator seeded with s reproduces the
package run after ``torch.manual_seed(s)``. ``cfg_scale`` > 0 is the package's classifier-free
guidance (the context masked in the unconditional copy).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from cde.steerling.model import SteerlingModel

DEFAULT_MC_NUM = 128        # the package's defaults
DEFAULT_MC_BATCH_SIZE = 32


def masked_copies(seq: Tensor, prompt_len: int, bsz: int, mask_id: int,
                  generator: torch.Generator | None) -> tuple[Tensor, Tensor]:
    """``bsz`` noisy copies of ``seq`` (continuation positions masked at stratified rates) and each
    position's mask rate (B, T), clamped at 1e-6."""
    cont_len = seq.shape[0] - prompt_len
    batch = seq.unsqueeze(0).expand(bsz, -1).clone()
    k = torch.randint(1, cont_len + 1, (), generator=generator, device=seq.device)
    x = torch.round(torch.linspace(float(k), k + (bsz - 1) * (cont_len / bsz), steps=bsz, device=seq.device)).long()
    x = ((x - 1) % cont_len) + 1
    is_mask = torch.arange(cont_len, device=seq.device).repeat(bsz, 1) < x.unsqueeze(1)
    for i in range(bsz):
        is_mask[i] = is_mask[i][torch.randperm(cont_len, generator=generator, device=seq.device)]
    batch[:, prompt_len:] = torch.where(is_mask, torch.as_tensor(mask_id, device=seq.device), batch[:, prompt_len:])
    rate = (x.float() / cont_len).unsqueeze(1).repeat(1, seq.shape[0])
    return batch, rate.clamp_min(1e-6)


def _logits(model: SteerlingModel, tokens: Tensor, prompt_len: int, cfg_scale: float) -> Tensor:
    b, t = tokens.shape
    if cfg_scale <= 0:
        return model(tokens).logits.reshape(b, t, -1)
    uncond = tokens.clone()
    uncond[:, :prompt_len] = model.cfg.mask_id
    cond, unc = model(torch.cat([tokens, uncond])).logits.reshape(2 * b, t, -1).chunk(2)
    return unc + (cfg_scale + 1) * (cond - unc)


def _weighted_ce_batches(model: SteerlingModel, context: list[int], continuation: list[int], mc_num: int,
                         mc_batch_size: int, generator: torch.Generator | None, cfg_scale: float):
    """Per batch of masked copies with a masked position: (masked (B, T) bool, the masked positions'
    cross-entropy / mask rate in float32, the batch size). The draws as the module docstring says;
    the callers check mc_num and mc_batch_size."""
    device = next(model.parameters()).device
    seq = torch.tensor(list(context) + list(continuation), dtype=torch.long, device=device)
    prompt_len, mask_id = len(context), model.cfg.mask_id
    done = 0
    while done < mc_num:
        bsz = min(mc_batch_size, mc_num - done)
        noisy, rate = masked_copies(seq, prompt_len, bsz, mask_id, generator)
        done += bsz
        masked = noisy == mask_id
        if not masked.any():
            continue
        logits = _logits(model, noisy, prompt_len, cfg_scale)
        truth = seq.unsqueeze(0).expand(bsz, -1)
        ce = F.cross_entropy(logits[masked].float(), truth[masked], reduction="none")
        yield masked, ce / rate[masked], bsz


@torch.no_grad()
def mc_loglikelihood(model: SteerlingModel, context: list[int], continuation: list[int], *,
                     mc_num: int = DEFAULT_MC_NUM, mc_batch_size: int = DEFAULT_MC_BATCH_SIZE,
                     generator: torch.Generator | None = None, cfg_scale: float = 0.0) -> float:
    """log p(continuation | context), estimated as the module docstring says; 0.0 for an empty
    continuation. ``mc_num`` and ``mc_batch_size`` >= 1."""
    if mc_num < 1 or mc_batch_size < 1:
        raise ValueError(f"mc_num and mc_batch_size must be >= 1, got {mc_num} and {mc_batch_size}")
    if not continuation:
        return 0.0
    total = torch.zeros((), device=next(model.parameters()).device)
    batches = 0
    for _masked, weighted, bsz in _weighted_ce_batches(model, context, continuation, mc_num, mc_batch_size,
                                                       generator, cfg_scale):
        total += weighted.sum() / bsz
        batches += 1
    return -(total / batches).item() if batches else 0.0


@torch.no_grad()
def mc_token_shares(model: SteerlingModel, context: list[int], continuation: list[int], *,
                    mc_num: int = DEFAULT_MC_NUM, mc_batch_size: int = DEFAULT_MC_BATCH_SIZE,
                    generator: torch.Generator | None = None, cfg_scale: float = 0.0) -> list[float]:
    """`mc_loglikelihood`'s estimate split over the continuation's tokens, from the same draws:
    token j's share is minus its (cross-entropy / mask rate) terms over every copy that masked it,
    scaled as the estimate scales the sum, so the shares add up to the estimate (float64 sums;
    the package sums in float32 in another order: they agree to rounding). What the server
    returns as a block-diffusion model's echo logprobs."""
    if mc_num < 1 or mc_batch_size < 1:
        raise ValueError(f"mc_num and mc_batch_size must be >= 1, got {mc_num} and {mc_batch_size}")
    if not continuation:
        return []
    n = len(context) + len(continuation)
    per_token = torch.zeros(n, dtype=torch.float64, device=next(model.parameters()).device)
    batches = 0
    for masked, weighted, bsz in _weighted_ce_batches(model, context, continuation, mc_num, mc_batch_size,
                                                      generator, cfg_scale):
        terms = torch.zeros(masked.shape, dtype=torch.float64, device=per_token.device)
        terms[masked] = weighted.double()
        per_token += terms.sum(0) / bsz
        batches += 1
    if not batches:
        return [0.0] * len(continuation)
    return (-(per_token[len(context):] / batches)).tolist()
