"""Random tiny models several test modules build: the ``tiny`` Qwen3 preset with an EOS that
wins now and then, the toy lag model with an EOS on a known step, and a random LoRA adapter.
Every builder takes its seed explicitly (a test's ``seed`` fixture, or a fixed one)."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from cde.isd.decoder import generate_ar_batch
from cde.isd.toy import lag_model
from cde.qwen3.config import preset
from cde.qwen3.lora import LoraAdapter, LoraSettings, attach_lora
from cde.qwen3.model import PROJECTIONS, Qwen3Model

PROBE = [1, 2, 3]   # the prompt whose greedy run stopping_lag_model ends with EOS


def tiny_model(seed: int) -> Qwen3Model:
    """The random ``tiny`` Qwen3 preset in float64, its EOS row scaled up so some requests stop early."""
    model = Qwen3Model(preset("tiny")).init_random(seed).double().eval()
    with torch.no_grad():
        model.lm_head.weight[model.cfg.eos_token_ids[0]] *= 3.0  # EOS wins now and then: early stops
    return model


def stopping_lag_model(seed: int) -> Qwen3Model:
    """lag_model with an EOS id: the 11th greedy token after PROBE, so PROBE's requests stop early
    (mid-window for ISD: the tokens after it in the same step are cut)."""
    model = lag_model(seed, lag=4, vocab=64, beta=1.0)
    eos = generate_ar_batch(model, [PROBE], 11)[0].tokens[-1]
    model.cfg = model.cfg.replace(eos_token_ids=(eos,))
    return model


def random_lora(model: Qwen3Model, seed: int, scale: float, rank: int = 4) -> Qwen3Model:
    """Attach a random adapter to every projection (B non-zero, unlike PEFT's init)."""
    gen = torch.Generator().manual_seed(seed)
    dtype = model.lm_head.weight.dtype
    modules = {}
    for name, lin in model.lora_modules().items():
        a = torch.randn(rank, lin.in_features, generator=gen, dtype=torch.float64) / math.sqrt(lin.in_features)
        b = torch.randn(lin.out_features, rank, generator=gen, dtype=torch.float64) * scale
        modules[name] = (a.to(dtype), b.to(dtype), 2.0)
    settings = LoraSettings(r=rank, lora_alpha=2.0 * rank, target_modules=tuple(PROJECTIONS))
    return attach_lora(model, LoraAdapter(Path("random"), settings, modules))
