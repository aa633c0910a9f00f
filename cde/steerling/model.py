"""Steerling: a block-causal diffusion transformer with a concept bottleneck.

Plain PyTorch in the gpt-fast style. Parameter names equal the public `steerling`
package's (`transformer.tok_emb.weight`, `transformer.blocks.N.attn.c_attn.weight`,
`known_head.*`, `unknown_head.*`) so its checkpoints load unchanged.

Architecture (docs/STEERLING.md): post-norm residuals, fused qkv clamped to
+-clip_qkv, RMSNorm QK-norm before RoPE (theta 500000, full head dim, rotate-half, fp32),
SwiGLU with `c_fc` split as (up, gate), tied LM head, attention block-causal on absolute
positions: query i sees key j iff i // 64 >= j // 64.

Attention is a pluggable function so the same layers serve the full-recompute reference
(dense mask, below) and the paged engine (which passes its own `attend`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from cde import random_init
from cde.norms import RMSNorm
from cde.steerling import kernels
from cde.steerling.concept_heads import TOKEN_CHUNK, DiscoveredHead, KnownHead
from cde.steerling.config import SteerlingConfig

# attend(layer_index, q (B,H,T,hd), k (B,KV,T,hd), v (B,KV,T,hd)) -> (B,H,T,hd)
AttendFn = Callable[[int, Tensor, Tensor, Tensor], Tensor]


def rope_tables(head_dim: int, max_len: int, base: float, device=None) -> tuple[Tensor, Tensor]:
    """cos/sin tables (max_len, head_dim) in fp32, computed as the reference does."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float) / head_dim))
    pos = torch.arange(max_len, device=device, dtype=torch.float)
    freqs = torch.outer(pos, inv_freq)
    angles = torch.cat((freqs, freqs), dim=-1)
    return angles.cos(), angles.sin()


apply_rope = kernels.apply_rope


class Attention(nn.Module):
    def __init__(self, cfg: SteerlingConfig):
        super().__init__()
        self.n_head, self.n_kv, self.hd, self.clip = cfg.n_head, cfg.n_kv_heads, cfg.head_dim, cfg.clip_qkv
        self.c_attn = nn.Linear(cfg.n_embd, cfg.n_embd + 2 * self.n_kv * self.hd, bias=False)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
        self.q_norm = RMSNorm(self.hd, cfg.norm_eps, kernels.CAST_BEFORE_WEIGHT)
        self.k_norm = RMSNorm(self.hd, cfg.norm_eps, kernels.CAST_BEFORE_WEIGHT)
        self.kernels = kernels.EAGER

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, attend: Callable[[Tensor, Tensor, Tensor], Tensor]) -> Tensor:
        b, t, c = x.shape
        q, k, v = self.kernels.qkv_prep(self.c_attn(x), self.q_norm.weight, self.k_norm.weight, self.q_norm.eps,
                                        cos, sin, self.n_head, self.n_kv, self.hd, self.clip)
        y = attend(q, k, v)
        # this module's heads: all of them, or a tensor-parallel rank's (cde/tp.py)
        return self.c_proj(y.transpose(1, 2).reshape(b, t, self.n_head * self.hd))


class MLP(nn.Module):
    def __init__(self, cfg: SteerlingConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 2 * cfg.intermediate_size, bias=False)
        self.c_proj = nn.Linear(cfg.intermediate_size, cfg.n_embd, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.c_proj(kernels.swiglu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, cfg: SteerlingConfig):
        super().__init__()
        self.ln_1 = RMSNorm(cfg.n_embd, cfg.norm_eps, kernels.CAST_BEFORE_WEIGHT)
        self.ln_2 = RMSNorm(cfg.n_embd, cfg.norm_eps, kernels.CAST_BEFORE_WEIGHT)
        self.attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.kernels = kernels.EAGER

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, attend, steer: tuple[Tensor, Tensor] | None = None) -> Tensor:
        """steer = (coef (B,T) fp32, vector (B,D)): added after the block's residual."""
        kn = self.kernels
        x = kn.add_norm(x, self.attn(x, cos, sin, attend), self.ln_1.weight, self.ln_1.eps)
        m = self.mlp.c_proj(kn.swiglu(self.mlp.c_fc(x)))
        if steer is None:
            return kn.add_norm(x, m, self.ln_2.weight, self.ln_2.eps)
        return kn.add_norm_steer(x, m, self.ln_2.weight, self.ln_2.eps, steer[0], steer[1])


