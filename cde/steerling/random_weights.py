"""Random-weight Steerling models for benchmarks: 8B dims without a 16 GB checkpoint.

A *benchmark model directory* holds config.json, the tokenizer file and a checkpoint of only
the concept tables the steering and attribution services map (known-concept embeddings,
discovered coefficients and basis, the tied token embedding / LM head), all random.
The worker's `--random-weights SEED` builds every other weight at random on its device and
takes those tables from the directory, so the worker and the two services agree. A directory
whose checkpoint holds any other tensor is a real model and is refused: random weights never
replace trained ones silently.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from cde.checkpoint import CheckpointError, CheckpointReader, save_checkpoint
from cde.random_init import is_norm_weight
from cde.steerling.config import SteerlingConfig

KNOWN_EMBEDDING = "known_head.concept_embedding.weight"
DISC_COEF = "unknown_head.embedding_coef.weight"
DISC_BASIS = "unknown_head.embedding_basis.weight"
TOKEN_EMBEDDING = "transformer.tok_emb.weight"   # tied with the LM head
# What steering_svc and attribution_svc read from a checkpoint (and nothing else).
CONCEPT_TABLES = (KNOWN_EMBEDDING, DISC_COEF, DISC_BASIS, TOKEN_EMBEDDING)
WEIGHT_STD = 0.02


def fill_random(model: torch.nn.Module, seed: int, std: float = WEIGHT_STD) -> torch.nn.Module:
    """Random weights drawn on the model's device (an 8B model in seconds): norms at 1.
    Not `init_random`'s weights for the same seed: those are drawn on the CPU, which at 8B is
    the 16 GB detour this avoids."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if is_norm_weight(name):
                p.fill_(1.0)
            else:
                p.normal_(0.0, std)
    return model


def random_model(make, device: str, dtype: torch.dtype, seed: int = 0, tie=None):
    """A model with random weights: `make()` builds it; on the CPU its own init_random, elsewhere
    built on the meta device and filled in place on `device` (no 16 GB CPU detour at 8B).
    `tie(model)` re-ties shared weights that `to_empty` split."""
    if device == "cpu":
        return make().init_random(seed, std=0.05).to(dtype).eval()
    with torch.device("meta"):
        model = make()
    model = fill_random(model.to_empty(device=device).to(dtype), seed)
    if tie is not None:
        tie(model)
    model.rebuild_rope(device)
    return model.eval()


def tie_embeddings(model) -> None:
    model.transformer.tok_emb.weight = model.transformer.lm_head.weight


def write_benchmark_model_dir(directory: str | Path, cfg: SteerlingConfig, seed: int,
                              tokenizer_file: str | Path | None = None, dtype: torch.dtype = torch.bfloat16) -> Path:
    """config.json + random concept tables (+ a copy of `tokenizer_file`, e.g. cl100k_base.tiktoken)."""
    directory = Path(directory)
    cfg.save(directory, torch_dtype={torch.bfloat16: "bfloat16", torch.float32: "float32"}.get(dtype))
    gen = torch.Generator().manual_seed(seed)
    shapes = {KNOWN_EMBEDDING: (cfg.n_known_padded, cfg.n_embd),
              DISC_COEF: (cfg.n_discovered_padded, cfg.factorize_rank),
              DISC_BASIS: (cfg.n_embd, cfg.factorize_rank),
              TOKEN_EMBEDDING: (cfg.vocab_size, cfg.n_embd)}
    tables = {name: (torch.randn(shape, generator=gen) * WEIGHT_STD).to(dtype) for name, shape in shapes.items()}
    save_checkpoint(tables, directory)
    if tokenizer_file is not None:
        shutil.copyfile(tokenizer_file, directory / Path(tokenizer_file).name)
    return directory


def load_random_model(model_dir: str | Path, seed: int, *, dtype: torch.dtype = torch.float32,
                      device: str = "cpu"):
    """The worker's `--random-weights SEED`: random weights + the directory's concept tables.
    CheckpointError when the directory's checkpoint holds anything beyond CONCEPT_TABLES."""
    from cde.steerling.model import SteerlingModel

    cfg = SteerlingConfig.load(model_dir)
    with CheckpointReader(model_dir) as reader:
        extra = sorted(set(reader.names()) - set(CONCEPT_TABLES))
        if extra:
            raise CheckpointError(f"{model_dir} holds trained weights ({extra[0]}, ...): --random-weights "
                                  f"serves only a benchmark model directory (config + concept tables)")
        model = random_model(lambda: SteerlingModel(cfg), device, dtype, seed, tie_embeddings)
        state = model.state_dict()
        with torch.no_grad():
            for name in CONCEPT_TABLES:
                if name not in reader:
                    raise CheckpointError(f"missing tensor {name} in {model_dir}")
                target = state[name]
                if tuple(reader.shape(name)) != tuple(target.shape):
                    raise CheckpointError(f"{name}: expected shape {tuple(target.shape)}, "
                                          f"checkpoint has {reader.shape(name)}")
                target.copy_(reader.get(name, dtype=target.dtype))
    return model
