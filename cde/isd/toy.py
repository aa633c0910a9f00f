"""A hand-built Qwen3 model whose [MASK] positions are good drafters, for ISD tests.

A randomly initialised model is a useless drafter: its mask-position argmax almost never
equals the next clean argmax, so greedy ISD tests would only ever take the rejection path.
This model is built so that drafts are often right, and both paths get exercised:

    next token after position i  =  argmax( h(token at i + 1 - lag)  +  beta * noise(token at i) )

* one attention head attends exactly ``lag - 1`` positions back: q and k read only a
  constant part of every embedding, so after QK-norm they are fixed vectors, and k is q
  rotated by ``(lag - 1) * omega`` in every RoPE pair, so the score ``sum_p cos((j - i +
  lag - 1) omega_p)`` peaks at ``j = i - lag + 1`` (margin >= 0.56 * 22.6 logits for all
  distances up to 512, checked numerically);
* the value/output projections copy that token's code into a separate slice of the
  residual stream; the LM head maps it to the code's successor under a random
  permutation ``h`` of the non-mask ids, plus ``beta`` times a random function of the
  current token (so the current token sometimes changes the argmax).

A mask at absolute position t + j (j = 1 .. lag - 1 past the last clean token t) still
sees a clean token lag - 1 back, so it predicts the same ``h(.)`` term as the clean
position would, and disagrees only through the ``beta`` term. With stride N <= lag, whole
draft windows are often accepted; with N > lag, later drafts read a mask lag - 1 back and
are mostly rejected. The MLP is zero. Hidden 64 = [constant 8 | current code 28 |
copied code 28]; head_dim 32.
"""

from __future__ import annotations

import torch

from cde.qwen3.config import Qwen3Config
from cde.qwen3.model import Qwen3Model

_CONST, _CUR, _COPY = slice(0, 8), slice(8, 36), slice(36, 64)


def lag_config(vocab: int = 64) -> Qwen3Config:
    """1 layer, 1 head (head_dim 32), hidden 64; the mask is the last id; no BOS/EOS."""
    return Qwen3Config(n_layers=1, hidden=64, n_heads=1, n_kv_heads=1, head_dim=32, intermediate=32,
                       vocab_size=vocab, mask_token_id=vocab - 1, bos_token_id=None, eos_token_ids=(),
                       max_positions=512)


def lag_model(seed: int, lag: int = 4, vocab: int = 64, beta: float = 1.0, sharpness: float = 8.0,
              logit_scale: float = 20.0, dtype: torch.dtype = torch.float64) -> Qwen3Model:
    """The model described in the module docstring (weights from a seeded generator)."""
    if lag < 2:
        raise ValueError("lag must be >= 2")
    if vocab < 3:
        raise ValueError("vocab must be >= 3")
    cfg = lag_config(vocab)
    model = Qwen3Model(cfg).to(torch.float64)
    gen = torch.Generator().manual_seed(seed)
    f64 = torch.float64
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0 if name.endswith("norm.weight") else 0.0)
        code = torch.nn.functional.normalize(torch.randn(vocab, 28, generator=gen, dtype=f64), dim=-1) * 4.0
        emb = model.model.embed_tokens.weight
        emb[:, _CONST] = 2.0
        emb[:, _CUR] = code
        attn = model.model.layers[0].self_attn
        omega = model.rope_inv_freq.to(f64)  # (16,): pair p = dims (p, p + 16) in rotate-half layout
        q_dir = torch.cat([torch.ones(16, dtype=f64), torch.zeros(16, dtype=f64)])
        k_dir = torch.cat([torch.cos((lag - 1) * omega), torch.sin((lag - 1) * omega)])
        attn.q_proj.weight[:, _CONST] = q_dir[:, None] / 8
        attn.k_proj.weight[:, _CONST] = k_dir[:, None] / 8
        attn.q_norm.weight.fill_(sharpness)
        attn.k_norm.weight.fill_(sharpness)
        attn.v_proj.weight[0:28, _CUR] = torch.eye(28, dtype=f64)
        attn.o_proj.weight[_COPY, 0:28] = torch.eye(28, dtype=f64)
        succ = torch.randperm(vocab - 1, generator=gen)  # h(x) = succ[x] for non-mask x
        head = torch.zeros(vocab, 28, dtype=f64)
        head[succ] = code[: vocab - 1]  # row y holds the code of the x with h(x) = y
        noise = torch.randn(vocab, 28, generator=gen, dtype=f64)
        model.lm_head.weight[:, _COPY] = head * (logit_scale / 4)
        model.lm_head.weight[:, _CUR] = noise * (beta * logit_scale / 4)
        model.lm_head.weight[vocab - 1] = 0.0  # the mask id is never a likely output
    return model.to(dtype).eval()
