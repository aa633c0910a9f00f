"""LoRA adapters in the PEFT layout, attached as gated low-rank deltas (R-ISD).

An adapter directory holds ``adapter_config.json`` (``r``, ``lora_alpha``,
``target_modules``, optional ``use_rslora``, ``rank_pattern``, ``alpha_pattern``,
``layers_to_transform``, ``exclude_modules``) and ``adapter_model.safetensors`` with
``base_model.model.<module>.lora_A.weight`` (r, in) and ``.lora_B.weight`` (out, r) per
targeted module, e.g. ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``.

A targeted projection computes ``x W^T + gate * scaling * (x A^T) B^T`` with
``scaling = alpha / r`` (``alpha / sqrt(r)`` with rsLoRA) and a per-token 0/1 gate
(``Qwen3Model.hidden_states(..., lora_gate=...)``); gate None is plain PEFT. Which
modules the adapter must cover follows PEFT's own matching rules, so a tensor missing
from the file is reported by name. Variants that change the computation (DoRA, LoRA
bias, ``modules_to_save``, ``fan_in_fan_out``, aLoRA...) are refused.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from cde.checkpoint import CheckpointError, CheckpointReader
from cde.qwen3.model import Linear, Qwen3Model

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
KEY_PREFIX = "base_model.model."

# adapter_config.json keys that must be absent/false/empty: each changes what the adapter computes.
_UNSUPPORTED = ("use_dora", "lora_bias", "modules_to_save", "target_parameters", "trainable_token_indices",
                "layer_replication", "alora_invocation_tokens", "fan_in_fan_out", "use_qalora", "arrow_config")


@dataclass(frozen=True)
class LoraSettings:
    """The parts of ``adapter_config.json`` that decide shapes and scaling."""

    r: int
    lora_alpha: float
    target_modules: tuple[str, ...] | str
    use_rslora: bool = False
    rank_pattern: dict[str, int] = field(default_factory=dict)
    alpha_pattern: dict[str, float] = field(default_factory=dict)
    layers_to_transform: tuple[int, ...] | None = None
    layers_pattern: tuple[str, ...] | None = None
    exclude_modules: tuple[str, ...] | str | None = None

    @classmethod
    def from_json(cls, data: dict[str, Any], where: str = ADAPTER_CONFIG) -> LoraSettings:
        peft_type = data.get("peft_type", "LORA")
        if str(peft_type).upper() != "LORA":
            raise ValueError(f"{where}: peft_type {peft_type!r} is not LORA")
        for key in _UNSUPPORTED:
            if data.get(key):
                raise ValueError(f"{where}: {key}={data[key]!r} is not supported")
        if data.get("bias", "none") != "none":
            raise ValueError(f"{where}: bias={data['bias']!r} is not supported (only 'none')")
        r = data.get("r")
        if not isinstance(r, int) or isinstance(r, bool) or r <= 0:
            raise ValueError(f"{where}: r must be a positive int, got {r!r}")
        alpha = data.get("lora_alpha", 8)
        if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
            raise ValueError(f"{where}: lora_alpha must be a number, got {alpha!r}")
        targets = data.get("target_modules")
        if not targets:
            raise ValueError(f"{where}: target_modules is missing or empty")
        targets = targets if isinstance(targets, str) else tuple(targets)
        ltt = data.get("layers_to_transform")
        if ltt is not None and not isinstance(ltt, list):
            ltt = [ltt]
        lp = data.get("layers_pattern")
        if lp is not None and not isinstance(lp, list):
            lp = [lp]
        ex = data.get("exclude_modules")
        ex = ex if (ex is None or isinstance(ex, str)) else tuple(ex)
        return cls(r=r, lora_alpha=float(alpha), target_modules=targets,
                   use_rslora=bool(data.get("use_rslora", False)),
                   rank_pattern=dict(data.get("rank_pattern") or {}),
                   alpha_pattern=dict(data.get("alpha_pattern") or {}),
                   layers_to_transform=tuple(int(i) for i in ltt) if ltt else None,
                   layers_pattern=tuple(lp) if lp else None, exclude_modules=ex or None)

    # ---- PEFT's matching rules (peft.tuners.tuners_utils.check_target_module_exists) -----
    def targets(self, name: str, linear_names: set[str]) -> bool:
        """Does the adapter target module ``name`` (a module of the base model)?"""
        ex = self.exclude_modules
        if ex is not None:
            if isinstance(ex, str):
                if re.fullmatch(ex, name):
                    return False
            elif name in ex or any(name.endswith(f".{e}") for e in ex):
                return False
        tm = self.target_modules
        if tm == "all-linear":  # every linear layer but the output layer
            return name in linear_names
        if isinstance(tm, str):
            return re.fullmatch(tm, name) is not None
        if name in tm:
            return True
        if not any(name.endswith(f".{t}") for t in tm):
            return False
        if self.layers_to_transform is None:
            return True
        match = None
        if not self.layers_pattern:
            match = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", name)
        else:
            for pattern in self.layers_pattern:
                match = re.match(rf"(?:^|.*?\.){pattern}\.(?P<idx>\d+)\.", name)
                if match is not None:
                    break
        return match is not None and int(match.group("idx")) in self.layers_to_transform

    def rank_and_scaling(self, name: str) -> tuple[int, float]:
        r = self.r
        alpha = self.lora_alpha
        for key, value in self.rank_pattern.items():
            if re.match(rf"(.*\.)?({key})$", name):
                r = int(value)
                break
        for key, value in self.alpha_pattern.items():
            if re.match(rf"(.*\.)?({key})$", name):
                alpha = float(value)
                break
        return r, (alpha / math.sqrt(r) if self.use_rslora else alpha / r)


@dataclass
class LoraAdapter:
    """A validated adapter: module name -> (A (r, in), B (out, r), scaling)."""

    path: Path
    settings: LoraSettings
    modules: dict[str, tuple[Tensor, Tensor, float]]


def read_adapter_settings(adapter_dir: str | Path) -> LoraSettings:
    path = Path(adapter_dir) / ADAPTER_CONFIG
    if not path.is_file():
        raise FileNotFoundError(f"LoRA adapter config not found: {path}")
    try:
        data = json.loads(path.read_text())
    except ValueError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from e
    return LoraSettings.from_json(data, str(path))


def read_adapter(adapter_dir: str | Path, model: Qwen3Model) -> LoraAdapter:
    """Read and check an adapter against ``model`` (names, shapes); nothing is attached.

    Raises FileNotFoundError (config or weights file absent), ValueError (unsupported
    config) or CheckpointError (missing, unexpected or mis-shaped tensors, named).
    Tensors come back in the dtype and on the device of the projection they adapt.
    """
    adapter_dir = Path(adapter_dir)
    settings = read_adapter_settings(adapter_dir)
    weights = adapter_dir / ADAPTER_WEIGHTS
    if not weights.is_file():
        if (adapter_dir / "adapter_model.bin").is_file():
            raise CheckpointError(f"{adapter_dir}: only {ADAPTER_WEIGHTS} is supported, found adapter_model.bin")
        raise FileNotFoundError(f"LoRA adapter weights not found: {weights}")

    projections = model.lora_modules()
    unsupported = sorted(n for n, m in model.named_modules()
                         if n and n not in projections and settings.targets(n, set(projections)))
    if unsupported:
        raise ValueError(f"{adapter_dir}: adapter targets {unsupported[0]}, which cannot carry LoRA here "
                         f"(only {', '.join(sorted({n.rsplit('.', 1)[-1] for n in projections}))})")
    targeted = [n for n in projections if settings.targets(n, set(projections))]
    if not targeted:
        raise ValueError(f"{adapter_dir}: target_modules {settings.target_modules!r} match no projection of the model")

    modules: dict[str, tuple[Tensor, Tensor, float]] = {}
    with CheckpointReader(weights) as reader:
        expected: set[str] = set()
        for name in targeted:
            lin: Linear = projections[name]
            r, scaling = settings.rank_and_scaling(name)
            key_a = f"{KEY_PREFIX}{name}.lora_A.weight"
            key_b = f"{KEY_PREFIX}{name}.lora_B.weight"
            pair = []
            for key, shape in ((key_a, (r, lin.in_features)), (key_b, (lin.out_features, r))):
                expected.add(key)
                if key not in reader:
                    raise CheckpointError(f"{weights}: missing LoRA tensor {key} (expected shape {shape})")
                got = reader.shape(key)
                if got != shape:
                    raise CheckpointError(f"{weights}: {key}: expected shape {shape}, adapter has {got}")
                pair.append(reader.get(key, dtype=lin.weight.dtype, device=lin.weight.device).clone())
            modules[name] = (pair[0], pair[1], scaling)
        extra = [n for n in reader.names() if n not in expected]
        if extra:
            more = f" (and {len(extra) - 5} more)" if len(extra) > 5 else ""
            raise CheckpointError(f"{weights}: {len(extra)} unexpected tensor(s) for this model and config: "
                                  f"{', '.join(extra[:5])}{more}")
    return LoraAdapter(adapter_dir, settings, modules)


def attach_lora(model: Qwen3Model, adapter: LoraAdapter) -> Qwen3Model:
    """Attach ``adapter`` (replacing any adapter already attached)."""
    projections = model.lora_modules()
    missing = [n for n in adapter.modules if n not in projections]
    if missing:
        raise ValueError(f"adapter module {missing[0]} is not a projection of this model")
    detach_lora(model)
    for name, (a, b, scaling) in adapter.modules.items():
        projections[name].set_lora(a, b, scaling)
    return model


@torch.no_grad()
def merge_lora(model: Qwen3Model, adapter: LoraAdapter) -> Qwen3Model:
    """Fold ``adapter`` into the base weights, ungated (PEFT's ``merge_and_unload``):
    ``W += scaling * B A``, summed in float32 and rounded once to the weight's dtype. The
    model then computes the adapted function with no LoRA attached (fused projections,
    graphs and every engine path unchanged)."""
    projections = model.lora_modules()
    missing = [n for n in adapter.modules if n not in projections]
    if missing:
        raise ValueError(f"adapter module {missing[0]} is not a projection of this model")
    for name, (a, b, scaling) in adapter.modules.items():
        w = projections[name].weight
        w.copy_((w.float() + scaling * (b.float() @ a.float())).to(w.dtype))
    return model


def detach_lora(model: Qwen3Model) -> Qwen3Model:
    """Remove any attached adapter: the model computes the base function again."""
    for lin in model.lora_modules().values():
        lin.clear_lora()
    return model


def attached_modules(model: Qwen3Model) -> list[str]:
    return [n for n, m in model.lora_modules().items() if m.has_lora]
