"""Trainable LoRA adapters on ``cde.qwen3`` models, saved in the PEFT layout.

The model's projections (``cde.qwen3.model.Linear``) already compute a gated low-rank delta
from ``lora_A`` / ``lora_B`` tensors; training keeps the factors here as parameters and
hands the projections autograd views of them before each forward (``bind``), so the base
weights stay frozen and out of the optimizer. ``save`` writes ``adapter_config.json`` and
``adapter_model.safetensors`` exactly as PEFT names them, so ``cde.qwen3.loading.load_lora``
(and PEFT itself: tests/test_idlm_train.py) read the result.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.nn as nn
from safetensors.torch import save_file

from cde.qwen3.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, KEY_PREFIX
from cde.qwen3.model import PROJECTIONS, Qwen3Model


class TrainableLora(nn.Module):
    """LoRA factors for every projection of ``model`` named in ``targets`` (PEFT's init:
    A Kaiming-uniform, B zero, so the adapter starts as the identity)."""

    def __init__(self, model: Qwen3Model, rank: int, alpha: float, targets: tuple[str, ...] = PROJECTIONS,
                 seed: int = 0):
        super().__init__()
        self.rank, self.alpha, self.targets = rank, float(alpha), tuple(targets)
        self.scaling = self.alpha / rank
        self.names = [n for n in model.lora_modules() if n.rsplit(".", 1)[-1] in self.targets]
        mods = model.lora_modules()
        gen = torch.Generator().manual_seed(seed)
        dev = model.lm_head.weight.device
        self.a = nn.ParameterList()
        self.b = nn.ParameterList()
        for name in self.names:
            lin = mods[name]
            a = torch.empty(rank, lin.in_features)
            bound = 1.0 / math.sqrt(lin.in_features)   # kaiming_uniform_(a=sqrt(5)) as nn.Linear / PEFT
            a.uniform_(-bound, bound, generator=gen)
            self.a.append(nn.Parameter(a.to(dev)))
            self.b.append(nn.Parameter(torch.zeros(lin.out_features, rank, device=dev)))

    def bind(self, model: Qwen3Model) -> None:
        """Attach the factors to the model's projections (as autograd views: call before
        every forward that should train them)."""
        mods = model.lora_modules()
        for name, a, b in zip(self.names, self.a, self.b):
            mods[name].set_lora(a.view_as(a), b.view_as(b), self.scaling)

    def load_modules(self, modules: dict[str, tuple[torch.Tensor, torch.Tensor, float]]) -> None:
        """Start from existing factors of the same rank (``LoraAdapter.modules`` layout:
        name -> (A, B, scaling)), e.g. R-ISD from the truncated conversion adapter."""
        with torch.no_grad():
            for name, a, b in zip(self.names, self.a, self.b):
                src_a, src_b, scaling = modules[name]
                a.copy_(src_a.float())
                b.copy_(src_b.float() * (scaling / self.scaling))

    def modules(self) -> dict[str, tuple[torch.Tensor, torch.Tensor, float]]:
        return {n: (a.detach(), b.detach(), self.scaling) for n, a, b in zip(self.names, self.a, self.b)}

    def peft_state(self, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
        out = {}
        for name, a, b in zip(self.names, self.a, self.b):
            out[f"{KEY_PREFIX}{name}.lora_A.weight"] = a.detach().to("cpu", dtype).contiguous()
            out[f"{KEY_PREFIX}{name}.lora_B.weight"] = b.detach().to("cpu", dtype).contiguous()
        return out

    def peft_config(self) -> dict:
        return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": self.rank, "lora_alpha": self.alpha,
                "target_modules": sorted(self.targets), "lora_dropout": 0.0, "bias": "none",
                "fan_in_fan_out": False, "use_rslora": False, "use_dora": False, "modules_to_save": None,
                "init_lora_weights": True, "inference_mode": True, "base_model_name_or_path": None}

    def save(self, directory: str | Path, dtype: torch.dtype = torch.bfloat16) -> list[Path]:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        (directory / ADAPTER_CONFIG).write_text(json.dumps(self.peft_config(), indent=2) + "\n")
        save_file(self.peft_state(dtype), str(directory / ADAPTER_WEIGHTS))
        return [directory / ADAPTER_CONFIG, directory / ADAPTER_WEIGHTS]


def adapter_bytes(model: Qwen3Model, rank: int, targets: tuple[str, ...] = PROJECTIONS, bytes_per: int = 2) -> int:
    """Size of an adapter's tensors on disk (bf16 by default)."""
    n = sum(rank * (m.in_features + m.out_features) for name, m in model.lora_modules().items()
            if name.rsplit(".", 1)[-1] in targets)
    return n * bytes_per
