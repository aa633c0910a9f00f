"""Load and save Qwen3 / SDAR checkpoints (HF ``config.json`` + safetensors) and LoRA adapters.

Weights go through ``cde.checkpoint`` (single file or sharded with an index, shape-checked,
memory-mapped). With ``tie_word_embeddings`` the checkpoint needs only
``model.embed_tokens.weight`` (``lm_head.weight``, if present, is shape-checked and
ignored, as transformers does); without it ``lm_head.weight`` is required.

A directory may also list PEFT adapters (subdirectories) to fold into the weights at load:
``"cde_merge_adapters": ["conversion"]`` in its ``config.json``. ``models/idlm-small`` uses it:
its ``model.safetensors`` is the AR base, ``conversion/`` the I-DLM conversion LoRA (merged:
the served model), ``risd/`` the gated R-ISD adapter (attached with ``load_lora``).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from cde.checkpoint import CheckpointReader, load_into, save_checkpoint
from cde.qwen3.config import Qwen3Config
from cde.qwen3.lora import attach_lora, merge_lora, read_adapter
from cde.qwen3.model import Qwen3Model


def load_qwen3(model_dir: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
               *, strict: bool = True, merge_adapters: bool = True) -> Qwen3Model:
    """Build the model from ``model_dir/config.json`` and load its weights.

    merge_adapters: fold in the adapters the config lists under ``cde_merge_adapters``
    (False: the weights of ``model.safetensors`` alone, e.g. the AR base of idlm-small).

    Raises FileNotFoundError (no config.json), ValueError (unsupported config) or
    CheckpointError (missing/corrupt files, missing or mis-shaped tensors, and with
    ``strict`` tensors the model does not have).
    """
    cfg = Qwen3Config.load(model_dir)
    with torch.device("meta"):
        model = Qwen3Model(cfg).to(dtype)
    with CheckpointReader(model_dir) as reader:
        load_into(model, reader, tied=model.tied_weights, strict=strict, materialize=True, device=device)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.rebuild_rope(device)  # non-persistent buffer, built on meta
    if merge_adapters:
        for sub in merged_adapter_dirs(model_dir):
            merge_lora(model, read_adapter(sub, model))
    return model.eval()


def merged_adapter_dirs(model_dir: str | Path) -> list[Path]:
    """The adapter subdirectories ``config.json`` lists under ``cde_merge_adapters``, checked:
    plain names of existing subdirectories (never a path out of the model directory)."""
    model_dir = Path(model_dir)
    names = json.loads((model_dir / "config.json").read_text()).get("cde_merge_adapters") or []
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise ValueError(f"{model_dir / 'config.json'}: cde_merge_adapters must be a list of subdirectory names")
    out = []
    for name in names:
        if not name or name in (".", "..") or "/" in name or "\\" in name:
            raise ValueError(f"{model_dir / 'config.json'}: cde_merge_adapters entry {name!r} is not a plain "
                             f"subdirectory name")
        sub = model_dir / name
        if not sub.is_dir():
            raise FileNotFoundError(f"adapter directory listed in cde_merge_adapters not found: {sub}")
        out.append(sub)
    return out


def load_lora(adapter_dir: str | Path, model: Qwen3Model) -> Qwen3Model:
    """Read a PEFT adapter directory, check it against ``model`` and attach it (in place).

    Nothing is attached if any check fails. The adapter's tensors take the dtype and
    device of the projections they adapt.
    """
    return attach_lora(model, read_adapter(adapter_dir, model))


def save_qwen3(model: Qwen3Model, model_dir: str | Path, *, max_shard_bytes: int | None = None) -> list[Path]:
    """Write ``config.json`` and the weights in the HF layout (no LoRA; tied head once)."""
    model.cfg.save(model_dir)
    tied = model.tied_weights
    state = {k: v for k, v in model.state_dict().items() if k not in tied}
    return save_checkpoint(state, model_dir, max_shard_bytes=max_shard_bytes)
