"""The Steerling sampler, batched over rows, plus counter-based randomness.

Semantics follow the public package's `generate_full` / `_sample_token` exactly:
relu suppression, repetition penalty on every id present in the sequence, EOS and the
never-output ids (`banned_ids`) at -inf, confidence = max softmax probability, then per chosen
position either argmax (greedy) or a draw from softmax(logits / T) filtered to top-p, with
T = 0.3 + 0.4 * normalized entropy in entropy-adaptive mode.

Randomness is a pure function of (request seed, position, step): `counter_uniform` hashes
the triple, and the draw is an inverse-CDF over the filtered, probability-sorted vocabulary.
So a seeded request draws the same tokens whatever it is batched with, on any device.
Every function works on (N, V) rows so the engine can run the whole batch at once on the GPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

_M32 = 0xFFFFFFFF


def _mul32(x: Tensor, c: int) -> Tensor:
    """(x * c) mod 2**32 for 0 <= x < 2**32 without int64 overflow (16-bit split)."""
    lo, hi = x & 0xFFFF, x >> 16
    return (lo * c + (((hi * (c & 0xFFFF)) & 0xFFFF) << 16)) & _M32


def _mix32(x: Tensor) -> Tensor:
    """A 32-bit integer finalizer (xorshift-multiply), applied to int64 tensors in [0, 2**32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def counter_uniform(seed: Tensor, position: Tensor, step: Tensor, stream: int = 0) -> Tensor:
    """A uniform in (0, 1), float64, determined only by (seed, position, step, stream)."""
    seed = seed.to(torch.int64)
    # every field gets its own mixing round, so no two (stream, step) pairs can collide by
    # simple bit arithmetic (an earlier `step ^ (c + stream)` did: stream 1 step 0 == stream 0 step 3)
    h = _mix32(torch.full_like(step, stream, dtype=torch.int64) & _M32 ^ 0x9E3779B9)
    h = _mix32(h ^ (step.to(torch.int64) & _M32))
    h = _mix32(h ^ (position.to(torch.int64) & _M32))
    h = _mix32(h ^ (seed & _M32))
    h = _mix32(h ^ ((seed >> 32) & _M32))
    return (h.to(torch.float64) + 0.5) / 4294967296.0


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings (the reference's GenerationConfig fields)."""

    use_entropy_sampling: bool = True
    temperature: float = 1.2       # used only when use_entropy_sampling is False
    top_p: float = 0.8
    repetition_penalty: float = 1.1

    @property
    def greedy(self) -> bool:
        return not self.use_entropy_sampling and not (self.top_p > 0.0 and self.temperature > 0.0)


def adjust_logits(
    logits: Tensor,
    seen: Tensor,
    repetition_penalty: Tensor,
    eos_id: int,
    banned: Tensor,
    relu_mask: Tensor | None = None,
) -> Tensor:
    """Apply suppression, repetition penalty and bans. logits (N, V) fp32; seen (N, V) bool."""
    out = logits.float()
    if relu_mask is not None:
        out = out - relu_mask
    rp = repetition_penalty.float()[:, None]
    penalized = torch.where(out > 0, out / rp, out * rp)
    out = torch.where(seen & (rp != 1.0), penalized, out)
    out[:, eos_id] = float("-inf")
    out.index_fill_(1, banned, float("-inf"))
    return out


def confidence(adjusted: Tensor) -> Tensor:
    """Max softmax probability per row."""
    return torch.softmax(adjusted, dim=-1).max(dim=-1).values


def most_confident(conf: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The k largest confidences along the last dim and their indices, in descending order;
    equal confidences (two positions saturated at exactly 1.0 are common) in index order, so
    the reference and the batched engine commit the same position. topk leaves ties unordered."""
    values, indices = torch.sort(conf, dim=-1, descending=True, stable=True)
    return values[..., :k], indices[..., :k]


def entropy_temperature(adjusted: Tensor, top_p: Tensor) -> Tensor:
    """T = 0.3 + 0.4 * min(1, H(p) / log(k_eff)) per row, as fp32 (computed like the reference)."""
    probs = torch.softmax(adjusted, dim=-1)
    sorted_p, _ = torch.sort(probs, dim=-1, descending=True)
    cum = torch.cumsum(sorted_p, dim=-1)
    eff_k = ((cum <= top_p.float()[:, None]).sum(-1) + 1).clamp(min=2)
    entropy = -torch.sum(probs * torch.log(probs + 1e-10), dim=-1)
    # The reference does this part in Python floats (double): do it in float64.
    norm = torch.clamp(entropy.double() / torch.log(eff_k.double()), max=1.0)
    return (0.3 + 0.4 * norm).float()


def sampling_distribution(adjusted: Tensor, params: list[SamplingParams]) -> tuple[Tensor, Tensor]:
    """The distribution each (non-greedy) row draws from, in probability-sorted order.

    Returns (filtered (N, V) renormalized top-p mass, sorted_ids (N, V)).
    """
    dev = adjusted.device
    top_p = torch.tensor([p.top_p for p in params], device=dev, dtype=torch.float32)
    temp = torch.tensor([p.temperature for p in params], device=dev, dtype=torch.float32)
    entropy_rows = torch.tensor([p.use_entropy_sampling for p in params], device=dev)
    if bool(entropy_rows.any()):
        temp = torch.where(entropy_rows, entropy_temperature(adjusted, top_p), temp)
    return top_p_filter(torch.softmax(adjusted / temp[:, None], dim=-1), top_p)


def top_p_filter(probs: Tensor, top_p: Tensor) -> tuple[Tensor, Tensor]:
    """Sort each row, keep the smallest prefix whose mass reaches top_p (at least one), renormalize.

    Returns (filtered probabilities in sorted order, the sorted ids).
    """
    sorted_p, sorted_ids = torch.sort(probs, dim=-1, descending=True)
    cum = torch.cumsum(sorted_p, dim=-1)
    keep = (cum - sorted_p) <= top_p[:, None]
    keep[:, 0] = True
    filtered = torch.where(keep, sorted_p, torch.zeros_like(sorted_p))
    return filtered / filtered.sum(-1, keepdim=True), sorted_ids


def choose_tokens(adjusted: Tensor, params: list[SamplingParams], u: Tensor) -> Tensor:
    """One token per row: argmax for greedy rows, else an inverse-CDF draw with uniform u."""
    tokens = adjusted.argmax(-1)
    sampled_rows = [i for i, p in enumerate(params) if not p.greedy]
    if sampled_rows:
        rows = torch.tensor(sampled_rows, device=adjusted.device)
        filtered, ids = sampling_distribution(adjusted[rows], [params[i] for i in sampled_rows])
        tokens[rows] = draw(filtered, ids, u[rows])
    return tokens


def draw(filtered: Tensor, sorted_ids: Tensor, u: Tensor) -> Tensor:
    """Inverse-CDF draw: the first sorted id whose cumulative mass exceeds u (float64 (N,))."""
    cdf = torch.cumsum(filtered.double(), dim=-1)
    target = u.double()[:, None] * cdf[:, -1:]
    j = torch.searchsorted(cdf, target, right=True).clamp(max=filtered.shape[1] - 1)
    # never land on a zero-mass tail entry (rounding at the end of the CDF)
    last_kept = (filtered > 0).sum(-1, keepdim=True) - 1
    j = torch.minimum(j, last_kept)
    return sorted_ids.gather(1, j).squeeze(1)


def banned_ids(cfg, tokenizer_vocab_size: int | None, device=None, unassigned: Sequence[int] = ()) -> Tensor:
    """The ids that are never output, so never sampled (EOS is banned separately, in `adjust_logits`).

    Mask and pad (the public package's bans), BOS (prompts are encoded without it and the
    gateway's detokenizer drops it: sampled, it would be a token the response does not hold),
    and embedding-table padding rows the tokenizer can never decode. `<|endofchunk|>` and the
    chat header ids stay: they are output tokens (a chunk boundary, a turn marker) that add no text.
    """
    ids = [cfg.mask_id, cfg.pad_id, cfg.bos_id, *unassigned]   # unassigned: the tokenizer's holes (Tokenizer.unassigned_ids)
    if tokenizer_vocab_size is not None:
        ids += list(range(tokenizer_vocab_size, cfg.vocab_size))
    return torch.tensor(sorted(set(ids)), dtype=torch.long, device=device)
