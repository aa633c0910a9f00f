"""Causal LMs in the Qwen3 / SDAR layout (I-DLM), plain PyTorch in the gpt-fast style.

Parameter names equal Hugging Face ``Qwen3ForCausalLM``'s (``model.embed_tokens.weight``,
``model.layers.N.self_attn.q_proj.weight``, ``model.layers.N.mlp.gate_proj.weight``,
``model.norm.weight``, ``lm_head.weight``...) so HF checkpoints load unchanged.

Architecture, computed as transformers computes it: pre-norm residual blocks; RMSNorm in
fp32, cast back to the input dtype *before* the weight multiply; QK-norm (RMSNorm over
head_dim) before RoPE; RoPE rotate-half on the full head dim, cos/sin computed in fp32 and
applied in the activation dtype; GQA; SwiGLU ``down(silu(gate(x)) * up(x))``; optional
tied LM head.

Attention is a pluggable function ``attend(layer, q, k, v) -> y`` so the same layers serve
the dense reference forward (below) and a paged engine. Every projection is a
:class:`Linear` that can carry a low-rank (LoRA) delta, applied per token through a 0/1
gate: R-ISD applies the adapter only at [MASK] positions (see ``cde/qwen3/lora.py``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from cde import random_init
from cde.norms import RMSNorm
from cde.fp8 import Fp8Linear
from cde.qwen3 import kernels
from cde.qwen3.config import Qwen3Config

# attend(layer_index, q (B,H,T,hd), k (B,KV,T,hd), v (B,KV,T,hd)) -> (B,H,T,hd).
# q and k are normed and rotated; the function owns masking (and any KV cache).
AttendFn = Callable[[int, Tensor, Tensor, Tensor], Tensor]

# The names of the projections LoRA can target, as PEFT spells them.
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class Linear(nn.Linear):
    """``nn.Linear`` plus an optional low-rank delta, gated per token.

    ``y = x W^T (+ b) + gate * scaling * (x A^T) B^T``. ``lora_A`` (r, in) and ``lora_B``
    (out, r) are non-persistent buffers: they follow ``.to()`` but stay out of
    ``state_dict()``, so base checkpoints load and save unchanged. ``gate`` is a bool
    tensor broadcastable to the output ((B, T, 1)); None applies the delta everywhere.
    Rows whose gate is off are exactly the base output (``torch.where``, not a multiply,
    so a non-finite delta cannot leak into them).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__(in_features, out_features, bias=bias)
        self.register_buffer("lora_A", None, persistent=False)
        self.register_buffer("lora_B", None, persistent=False)
        self.lora_scaling = 0.0

    def set_lora(self, a: Tensor, b: Tensor, scaling: float) -> None:
        r = a.shape[0]
        if a.shape != (r, self.in_features) or b.shape != (self.out_features, r):
            raise ValueError(f"LoRA shapes A {tuple(a.shape)}, B {tuple(b.shape)} do not fit a "
                             f"{self.in_features} -> {self.out_features} projection")
        self.lora_A, self.lora_B, self.lora_scaling = a, b, float(scaling)

    def clear_lora(self) -> None:
        self.lora_A, self.lora_B, self.lora_scaling = None, None, 0.0

    @property
    def has_lora(self) -> bool:
        return self.lora_A is not None

    def forward(self, x: Tensor, gate: Tensor | None = None) -> Tensor:
        y = F.linear(x, self.weight, self.bias)
        if self.lora_A is None:
            return y
        delta = F.linear(F.linear(x, self.lora_A), self.lora_B) * self.lora_scaling
        if gate is None:
            return y + delta
        return torch.where(gate, y + delta, y)


def rope_inv_freq(head_dim: int, theta: float) -> Tensor:
    """Inverse frequencies (head_dim/2,) fp32, on CPU, exactly as transformers builds them."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))


def rope_cos_sin(inv_freq: Tensor, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos/sin (B, 1, T, hd) for integer positions (B, T): fp32 angles, cast to ``dtype``."""
    freqs = positions.float()[..., None] * inv_freq  # (B, T, hd/2)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]


rotate_half = kernels.rotate_half
apply_rope = kernels.apply_rope


