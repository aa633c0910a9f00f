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


def integrated_gradients(model: SteerlingModel, tokens: Tensor, positions: Tensor, targets: Tensor,
                         n_steps: int, steering: SteeringInputs | None = None) -> Tensor:
    """(P, T) float32: row i attributes the logit of `targets[i]` at `positions[i]` of input
    `tokens[i]` (P, T) to every input position."""
    if n_steps < 1:
        raise ValueError(f"n_steps must be >= 1, got {n_steps}")
    b, t = tokens.shape
    emb = model.transformer.tok_emb
    pos = torch.arange(t, device=tokens.device).expand(b, t)
    attend = dense_block_causal_attend(pos, model.cfg.diff_block_size)
    with torch.no_grad():
        inputs = emb(tokens)
        baseline = emb(torch.full((t,), model.cfg.mask_id, dtype=torch.long, device=tokens.device))[None].expand(b, -1, -1)
    delta = inputs - baseline
    grads = torch.zeros_like(inputs, dtype=torch.float32)
    rows = torch.arange(b, device=tokens.device)
    for step in range(n_steps):
        alpha = (step + 1) / n_steps
        with torch.inference_mode(False), torch.enable_grad():
            interp = (baseline + alpha * delta).detach().requires_grad_(True)
            hidden = model.hidden_states(tokens, pos, attend, steering, embeds=interp)
            logits = model.transformer.lm_head(hidden)
            target = logits[rows, positions][rows, targets]
            grads.add_(torch.autograd.grad(target.sum(), interp)[0])
    return (delta.float() * grads / n_steps).sum(-1)


@dataclass
class InputAttribution:
    """Every committed token's explanation: `attributions[n]` (T,) for the n-th target."""
    positions: list[int]
    tokens: list[int]
    orders: list[int]
    attributions: Tensor      # (N, T) float32


def attribute(model: SteerlingModel, prompt: list[int], seq_len: int, groups: list[CommitGroup],
              n_steps: int = DEFAULT_N_STEPS, steering: PreparedSteering | None = None) -> InputAttribution:
    """Attribute every token of `groups`, one batch per group (its snapshot tiled over its
    targets). A steered request replays its injection as the reference decoder applied it at
    that step: strength from the tokens committed before it, gate on the snapshot's masks."""
    device = next(model.parameters()).device
    mask_id = model.cfg.mask_id
    rows: list[Tensor] = []
    positions: list[int] = []
    tokens: list[int] = []
    orders: list[int] = []
    committed = 0
    for g in groups:
        x = torch.tensor(snapshot(prompt, seq_len, groups, g.order, mask_id), device=device)
        p = len(g.positions)
        steer = None
        if steering is not None:
            alpha = resolve_alpha(steering.schedule, steering.base_alpha, committed, steering.cutoff_tokens)
            steer = SteeringInputs(steering.direction.to(device)[None].expand(p, -1),
                                   torch.full((p,), alpha, device=device),
                                   (x == mask_id).float()[None].expand(p, -1),
                                   torch.full((p,), steering.inject_layer, device=device))
        rows.append(integrated_gradients(model, x[None].expand(p, -1).contiguous(),
                                         torch.tensor(g.positions, device=device),
                                         torch.tensor(g.tokens, device=device), n_steps, steer))
        positions += g.positions
        tokens += g.tokens
        orders += [g.order] * p
        committed += p
    attributions = torch.cat(rows) if rows else torch.zeros(0, seq_len, device=device)
    return InputAttribution(positions, tokens, orders, attributions.detach())
