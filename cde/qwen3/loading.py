"""Load and save Qwen3 / SDAR checkpoints (HF ``config.json`` + safetensors) and LoRA adapters.

Weights go through ``cde.checkpoint`` (single file or sharded with an index, shape-checked,
memory-mapped). With ``tie_word_embeddings`` the checkpoint needs only
``model.embed_tokens.weight`` (``lm_head.weight``, if present, is shape-checked and
ignored, as transformers does); without it ``lm_head.weight`` is required.
"""

from __future__ import annotations

from pathlib import Path

import torch

from cde.checkpoint import CheckpointReader, load_into, save_checkpoint
from cde.qwen3.config import Qwen3Config
from cde.qwen3.lora import attach_lora, read_adapter
from cde.qwen3.model import Qwen3Model


def load_qwen3(model_dir: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
               *, strict: bool = True) -> Qwen3Model:
    """Build the model from ``model_dir/config.json`` and load its weights.

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
    return model.eval()


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
