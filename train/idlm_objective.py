"""The I-DLM introspective-consistency objective: [x_t | x_0] batches, their attention mask, the loss.

A training row is x_0 (L clean tokens) and its noisy copy x_t (L [MASK] tokens) laid side by
side as one sequence of 2L tokens, ``[x_t | x_0]``, both halves with RoPE positions 0..L-1.
x_t is cut into blocks of b = N - 1 positions (stride N); with logit shift every position
predicts the token after it. Attention (True = may attend):

* x_0 query i: x_0 keys j <= i (plain causal); x_0 never sees x_t;
* x_t query i in block [s, s + b): x_0 keys j < s (the clean prefix before its block) and
  x_t keys s <= j <= i (the masks of its own block up to itself).

So the mask at position s + k, k < b, sees exactly what the k-th [MASK] of an ISD window
sees at inference (clean context up to s - 1, then k + 1 masks) and is trained to predict
x_0[s + k + 1], the token k + 2 ahead of the last clean one: the draft it will propose.
tests/test_idlm_train.py checks this equality of logits against a plain causal forward.

L = L_mask + s * L_clean with s = L_mask / L_clean detached (the auto-balance of the released
code): the clean half keeps the causal "anchor" distribution p from drifting while the masks
learn the proposals q. R-ISD trains with the LoRA gated to x_t only, so L_clean is constant
and only L_mask is used.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.nn.functional as F
from torch import Tensor

from cde.qwen3.model import AttendFn, Qwen3Model


@lru_cache(maxsize=16)
def _mask_cpu(length: int, block: int) -> Tensor:
    i = torch.arange(length)
    causal = i[:, None] >= i[None, :]
    start = (i // block) * block                                   # block start of each x_t position
    noisy_to_clean = i[None, :] < start[:, None]                   # x_t query -> x_0 key
    noisy_to_noisy = (i[None, :] >= start[:, None]) & causal       # same block, up to itself
    top = torch.cat([noisy_to_noisy, noisy_to_clean], dim=1)       # rows: x_t queries
    bottom = torch.cat([torch.zeros(length, length, dtype=torch.bool), causal], dim=1)   # rows: x_0 queries
    return torch.cat([top, bottom], dim=0)


def attention_mask(length: int, block: int, device: torch.device | str = "cpu") -> Tensor:
    """(2L, 2L) bool mask of ``[x_t | x_0]`` for blocks of ``block`` masks (stride block + 1)."""
    if length < 1 or block < 1:
        raise ValueError("length and block must be positive")
    return _mask_cpu(length, block).to(device)


def training_attend(mask: Tensor | None) -> AttendFn:
    """SDPA with K/V heads repeated to the query heads (GQA as ``enable_gqa`` groups them):
    on CUDA this keeps masked training attention on the memory-efficient kernel and causal
    attention on flash, whatever their GQA support. mask None: causal."""

    def attend(_layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        rep = q.shape[1] // k.shape[1]
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        if mask is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    return attend


@dataclass
class ConsistencyBatch:
    tokens: Tensor      # (B, 2L) [x_t | x_0]
    positions: Tensor   # (B, 2L) 0..L-1 twice
    mask: Tensor        # (1, 1, 2L, 2L) bool
    gate: Tensor        # (B, 2L) bool: True on x_t (where an R-ISD LoRA applies)
    targets: Tensor     # (B, L - 1) x_0[1:]
    length: int


def consistency_batch(x0: Tensor, block: int, mask_id: int) -> ConsistencyBatch:
    """Build ``[x_t | x_0]`` for clean rows x0 (B, L) with blocks of ``block`` masks."""
    b, length = x0.shape
    xt = torch.full_like(x0, mask_id)
    pos = torch.arange(length, device=x0.device)
    gate = torch.cat([torch.ones(length, dtype=torch.bool, device=x0.device),
                      torch.zeros(length, dtype=torch.bool, device=x0.device)])
    return ConsistencyBatch(tokens=torch.cat([xt, x0], dim=1), positions=torch.cat([pos, pos]).expand(b, -1),
                            mask=attention_mask(length, block, x0.device)[None, None], gate=gate.expand(b, -1),
                            targets=x0[:, 1:], length=length)


@dataclass
class ConsistencyLosses:
    total: Tensor
    mask: Tensor     # L_mask: CE of x_t logits at i against x_0[i + 1]
    clean: Tensor    # L_clean: CE of x_0 logits at i against x_0[i + 1]


def consistency_loss(model: Qwen3Model, batch: ConsistencyBatch, lora_gated: bool = False,
                     clean_weight: float | None = None) -> ConsistencyLosses:
    """Forward ``[x_t | x_0]`` and the loss. ``lora_gated``: an attached LoRA acts on x_t only
    (R-ISD; base weights on x_0). ``clean_weight`` None = auto-balance s = L_mask / L_clean
    (detached), else the fixed weight."""
    n = batch.length
    gate = batch.gate if lora_gated else None
    h = model.hidden_states(batch.tokens, batch.positions, training_attend(batch.mask), gate)
    # Only rows that have a target: x_t 0..L-2 and x_0 0..L-2.
    h = torch.cat([h[:, :n - 1], h[:, n:2 * n - 1]], dim=1)
    logits = _at_least_fp32(model.logits(h))
    v = logits.shape[-1]
    ce = F.cross_entropy(logits.reshape(-1, v), batch.targets.repeat(1, 2).reshape(-1),
                         reduction="none").view(logits.shape[0], 2, n - 1)
    l_mask, l_clean = ce[:, 0].mean(), ce[:, 1].mean()
    s = (l_mask / l_clean).detach() if clean_weight is None else torch.tensor(clean_weight)
    total = l_mask if lora_gated else l_mask + s * l_clean
    return ConsistencyLosses(total, l_mask.detach(), l_clean.detach())


def _at_least_fp32(x: Tensor) -> Tensor:
    """bf16 logits are upcast for the loss; float64 (tests) stays float64."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def causal_lm_loss(model: Qwen3Model, tokens: Tensor) -> Tensor:
    """Next-token CE of a plain causal forward (the AR base's objective, the held-out loss)."""
    x = tokens[:, :-1]
    positions = torch.arange(x.shape[1], device=x.device).expand_as(x)
    logits = _at_least_fp32(model.logits(model.hidden_states(x, positions, training_attend(None))))
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