class Attention(nn.Module):
    def __init__(self, cfg: Qwen3Config):
        super().__init__()
        self.n_heads, self.n_kv, self.hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.q_proj = Linear(cfg.hidden, cfg.q_size, bias=cfg.attention_bias)
        self.k_proj = Linear(cfg.hidden, cfg.kv_size, bias=cfg.attention_bias)
        self.v_proj = Linear(cfg.hidden, cfg.kv_size, bias=cfg.attention_bias)
        self.o_proj = Linear(cfg.q_size, cfg.hidden, bias=cfg.attention_bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_eps, kernels.CAST_BEFORE_WEIGHT)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_eps, kernels.CAST_BEFORE_WEIGHT)
        self.kernels = kernels.EAGER
        # fused (weight, bias), or a module for e4m3 projections (cde/fp8.py), see fuse_projections
        self.qkv: tuple[Tensor, Tensor | None] | nn.Module | None = None

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, attend: Callable[[Tensor, Tensor, Tensor], Tensor],
                gate: Tensor | None) -> Tensor:
        b, t, _ = x.shape
        if self.qkv is not None and not (self.q_proj.has_lora or self.k_proj.has_lora or self.v_proj.has_lora):
            q, k, v = fused_linear(x, self.qkv).split([self.n_heads * self.hd, self.n_kv * self.hd,
                                                    self.n_kv * self.hd], dim=-1)
            q = q.view(b, t, self.n_heads, self.hd)
            k = k.view(b, t, self.n_kv, self.hd)
            v = v.view(b, t, self.n_kv, self.hd).transpose(1, 2)
        else:
            q = self.q_proj(x, gate).view(b, t, self.n_heads, self.hd)
            k = self.k_proj(x, gate).view(b, t, self.n_kv, self.hd)
            v = self.v_proj(x, gate).view(b, t, self.n_kv, self.hd).transpose(1, 2)
        q, k = self.kernels.qk_norm_rope(q, k, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, cos, sin)
        y = attend(q, k, v)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, self.n_heads * self.hd), gate)


class MLP(nn.Module):
    def __init__(self, cfg: Qwen3Config):
        super().__init__()
        self.gate_proj = Linear(cfg.hidden, cfg.intermediate)
        self.up_proj = Linear(cfg.hidden, cfg.intermediate)
        self.down_proj = Linear(cfg.intermediate, cfg.hidden)
        self.kernels = kernels.EAGER
        self.gate_up: Tensor | nn.Module | None = None   # fused weight (or e4m3 module), see fuse_projections

    def forward(self, x: Tensor, gate: Tensor | None) -> Tensor:
        if self.gate_up is not None and not (self.gate_proj.has_lora or self.up_proj.has_lora):
            g, u = fused_linear(x, self.gate_up).chunk(2, dim=-1)
            return self.down_proj(self.kernels.silu_mul(g, u), gate)
        return self.down_proj(self.kernels.silu_mul(self.gate_proj(x, gate), self.up_proj(x, gate)), gate)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: Qwen3Config):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden, cfg.rms_eps, kernels.CAST_BEFORE_WEIGHT)
        self.post_attention_layernorm = RMSNorm(cfg.hidden, cfg.rms_eps, kernels.CAST_BEFORE_WEIGHT)
        self.kernels = kernels.EAGER

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, attend, gate: Tensor | None) -> Tensor:
        kn, ln1, ln2 = self.kernels, self.input_layernorm, self.post_attention_layernorm
        a = self.self_attn(kn.rms_norm(x, ln1.weight, ln1.eps), cos, sin, attend, gate)
        x, h = kn.add_rms_norm(x, a, ln2.weight, ln2.eps)
        return x + self.mlp(h, gate)


class Backbone(nn.Module):
    """HF's ``Qwen3Model``: the ``model.*`` parameters."""

    def __init__(self, cfg: Qwen3Config):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.hidden, cfg.rms_eps, kernels.CAST_BEFORE_WEIGHT)


