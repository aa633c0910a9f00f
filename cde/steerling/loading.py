"""Load and save Steerling checkpoints (config.json + HF-style safetensors).

(The tokenizer that goes with a config: `cde.steerling.tokenizer.load_model_tokenizer`.)

The LM head is tied to the token embedding, and checkpoints spell the pair either way: the
published directory (the package's converter) keeps `transformer.tok_emb.weight` only,
`safetensors.torch.save_model` keeps `transformer.lm_head.weight` only, the package's
`state_dict()` has both. All three load; if both are present they must be equal. We write
the published spelling, sharded past 5 GiB like the converter.
"""

from __future__ import annotations

from pathlib import Path

import torch

from cde.checkpoint import CheckpointError, CheckpointReader, load_into, save_checkpoint
from cde.steerling.config import SteerlingConfig
from cde.steerling.model import SteerlingModel

TOK_EMB = "transformer.tok_emb.weight"
LM_HEAD = "transformer.lm_head.weight"
TIED = {LM_HEAD: TOK_EMB}
SHARD_BYTES = 5 * 1024 ** 3  # the converter's shard size

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def tied_spelling(reader: CheckpointReader) -> dict[str, str]:
    """alias -> source for `load_into`: the source is whichever of the pair the file holds."""
    has_emb, has_head = TOK_EMB in reader, LM_HEAD in reader
    if not has_emb and not has_head:
        raise CheckpointError(f"missing tensor {TOK_EMB} (or its tied twin {LM_HEAD}) in {reader.path}")
    if has_emb and has_head:
        # the package would silently take lm_head; two different tables mean a broken file
        if reader.shape(TOK_EMB) == reader.shape(LM_HEAD) and not torch.equal(reader.get(TOK_EMB), reader.get(LM_HEAD)):
            raise CheckpointError(f"{reader.path}: {TOK_EMB} and {LM_HEAD} differ, but the model ties them")
    return TIED if has_emb else {TOK_EMB: LM_HEAD}


def embedding_name(reader: CheckpointReader) -> str:
    """The name under which `reader` holds the (tied) token embedding / LM head table (the
    services that map it read it under either spelling; `load_model` checks the pair)."""
    if TOK_EMB in reader:
        return TOK_EMB
    if LM_HEAD in reader:
        return LM_HEAD
    raise CheckpointError(f"missing tensor {TOK_EMB} (or its tied twin {LM_HEAD}) in {reader.path}")


def load_model(model_dir: str | Path, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
               ) -> SteerlingModel:
    """Build the model from `model_dir/config.json` and load its weights (shape-checked)."""
    cfg = SteerlingConfig.load(model_dir)
    with torch.device("meta"):
        model = SteerlingModel(cfg).to(dtype)
    with CheckpointReader(model_dir) as reader:
        load_into(model, reader, tied=tied_spelling(reader), strict=True, materialize=True, device=device)
    model.transformer.tok_emb.weight = model.transformer.lm_head.weight
    model.rebuild_rope(device)  # non-persistent buffers were built on meta
    return model.eval()


def save_model(model: SteerlingModel, model_dir: str | Path, *, max_shard_bytes: int | None = SHARD_BYTES,
               ) -> list[Path]:
    """Write the distributed layout: flat config.json + weights without the tied LM head."""
    dtype = model.transformer.tok_emb.weight.dtype
    model.cfg.save(model_dir, torch_dtype=_DTYPE_NAMES.get(dtype))
    state = {k: v for k, v in model.state_dict().items() if k not in TIED}
    return save_checkpoint(state, model_dir, max_shard_bytes=max_shard_bytes)

