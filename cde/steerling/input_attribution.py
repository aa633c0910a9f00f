"""Input attribution for block-diffusion generation: which prompt and earlier tokens made the
model commit a token, faithful to the diffusion replay (the public package's
`steerling.attribution.input_attribution.FaithfulOutputToInputAttributor`, reproduced).

A committed token is explained on the input the model saw at the step that committed it: the
prompt, every position committed at an earlier step, every other generated position masked
(`snapshot`; later blocks are invisible to it under block-causal attention, and stay masked
there). The explanation is integrated gradients over the input embeddings from a MASK
baseline (every position's embedding -> the mask token's), right-Riemann with `n_steps` points
(1 = input x gradient), of the committed token's logit through the trunk and the LM head on the
final hidden state (the package's forward: the concept heads' detaches would break
completeness). Arithmetic in the package's order: gradients summed in float32, times the
embedding difference, summed over the model dimension.

Beyond the package: `steering` replays a steered request with its injection (the same
`SteeringInputs` the reference decoder built at that step), which the package refuses.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from cde.steerling.model import SteerlingModel, SteeringInputs, dense_block_causal_attend
from cde.steerling.steering import PreparedSteering, resolve_alpha

DEFAULT_N_STEPS = 32    # the package's default


@dataclass(frozen=True)
class CommitGroup:
    """The tokens one denoising step committed; `order` counts the request's steps from 0."""
    order: int
    positions: tuple[int, ...]
    tokens: tuple[int, ...]


def commit_groups(steps) -> list[CommitGroup]:
    """Groups from the steps that committed tokens (the reference decoder's StepEvents, in order;
    steps that committed nothing are skipped, so orders are contiguous)."""
    out: list[CommitGroup] = []
    for s in steps:
        if s.positions:
            out.append(CommitGroup(len(out), tuple(s.positions), tuple(s.tokens)))
    return out


def snapshot(prompt: list[int], seq_len: int, groups: list[CommitGroup], order: int, mask_id: int) -> list[int]:
    """The input at the step of group `order`: prompt | tokens of earlier groups | masks."""
    x = list(prompt) + [mask_id] * (seq_len - len(prompt))
    for g in groups:
        if g.order < order:
            for p, t in zip(g.positions, g.tokens):
                x[p] = t
    return x


# Tokens through the model per forward + backward. Its saved activations are ~6 MB a token at
# 8B dims (32 layers: q, k, v, attention out, gate, up, their product, norms in bf16), so 4,096
# tokens take ~24 GB beside the weights: an 80 GB card still holds a decode engine's KV cache
# (64 rows of 264 tokens, the old bound, did not fit an H100 at all).
IG_TOKENS_PER_FORWARD = 4096


def integrated_gradients(model: SteerlingModel, tokens: Tensor, positions: Tensor, targets: Tensor,
                         n_steps: int, steering: SteeringInputs | None = None,
                         max_tokens: int = IG_TOKENS_PER_FORWARD) -> Tensor:
    """(P, T) float32: row i attributes the logit of `targets[i]` at `positions[i]` of input
    `tokens[i]` (P, T) to every input position. The interpolation points go through the model
    together, as many per forward as keep P x points x T <= max_tokens (one backward per
    forward; at least one point)."""
    if n_steps < 1:
        raise ValueError(f"n_steps must be >= 1, got {n_steps}")
    b, t = tokens.shape
    emb = model.transformer.tok_emb
    per = max(1, min(n_steps, max_tokens // max(b * t, 1)))   # interpolation points per forward
    with torch.no_grad():
        inputs = emb(tokens)
        baseline = emb(torch.full((t,), model.cfg.mask_id, dtype=torch.long, device=tokens.device))[None].expand(b, -1, -1)
    delta = inputs - baseline
    grads = torch.zeros_like(inputs, dtype=torch.float32)
    for first in range(0, n_steps, per):
        k = min(per, n_steps - first)
        alphas = torch.arange(first + 1, first + k + 1, device=tokens.device, dtype=inputs.dtype) / n_steps
        rows = torch.arange(b * k, device=tokens.device)
        pos = torch.arange(t, device=tokens.device).expand(b * k, t)
        attend = dense_block_causal_attend(pos, model.cfg.diff_block_size)
        steer = None if steering is None else SteeringInputs(
            steering.vector.repeat(k, 1), steering.alpha.repeat(k), steering.gate.repeat(k, 1),
            steering.inject_layer.repeat(k))
        with torch.inference_mode(False), torch.enable_grad():
            interp = (baseline[None] + alphas[:, None, None, None] * delta[None]).reshape(b * k, t, -1)
            interp = interp.detach().requires_grad_(True)
            hidden = model.hidden_states(tokens.repeat(k, 1), pos, attend, steer, embeds=interp)
            logits = model.transformer.lm_head(hidden)
            target = logits[rows, positions.repeat(k)][rows, targets.repeat(k)]
            g = torch.autograd.grad(target.sum(), interp)[0].float().view(k, b, t, -1)
        grads.add_(g.sum(0))
    return (delta.float() * grads / n_steps).sum(-1)


@dataclass
class InputAttribution:
    """Every committed token's explanation: `attributions[n]` (T,) for the n-th target."""
    positions: list[int]
    tokens: list[int]
    orders: list[int]
    attributions: Tensor      # (N, T) float32


def attribute_at_step(model: SteerlingModel, x: Tensor, positions: list[int], tokens: list[int], committed: int,
                      n_steps: int, steering: PreparedSteering | None = None) -> Tensor:
    """(P, T): the tokens one step committed at `positions`, explained on that step's snapshot `x`
    (T,), tiled over them. A steered request replays its injection as the reference decoder applied
    it: strength from the `committed` tokens before the step, gate on the snapshot's masks."""
    device = x.device
    p = len(positions)
    steer = None
    if steering is not None:
        alpha = resolve_alpha(steering.schedule, steering.base_alpha, committed, steering.cutoff_tokens)
        steer = SteeringInputs(steering.direction.to(device)[None].expand(p, -1),
                               torch.full((p,), alpha, device=device),
                               (x == model.cfg.mask_id).float()[None].expand(p, -1),
                               torch.full((p,), steering.inject_layer, device=device))
    return integrated_gradients(model, x[None].expand(p, -1).contiguous(), torch.tensor(positions, device=device),
                                torch.tensor(tokens, device=device), n_steps, steer)


def attribute(model: SteerlingModel, prompt: list[int], seq_len: int, groups: list[CommitGroup],
              n_steps: int = DEFAULT_N_STEPS, steering: PreparedSteering | None = None) -> InputAttribution:
    """Attribute every token of `groups`, one batch per group (`attribute_at_step`)."""
    device = next(model.parameters()).device
    rows: list[Tensor] = []
    positions: list[int] = []
    tokens: list[int] = []
    orders: list[int] = []
    committed = 0
    for g in groups:
        x = torch.tensor(snapshot(prompt, seq_len, groups, g.order, model.cfg.mask_id), device=device)
        rows.append(attribute_at_step(model, x, list(g.positions), list(g.tokens), committed, n_steps, steering))
        positions += g.positions
        tokens += g.tokens
        orders += [g.order] * len(g.positions)
        committed += len(g.positions)
    attributions = torch.cat(rows) if rows else torch.zeros(0, seq_len, device=device)
    return InputAttribution(positions, tokens, orders, attributions.detach())
