"""Steerling model configuration and presets.

One frozen dataclass describes the transformer, the two concept heads and the special
token ids the decoder needs. `config.json` uses the public package's layout (model fields
at the top level, a `concept` object, `vocab_size`, `interpretable`, `instruct`) so a
checkpoint we write can be read by Guide Labs' loader and vice versa; our own extras live
under a `cde` key.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


def pad_to_multiple(n: int, multiple: int) -> int:
    return ((n + multiple - 1) // multiple) * multiple


@dataclass(frozen=True)
class SteerlingConfig:
    # Transformer
    n_layers: int = 32
    n_embd: int = 4096
    n_head: int = 32
    n_kv_heads: int = 4
    mlp_ratio: int = 4
    vocab_size: int = 100_352          # embedding rows (padded); tied with the LM head
    block_size: int = 4096             # max context
    diff_block_size: int = 64          # diffusion block = attention block = KV page
    rope_base: float = 500_000.0
    norm_eps: float = 1e-5
    clip_qkv: float = 10.0
    # Concept heads
    n_known: int = 33_732
    n_discovered: int = 101_196
    pad_multiple: int = 16
    factorize_rank: int = 256
    topk_known: int = 32
    topk_discovered: int = 128
    concept_chunk: int = 4096          # concepts scored per pass (bounds head memory)
    # Tokens (Steerling instruct layout by default)
    eos_id: int = 100_257
    pad_id: int = 100_277
    bos_id: int = 100_278
    endofchunk_id: int = 100_279
    mask_id: int = 100_280
    eot_id: int | None = 100_283
    instruct: bool = True
    tokenizer: dict[str, Any] = field(default_factory=lambda: {"kind": "cl100k", "bpe_file": "cl100k_base.tiktoken"})

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        if self.n_head % self.n_kv_heads:
            raise ValueError(f"n_head ({self.n_head}) must be divisible by n_kv_heads ({self.n_kv_heads})")
        if self.head_dim % 2:
            raise ValueError("head dim must be even for rotary embeddings")

    # Derived sizes
    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def intermediate_size(self) -> int:
        return self.mlp_ratio * self.n_embd

    @property
    def n_known_padded(self) -> int:
        return pad_to_multiple(self.n_known, self.pad_multiple)

    @property
    def n_discovered_padded(self) -> int:
        return pad_to_multiple(self.n_discovered, self.pad_multiple)

    @property
    def default_inject_layer(self) -> int:
        return self.n_layers // 2

    def replace(self, **changes: Any) -> SteerlingConfig:
        return dataclasses.replace(self, **changes)

    # config.json in the public package's layout
    def to_json_dict(self) -> dict[str, Any]:
        return {
            "model_type": "causal_diffusion",
            "interpretable": True,
            "instruct": self.instruct,
            "vocab_size": self.vocab_size,
            "n_layers": self.n_layers,
            "n_head": self.n_head,
            "n_embd": self.n_embd,
            "block_size": self.block_size,
            "n_kv_heads": self.n_kv_heads,
            "diff_block_size": self.diff_block_size,
            "use_rms_norm": True,
            "norm_eps": self.norm_eps,
            "norm_order": "post",
            "use_qk_norm": True,
            "use_rope": True,
            "rope_base": self.rope_base,
            "rope_full_precision": True,
            "mlp_type": "swiglu",
            "mlp_ratio": self.mlp_ratio,
            "intermediate_size": None,
            "use_bias": False,
            "clip_qkv": self.clip_qkv,
            "weight_sharing": True,
            "concept": {
                "n_concepts": self.n_known,
                "n_unknown_concepts": self.n_discovered,
                "concept_dim": self.n_embd,
                "topk_known": self.topk_known,
                "topk_known_features": self.topk_known,
                "use_unknown": True,
                "factorize_unknown": True,
                "factorize_rank": self.factorize_rank,
                "unknown_topk": self.topk_discovered,
                "use_epsilon_correction": True,
                "block_size": self.concept_chunk,
                "pad_multiple": self.pad_multiple,
                "apply_topk_to_unknown": True,
                "topk_on_logits": False,
            },
            "cde": {
                "eos_id": self.eos_id,
                "pad_id": self.pad_id,
                "bos_id": self.bos_id,
                "endofchunk_id": self.endofchunk_id,
                "mask_id": self.mask_id,
                "eot_id": self.eot_id,
                "tokenizer": self.tokenizer,
            },
        }

    @classmethod
    def from_json_dict(cls, data: dict[str, Any]) -> SteerlingConfig:
        concept = data.get("concept") or {}
        extra = data.get("cde") or {}
        if data.get("norm_order", "post") != "post" or data.get("mlp_type", "swiglu") != "swiglu":
            raise ValueError("only post-norm SwiGLU Steerling checkpoints are supported")
        if data.get("intermediate_size") not in (None, data.get("mlp_ratio", 4) * data["n_embd"]):
            raise ValueError("intermediate_size other than mlp_ratio * n_embd is not supported")
        kw: dict[str, Any] = dict(
            n_layers=data["n_layers"], n_embd=data["n_embd"], n_head=data["n_head"],
            n_kv_heads=data.get("n_kv_heads") or data["n_head"], mlp_ratio=data.get("mlp_ratio", 4),
            vocab_size=data["vocab_size"], block_size=data.get("block_size", 4096),
            diff_block_size=data.get("diff_block_size", 64), rope_base=data.get("rope_base", 500000.0),
            norm_eps=data.get("norm_eps", 1e-5), clip_qkv=data.get("clip_qkv", 10.0),
            n_known=concept.get("n_concepts", 33732), n_discovered=concept.get("n_unknown_concepts", 101196),
            pad_multiple=concept.get("pad_multiple", 16), factorize_rank=concept.get("factorize_rank", 256),
            topk_known=concept.get("topk_known", 32), topk_discovered=concept.get("unknown_topk", 128),
            concept_chunk=concept.get("block_size", 4096), instruct=data.get("instruct", True),
        )
        for key in ("eos_id", "pad_id", "bos_id", "endofchunk_id", "mask_id", "eot_id", "tokenizer"):
            if key in extra:
                kw[key] = extra[key]
        if "eot_id" not in extra and not kw["instruct"]:
            kw["eot_id"] = None
        return cls(**kw)

    def save(self, directory: str | Path) -> Path:
        path = Path(directory) / "config.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json_dict(), indent=2) + "\n")
        return path

    @classmethod
    def load(cls, directory: str | Path) -> SteerlingConfig:
        path = Path(directory)
        path = path / "config.json" if path.is_dir() else path
        if not path.exists():
            raise FileNotFoundError(f"model config not found: {path}")
        return cls.from_json_dict(json.loads(path.read_text()))


# The published Steerling-8B (instruct vocabulary, 8,392,069,120 parameters).
STEERLING_8B = SteerlingConfig()

# A model small enough for CPU tests and the local demo. Its vocabulary is the
# self-contained byte tokenizer's (264 ids, padded to 320).
TINY = SteerlingConfig(
    n_layers=4, n_embd=128, n_head=4, n_kv_heads=2, vocab_size=320, block_size=1024,
    n_known=48, n_discovered=96, factorize_rank=16, topk_known=8, topk_discovered=16,
    concept_chunk=32,
    eos_id=256, pad_id=257, bos_id=258, endofchunk_id=259, mask_id=260, eot_id=263,
    instruct=True, tokenizer={"kind": "byte"},
)

PRESETS: dict[str, SteerlingConfig] = {"steerling-8b": STEERLING_8B, "tiny": TINY}


def preset(name: str) -> SteerlingConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; known: {', '.join(sorted(PRESETS))}") from None
