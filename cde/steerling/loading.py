"""Load and save Steerling checkpoints (config.json + HF-style safetensors).

The LM head is tied to the token embedding: we write `transformer.tok_emb.weight` only and
accept checkpoints that also carry `transformer.lm_head.weight` (the public package's
`state_dict()` has both).
"""

from __future__ import annotations

from pathlib import Path

import torch

from cde.checkpoint import CheckpointReader, load_into, save_checkpoint
from cde.steerling.config import SteerlingConfig
from cde.steerling.model import SteerlingModel

TIED = {"transformer.lm_head.weight": "transformer.tok_emb.weight"}


def load_model(model_dir: str | Path, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
               ) -> SteerlingModel:
    """Build the model from `model_dir/config.json` and load its weights (shape-checked)."""
    cfg = SteerlingConfig.load(model_dir)
    with torch.device("meta"):
        model = SteerlingModel(cfg).to(dtype)
    with CheckpointReader(model_dir) as reader:
        load_into(model, reader, tied=TIED, strict=True, materialize=True, device=device)
    model.transformer.tok_emb.weight = model.transformer.lm_head.weight
    model.rebuild_rope(device)  # non-persistent buffers were built on meta
    return model.eval()


def save_model(model: SteerlingModel, model_dir: str | Path, *, max_shard_bytes: int | None = None) -> list[Path]:
    model.cfg.save(model_dir)
    state = {k: v for k, v in model.state_dict().items() if k not in TIED}
    return save_checkpoint(state, model_dir, max_shard_bytes=max_shard_bytes)
