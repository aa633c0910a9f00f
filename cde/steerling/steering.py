"""Concept steering as pure functions (the steering service calls these; so does the decoder).

Semantics of the public package (`SteerlingGenerator._prepare_steering`,
`_resolve_alpha`, `_position_injection`, `_build_relu_mask`, `SteeringConfig` presets):
- direction = L2-normalized sum of the chosen known-concept embeddings;
- amplify: alpha = target / max_v (W_lm[v] . direction) ("logit units"), injected at blocks
  i with i + 1 >= inject_layer (default 8), schedule hard_cutoff after 32 tokens;
- suppress: raw alpha (default -7) over the concept and its group neighbours, fixed schedule,
  inject_layer default n_layers // 2, and 20 * relu(E_c . W_lm^T) subtracted from the logits;
- injection only at positions that are still masked, rebuilt every step.

Beyond the package, a request's per-concept `strength` (default 1: the package exactly):
the largest strength scales the injected magnitude (`SteeringSpec.strength`: alpha, and the
suppress preset's logit mask, times it), the strengths relative to it weight the direction's
sum. So one concept at strength 0.5 / 2 is steered half / twice as hard, and {a: 1, b: 0.5}
steers along a + b/2 at full magnitude.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor

# The presets' defaults live with every other request default in cde.limits (re-exported here).
from cde.limits import AMPLIFY_INJECT_LAYER, AMPLIFY_TARGET, DEFAULT_CUTOFF, SUPPRESS_TARGET  # noqa: F401

Schedule = Literal["fixed", "hard_cutoff"]
Mode = Literal["amplify", "suppress"]

SUPPRESS_RELU_STRENGTH = 20.0


@dataclass(frozen=True)
class SteeringSpec:
    """What a request asks for, after concept names were resolved to known-concept ids."""

    concept_ids: tuple[int, ...]
    target: float                      # mai_lm_target: logit units if normalize else raw alpha
    normalize: bool = True
    inject_layer: int | None = None    # None -> n_layers // 2
    schedule: Schedule = "fixed"
    cutoff_tokens: int = DEFAULT_CUTOFF
    relu_mask: dict[int, float] = field(default_factory=dict)
    strength: float = 1.0              # scales alpha and the relu mask (1: the package's presets)

    @staticmethod
    def amplify(concept_ids, target: float = AMPLIFY_TARGET, inject_layer: int = AMPLIFY_INJECT_LAYER,
                cutoff_tokens: int = DEFAULT_CUTOFF) -> SteeringSpec:
        ids = (concept_ids,) if isinstance(concept_ids, int) else tuple(concept_ids)
        return SteeringSpec(ids, target, True, inject_layer, "hard_cutoff", cutoff_tokens)

    @staticmethod
    def suppress(concept_id: int, group_ids=(), target: float = SUPPRESS_TARGET, inject_layer: int | None = None,
                 relu_strength: float = SUPPRESS_RELU_STRENGTH) -> SteeringSpec:
        ids = (concept_id,) + tuple(c for c in group_ids if c != concept_id)
        return SteeringSpec(ids, target, False, inject_layer, "fixed", DEFAULT_CUTOFF, {concept_id: relu_strength})


@dataclass(frozen=True)
class PreparedSteering:
    """Everything the engine needs per request: a vector, a base alpha, a layer, a schedule."""

    direction: Tensor            # (D,) unit vector, model dtype
    base_alpha: float
    inject_layer: int
    schedule: Schedule
    cutoff_tokens: int
    relu_mask: Tensor | None     # (V,) fp32 to subtract from logits, or None


def steering_direction(concept_embeddings: Tensor, weights: Tensor | None = None) -> Tensor:
    """L2-normalized (weighted) sum of (K, D) embeddings, fp32.

    weights: (K,) relative per-concept weights (a request's SteeringConcept.strength); None means
    all 1 and skips the multiply, so unweighted callers get exactly the unweighted sum.
    """
    emb = concept_embeddings.float()
    if weights is not None:
        emb = emb * weights.to(device=emb.device, dtype=torch.float32).unsqueeze(-1)
    vec = emb.sum(dim=0)
    return vec / (vec.norm(p=2) + 1e-12)


def peak_alignment(direction: Tensor, lm_weight: Tensor) -> float:
    """max_v W_lm[v] . direction, floored at 1e-6."""
    return max(float((lm_weight.float() @ direction.float()).max().item()), 1e-6)


def base_alpha(target: float, direction: Tensor, lm_weight: Tensor, normalize: bool) -> float:
    return target / peak_alignment(direction, lm_weight) if normalize else float(target)


def resolve_alpha(schedule: Schedule, base: float, committed_tokens: int, cutoff_tokens: int) -> float:
    """Alpha for the next step given how many of the request's tokens are already unmasked."""
    if schedule == "fixed":
        return base
    if schedule == "hard_cutoff":
        return base if committed_tokens < cutoff_tokens else 0.0
    raise ValueError(f"unknown steering schedule: {schedule!r}")


def relu_logit_mask(concept_embeddings: Tensor, strengths: Tensor, lm_weight: Tensor) -> Tensor:
    """(V,) = sum_c strength_c * relu(E_c . W_lm^T): subtracting it suppresses only promoted tokens."""
    alignment = concept_embeddings.float() @ lm_weight.float().t()
    return (strengths.float().unsqueeze(-1) * alignment.clamp_min(0.0)).sum(dim=0)


def position_gate(tokens: Tensor, mask_id: int) -> Tensor:
    """1.0 where the position is still masked, else 0.0 (same shape as tokens)."""
    return (tokens == mask_id).float()


def prepare(spec: SteeringSpec, known_embeddings: Tensor, lm_weight: Tensor, n_layers: int,
            relu_embeddings: Tensor | None = None, dtype: torch.dtype | None = None,
            weights: Tensor | None = None) -> PreparedSteering:
    """Turn a spec into the per-request tensors.

    known_embeddings: (K, D) rows of `known_head.concept_embedding` for spec.concept_ids, in
    order; relu_embeddings: rows for spec.relu_mask's keys (defaults to the first row when the
    mask names the focal concept only, as the presets do); weights: (K,) per-concept strengths
    of the direction sum (None = all 1).
    """
    if not spec.concept_ids:
        raise ValueError("steering needs at least one concept")
    direction = steering_direction(known_embeddings, weights)
    alpha = base_alpha(spec.target, direction, lm_weight, spec.normalize)
    if spec.strength != 1.0:
        alpha *= spec.strength
    layer = spec.inject_layer if spec.inject_layer is not None else n_layers // 2
    mask = None
    if spec.relu_mask:
        if relu_embeddings is None:
            rows = [spec.concept_ids.index(c) for c in spec.relu_mask]
            relu_embeddings = known_embeddings[rows]
        strengths = torch.tensor(list(spec.relu_mask.values()), dtype=torch.float32) * spec.strength
        mask = relu_logit_mask(relu_embeddings, strengths.to(relu_embeddings.device), lm_weight)
    return PreparedSteering(direction.to(dtype or known_embeddings.dtype), alpha, layer, spec.schedule,
                            spec.cutoff_tokens, mask)