class Qwen3Model(nn.Module):
    """The causal LM (HF's ``Qwen3ForCausalLM`` / ``SDARForCausalLM``)."""

    def __init__(self, cfg: Qwen3Config):
        super().__init__()
        self.cfg = cfg
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.register_buffer("rope_inv_freq", rope_inv_freq(cfg.head_dim, cfg.rope_theta), persistent=False)

    @property
    def tied_weights(self) -> dict[str, str]:
        """alias -> source for ``cde.checkpoint.load_into``."""
        return {"lm_head.weight": "model.embed_tokens.weight"} if self.cfg.tie_word_embeddings else {}

    def init_random(self, seed: int, std: float = 0.02) -> Qwen3Model:
        """Random weights (normal(0, std), norm weights at 1) from a seeded generator (cde/random_init.py)."""
        return random_init.init_random(self, seed, std)

    def rebuild_rope(self, device: torch.device | str | None = None) -> None:
        """Recompute the RoPE inverse frequencies (after building on the meta device)."""
        self.rope_inv_freq = rope_inv_freq(self.cfg.head_dim, self.cfg.rope_theta).to(device)

    def _apply(self, fn, recurse=True):
        # .to(dtype) / .half() would round the fp32 RoPE frequencies: rebuild them, in fp32,
        # on whatever device the buffer went to.
        super()._apply(fn, recurse)
        self.rebuild_rope(self.rope_inv_freq.device)
        # fused projections (fuse_projections) are plain tensors the move did not touch, and the
        # separate weights were converted one by one: back to the separate projections
        for layer in self.model.layers:
            layer.self_attn.qkv = layer.mlp.gate_up = None
        return self

    def lora_modules(self) -> dict[str, Linear]:
        """Every projection that can carry LoRA, by its HF module name."""
        return {n: m for n, m in self.named_modules() if isinstance(m, Linear)}

    # ---- the transformer ----------------------------------------------------------------
    def hidden_states(self, tokens: Tensor, positions: Tensor, attend: AttendFn,
                      lora_gate: Tensor | None = None) -> Tensor:
        """Final hidden states (after ``model.norm``), (B, T, D).

        positions (B, T): absolute positions for RoPE (masking is ``attend``'s business).
        lora_gate (B, T) float/bool 0/1: apply the attached LoRA at the positions where it
        is 1; None applies it everywhere (plain PEFT semantics); without an attached LoRA
        it is ignored.
        """
        x = self.model.embed_tokens(tokens)
        cos, sin = rope_cos_sin(self.rope_inv_freq, positions, x.dtype)
        gate = None if lora_gate is None else (lora_gate != 0)[..., None]
        # DecoderLayer.forward's arithmetic, with each residual add fused with the RMSNorm that
        # reads its result (the next sublayer's, the next layer's input norm, finally model.norm)
        layers = self.model.layers
        first = layers[0].input_layernorm
        h = layers[0].kernels.rms_norm(x, first.weight, first.eps)
        for i, layer in enumerate(layers):
            kn, ln2 = layer.kernels, layer.post_attention_layernorm
            a = layer.self_attn(h, cos, sin, lambda q, k, v, i=i: attend(i, q, k, v), gate)
            x, h = kn.add_rms_norm(x, a, ln2.weight, ln2.eps)
            m = layer.mlp(h, gate)
            nxt = layers[i + 1].input_layernorm if i + 1 < len(layers) else self.model.norm
            x, h = kn.add_rms_norm(x, m, nxt.weight, nxt.eps)
        return h

    @torch.no_grad()
    def fuse_projections(self) -> None:
        """One GEMM for q/k/v and one for gate/up per layer (the HF layout keeps them apart: 7
        GEMMs per layer become 4, fewer and larger kernels at small batch). The separate
        weights become views into the fused tensors, so memory is unchanged and loading or
        copying weights afterwards still reaches both; a layer with a LoRA attached uses the
        separate projections (the adapters act on them). Call it on the model's final device
        and dtype (`.to()` would copy the views apart), for serving, not before saving."""
        for layer in self.model.layers:
            a, m = layer.self_attn, layer.mlp
            if a.qkv is None and isinstance(a.q_proj, Fp8Linear):   # e4m3 (cde/fp8.py): rows concatenate
                a.qkv = Fp8Linear.concat([a.q_proj, a.k_proj, a.v_proj])
                m.gate_up = Fp8Linear.concat([m.gate_proj, m.up_proj])
                continue
            if a.qkv is None:
                projs = (a.q_proj, a.k_proj, a.v_proj)
                w = torch.cat([p.weight for p in projs])
                bias = torch.cat([p.bias for p in projs]) if a.q_proj.bias is not None else None
                a.qkv = (w, bias)
                _view_params(projs, w, bias)
            if m.gate_up is None:
                m.gate_up = torch.cat([m.gate_proj.weight, m.up_proj.weight])
                _view_params((m.gate_proj, m.up_proj), m.gate_up, None)

    def use_kernels(self, kn: kernels.Kernels) -> None:
        """Run the layers' pointwise parts with `kn` (e.g. `kernels.compiled()`)."""
        for layer in self.model.layers:
            layer.kernels = layer.self_attn.kernels = layer.mlp.kernels = kn

    def logits(self, h: Tensor) -> Tensor:
        """LM head on hidden states (..., D) -> (..., V), in the model dtype.
        The logit at position i predicts token i + 1."""
        return self.lm_head(h)

    def forward(self, tokens: Tensor, positions: Tensor | None = None,
                lora_gate: Tensor | None = None) -> Tensor:
        """Dense causal forward over whole sequences: logits (B, T, V)."""
        b, t = tokens.shape
        if positions is None:
            positions = torch.arange(t, device=tokens.device).expand(b, t)
        return self.logits(self.hidden_states(tokens, positions, causal_attend, lora_gate))

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())  # tied weights counted once


def causal_attend(_layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """SDPA with a causal mask over sequence index (reference path, T_q == T_k)."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])


def masked_attend(mask: Tensor) -> AttendFn:
    """SDPA with an explicit bool mask (B, 1, T_q, T_k), True = may attend."""

    def attend(_layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])

    return attend


def fused_linear(x: Tensor, fused: tuple[Tensor, Tensor | None] | Tensor | nn.Module) -> Tensor:
    """x through a fused projection: a dense (weight, bias) or weight, or an e4m3 module."""
    if isinstance(fused, nn.Module):
        return fused(x)
    return F.linear(x, *fused) if isinstance(fused, tuple) else F.linear(x, fused)


def _view_params(projs, weight: Tensor, bias: Tensor | None) -> None:
    """Make each projection's weight (and bias) a view of its rows of the fused tensor."""
    start = 0
    for p in projs:
        n = p.out_features
        p.weight = nn.Parameter(weight[start:start + n], requires_grad=False)
        if bias is not None:
            p.bias = nn.Parameter(bias[start:start + n], requires_grad=False)
        start += n