class Transformer(nn.Module):
    def __init__(self, cfg: SteerlingConfig):
        super().__init__()
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = RMSNorm(cfg.n_embd, cfg.norm_eps, kernels.CAST_BEFORE_WEIGHT)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.tok_emb.weight = self.lm_head.weight  # tied


@dataclass
class SteeringInputs:
    """Per-request steering, as tensors so a captured graph never changes shape.

    vector (B, D): unit direction (zeros when the request is unsteered);
    alpha (B,) fp32: current strength (0 switches injection off);
    gate (B, T): 1.0 at positions that are still masked, else 0.0;
    inject_layer (B,) int: block i injects when i + 1 >= inject_layer.
    """

    vector: Tensor
    alpha: Tensor
    gate: Tensor
    inject_layer: Tensor


@dataclass
class KnownIntervention:
    """Override known-concept weights: ids (B, M) with -1 = unused, values (B, M).

    Matches the reference's dense path: keep the top-k weights, set the named concepts'
    weights to the given values, and drop the epsilon residual for those requests.
    """

    ids: Tensor
    values: Tensor


@dataclass
class HeadsOutput:
    logits: Tensor          # (N, V)
    known_idx: Tensor       # (N, k_known)
    known_logits: Tensor    # (N, k_known) fp32, clamped
    disc_idx: Tensor        # (N, k_disc)
    disc_logits: Tensor     # (N, k_disc) fp32, clamped


class SteerlingModel(nn.Module):
    def __init__(self, cfg: SteerlingConfig):
        super().__init__()
        self.cfg = cfg
        self.transformer = Transformer(cfg)
        # the head keeps the features' top-k; heads() records the first topk_known of them
        self.known_head = KnownHead(cfg.n_known, cfg.n_known_padded, cfg.n_embd, cfg.known_features_k,
                                    cfg.concept_chunk)
        self.unknown_head = DiscoveredHead(
            cfg.n_discovered, cfg.n_discovered_padded, cfg.n_embd, cfg.factorize_rank,
            cfg.topk_discovered, cfg.concept_chunk,
        )
        cos, sin = rope_tables(cfg.head_dim, cfg.block_size, cfg.rope_base)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    # ---- initialisation -------------------------------------------------------------
    def init_random(self, seed: int, std: float = 0.02) -> SteerlingModel:
        """Random weights (normal(0, std), norms at 1) from a seeded generator (cde/random_init.py)."""
        return random_init.init_random(self, seed, std)

    def _apply(self, fn, recurse: bool = True):
        # `.to(bfloat16)` would also cast the RoPE tables; the reference computes RoPE in fp32.
        super()._apply(fn, recurse)
        if self.rope_cos.dtype != torch.float32 and not self.rope_cos.is_meta:
            self.rebuild_rope(self.rope_cos.device)
        return self

    def rebuild_rope(self, device: torch.device | str | None = None) -> None:
        """Recompute the RoPE tables (after building on the meta device)."""
        cos, sin = rope_tables(self.cfg.head_dim, self.cfg.block_size, self.cfg.rope_base, device)
        self.rope_cos, self.rope_sin = cos, sin

    # ---- the transformer ------------------------------------------------------------
    def hidden_states(
        self,
        tokens: Tensor,
        positions: Tensor,
        attend: AttendFn,
        steering: SteeringInputs | None = None,
        embeds: Tensor | None = None,
    ) -> Tensor:
        """Final hidden states (after ln_f), (B, T, D). positions (B, T) are absolute. `embeds`
        (B, T, D) replaces the token embeddings (input attribution's interpolated inputs)."""
        x = self.transformer.tok_emb(tokens) if embeds is None else embeds
        cos = self.rope_cos[positions].unsqueeze(1)
        sin = self.rope_sin[positions].unsqueeze(1)
        coefs = None
        if steering is not None:
            coef = steering.alpha.float()[:, None] * steering.gate.float()  # (B, T)
            layer_no = torch.arange(1, len(self.transformer.blocks) + 1, device=coef.device)
            on = (steering.inject_layer[None, :] <= layer_no[:, None]).float()  # (L, B): block i injects
            coefs = coef[None] * on[:, :, None]                                  # (L, B, T)
        for i, block in enumerate(self.transformer.blocks):
            steer = None if coefs is None else (coefs[i], steering.vector)
            x = block(x, cos, sin, lambda q, k, v, i=i: attend(i, q, k, v), steer)
        return self.transformer.ln_f(x)

    def use_kernels(self, kn: kernels.Kernels) -> None:
        """Run the layers' pointwise parts with `kn` (e.g. `kernels.compiled()`)."""
        for block in self.transformer.blocks:
            block.kernels = kn
            block.attn.kernels = kn

    # ---- the concept bottleneck and the LM head -------------------------------------
    def heads(self, h: Tensor, intervention: KnownIntervention | None = None,
              intervened_rows: Tensor | None = None, token_chunk: int | None = TOKEN_CHUNK) -> HeadsOutput:
        """Concept heads + LM head on rows h (N, D).

        Without interventions logits = lm_head(known + discovered + eps) with
        eps = h - (known + discovered), exactly as the reference composes them. With an
        intervention (ids/values given per row, `intervened_rows` (N,) bool marking rows whose
        request intervenes) those rows use the overridden known weights and no eps.
        token_chunk bounds the rows scored per pass (None: all at once; the engine bounds its
        step's rows itself and needs shapes that do not depend on the row count).
        """
        f_idx, f_logits = self.known_head.topk_of(h, token_chunk)
        # The package mixes topk_known_features concepts into the features but records (and
        # intervenes on) the topk_known best of them; the top-k comes out sorted, so a slice.
        k_idx, k_logits = f_idx[:, : self.cfg.topk_known], f_logits[:, : self.cfg.topk_known]
        d_idx, d_logits = self.unknown_head.topk_of(h, token_chunk)
        unk = self.unknown_head.features(d_idx, d_logits).to(h.dtype)
        if intervention is None:
            known = self.known_head.features(f_idx, f_logits).to(h.dtype)
            eps = h - (unk + known)
            composed = (unk + eps) + known
        else:
            known = self._intervened_known(k_idx, k_logits, intervention).to(h.dtype)
            eps = h - (unk + known)
            keep_eps = ~intervened_rows if intervened_rows is not None else torch.zeros_like(eps[:, 0], dtype=torch.bool)
            composed = (unk + eps * keep_eps[:, None].to(eps.dtype)) + known
        logits = self.transformer.lm_head(composed)
        return HeadsOutput(logits, k_idx, k_logits, d_idx, d_logits)

    def _intervened_known(self, idx: Tensor, logits: Tensor, iv: KnownIntervention) -> Tensor:
        weights = torch.sigmoid(logits)
        ids, vals = iv.ids, iv.values.float()
        valid = ids >= 0
        match = (idx[:, :, None] == ids[:, None, :]) & valid[:, None, :]           # (N, k, M)
        overridden = match.any(-1)
        new_w = torch.where(overridden, (match.float() * vals[:, None, :]).sum(-1), weights)
        extra_ids = torch.where(valid, ids, torch.zeros_like(ids))
        extra_w = torch.where(valid & ~match.any(1), vals, torch.zeros_like(vals))  # not already in top-k
        return self.known_head.mix(torch.cat([idx, extra_ids], 1), torch.cat([new_w, extra_w], 1))

    # ---- convenience: full-sequence forward (reference / parity) ---------------------
    def forward(
        self,
        tokens: Tensor,
        positions: Tensor | None = None,
        steering: SteeringInputs | None = None,
        intervention: KnownIntervention | None = None,
    ) -> HeadsOutput:
        """Dense block-causal forward over whole sequences; heads on every position.

        Returns HeadsOutput with leading dims flattened to B*T.
        """
        b, t = tokens.shape
        if positions is None:
            positions = torch.arange(t, device=tokens.device).expand(b, t)
        attend = dense_block_causal_attend(positions, self.cfg.diff_block_size)
        h = self.hidden_states(tokens, positions, attend, steering)
        rows = None
        if intervention is not None:
            m = intervention.ids.shape[-1]
            intervention = KnownIntervention(
                intervention.ids[:, None, :].expand(b, t, m).reshape(b * t, m),
                intervention.values[:, None, :].expand(b, t, m).reshape(b * t, m),
            )
            rows = (intervention.ids >= 0).any(-1)
        return self.heads(h.reshape(b * t, -1), intervention, rows)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())  # tied weights counted once


def dense_block_causal_attend(positions: Tensor, block: int) -> AttendFn:
    """SDPA with a dense block-causal mask over absolute positions (reference path)."""
    blk = positions // block
    mask = (blk[:, :, None] >= blk[:, None, :])[:, None]  # (B, 1, T, T)

    def attend(_layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

    return attend
