"""Steerling model configuration, presets, and `config.json` in the layouts Guide Labs uses.

One frozen dataclass describes the transformer, the two concept heads and the special token
ids the decoder needs.

`config.json` layouts read (see `from_json_dict`):

* **distributed** (`"model_type": "steerling"`): the flat file of the published Steerling-8B
  directory, as the public package's Hugging Face writer makes it: architecture keys, token
  ids (`*_token_id`; `start_header_id` / `end_header_id` / `eot_id` only for the instruct
  model), `vocab_size` and the concept keys all at the top level. This is what `save` writes.
* **nested** (`"model_type": "causal_diffusion"`): the package's weight converter's file
  (concept keys under `"concept"`), also the layout this project wrote before; its older
  files keep the token ids under a `"cde"` object.

Every key a file has is read, or refused with an error naming it; a key the file lacks
takes the public package's default (its `CausalDiffusionConfig` / `ConceptConfig`), except
`vocab_size` and the five base token ids, which are required. Our only extra is the
tokenizer spec, under `"cde": {"tokenizer": ...}`, written only when it is not the default
cl100k file.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DISTRIBUTED_MODEL_TYPE = "steerling"
NESTED_MODEL_TYPE = "causal_diffusion"
ARCHITECTURE = "SteerlingForCausalLM"
DEFAULT_BPE_FILE = "cl100k_base.tiktoken"
ENGINE_BLOCK = 64  # the serving engine's KV page and diffusion block


class ConfigError(ValueError):
    """A config.json this server cannot serve; the message names the offending field."""


def pad_to_multiple(n: int, multiple: int) -> int:
    return ((n + multiple - 1) // multiple) * multiple


def default_tokenizer_spec(instruct: bool = True) -> dict[str, Any]:
    spec: dict[str, Any] = {"kind": "cl100k", "bpe_file": DEFAULT_BPE_FILE}
    if not instruct:
        spec["instruct"] = False
    return spec


@dataclass(frozen=True)
class SteerlingConfig:
    # Transformer
    n_layers: int = 32
    n_embd: int = 4096
    n_head: int = 32
    n_kv_heads: int = 4
    mlp_ratio: int = 4
    ffn_size: int | None = None         # `intermediate_size`; None = mlp_ratio * n_embd
    vocab_size: int = 100_352          # embedding rows; tied with the LM head
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
    topk_known: int = 32               # known concepts recorded per token (package: `topk_known`)
    topk_known_features: int | None = None  # known concepts mixed into the features; None = topk_known
    topk_discovered: int = 128
    concept_chunk: int = 4096          # concepts scored per pass (bounds head memory)
    inject_layer: int = 16             # kept from the file; the package's generator does not read it
    inject_alpha: float = 1.0          # idem
    # Tokens (Steerling instruct layout by default)
    eos_id: int = 100_257
    pad_id: int = 100_277
    bos_id: int = 100_278
    endofchunk_id: int = 100_279
    mask_id: int = 100_280
    start_header_id: int | None = 100_281
    end_header_id: int | None = 100_282
    eot_id: int | None = 100_283
    instruct: bool = True
    tokenizer: dict[str, Any] = field(default_factory=default_tokenizer_spec)

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        if self.n_head % self.n_kv_heads:
            raise ValueError(f"n_head ({self.n_head}) must be divisible by n_kv_heads ({self.n_kv_heads})")
        if self.head_dim % 2:
            raise ValueError("head dim must be even for rotary embeddings")
        if self.topk_known_features is not None and self.topk_known_features < self.topk_known:
            # the package's attributor would then find fewer recorded concepts than topk_known
            raise ValueError(f"topk_known_features ({self.topk_known_features}) must be >= topk_known "
                             f"({self.topk_known})")
        ids = {"eos_id": self.eos_id, "pad_id": self.pad_id, "bos_id": self.bos_id,
               "endofchunk_id": self.endofchunk_id, "mask_id": self.mask_id,
               "start_header_id": self.start_header_id, "end_header_id": self.end_header_id,
               "eot_id": self.eot_id}
        for name, i in ids.items():
            if i is not None and not 0 <= i < self.vocab_size:
                raise ValueError(f"{name} {i} is outside the {self.vocab_size}-row vocabulary")

    # Derived sizes
    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def intermediate_size(self) -> int:
        return self.ffn_size if self.ffn_size is not None else self.mlp_ratio * self.n_embd

    @property
    def n_known_padded(self) -> int:
        return pad_to_multiple(self.n_known, self.pad_multiple)

    @property
    def n_discovered_padded(self) -> int:
        return pad_to_multiple(self.n_discovered, self.pad_multiple)

    @property
    def known_features_k(self) -> int:
        """Known concepts whose embeddings make up the known features (package: `topk_features`)."""
        return self.topk_known_features if self.topk_known_features is not None else self.topk_known

    def replace(self, **changes: Any) -> SteerlingConfig:
        return dataclasses.replace(self, **changes)

    # ---- config.json ------------------------------------------------------------------
    def to_json_dict(self, torch_dtype: str | None = None) -> dict[str, Any]:
        """The distributed (flat) layout, key for key what the package's HF writer emits
        (less `auto_map`: we ship no remote code)."""
        out: dict[str, Any] = {
            "model_type": DISTRIBUTED_MODEL_TYPE,
            "architectures": [ARCHITECTURE],
            "interpretable": True,
            "vocab_size": self.vocab_size,
            "n_layers": self.n_layers,
            "n_head": self.n_head,
            "n_embd": self.n_embd,
            "n_kv_heads": self.n_kv_heads,
            "block_size": self.block_size,
            "diff_block_size": self.diff_block_size,
            "use_rms_norm": True,
            "norm_eps": self.norm_eps,
            "norm_order": "post",
            "use_qk_norm": True,
            "use_rope": True,
            "rope_base": self.rope_base,
            "rope_full_precision": True,
            "clip_qkv": self.clip_qkv,
            "mlp_type": "swiglu",
            "activation": "gelu",           # unused by SwiGLU (the package's default)
            "mlp_ratio": self.mlp_ratio,
            "intermediate_size": self.ffn_size,
            "use_bias": False,
            "weight_sharing": True,
            "pad_token_id": self.pad_id,
            "bos_token_id": self.bos_id,
            "eos_token_id": self.eos_id,
            "mask_token_id": self.mask_id,
            "endofchunk_token_id": self.endofchunk_id,
            "n_concepts": self.n_known,
            "n_unknown_concepts": self.n_discovered,
            "concept_dim": self.n_embd,
            "use_attention_known": False,
            "use_attention_unknown": False,
            "topk_known": self.topk_known,
            "topk_known_features": self.known_features_k,
            "unknown_topk": self.topk_discovered,
            "use_unknown": True,
            "apply_topk_to_unknown": True,
            "topk_on_logits": False,
            "factorize_unknown": True,
            "factorize_rank": self.factorize_rank,
            "use_epsilon_correction": True,
            "concept_block_size": self.concept_chunk,
            "pad_multiple": self.pad_multiple,
            "store_unknown_weights": False,
            "inject_layer": self.inject_layer,
            "inject_alpha": self.inject_alpha,
        }
        if torch_dtype is not None:
            out["torch_dtype"] = torch_dtype
        if self.instruct:
            out["start_header_id"] = self.start_header_id
            out["end_header_id"] = self.end_header_id
            out["eot_id"] = self.eot_id
        if self.tokenizer != default_tokenizer_spec(self.instruct):
            out["cde"] = {"tokenizer": self.tokenizer}
        return out

    @classmethod
    def from_json_dict(cls, data: dict[str, Any]) -> SteerlingConfig:
        """Read either layout (see the module docstring); ConfigError names a bad field."""
        if not isinstance(data, dict):
            raise ConfigError(f"config.json must hold a JSON object, got {type(data).__name__}")
        model_type = data.get("model_type")
        if model_type == DISTRIBUTED_MODEL_TYPE:
            flat = dict(data)
        elif model_type == NESTED_MODEL_TYPE:
            flat = _flatten_nested(data)
        else:
            raise ConfigError(f"model_type {model_type!r} is not a Steerling config "
                              f"(expected {DISTRIBUTED_MODEL_TYPE!r} or {NESTED_MODEL_TYPE!r})")
        return _read_flat(_Fields(flat))

    def save(self, directory: str | Path, torch_dtype: str | None = None) -> Path:
        path = Path(directory) / "config.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json_dict(torch_dtype), indent=2) + "\n")
        return path

    @classmethod
    def load(cls, directory: str | Path) -> SteerlingConfig:
        path = Path(directory)
        path = path / "config.json" if path.is_dir() else path
        if not path.exists():
            raise FileNotFoundError(f"model config not found: {path}")
        try:
            data = json.loads(path.read_text())
        except ValueError as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from e
        try:
            return cls.from_json_dict(data)
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from None


# ---- reading config.json -----------------------------------------------------------------

# Keys Hugging Face tooling adds; they carry nothing the model needs.
_HF_BOOKKEEPING = ("architectures", "auto_map", "torch_dtype", "transformers_version", "_name_or_path")
# Older files of this project kept the token ids under "cde" with these names.
_LEGACY_IDS = {"eos_id": "eos_token_id", "pad_id": "pad_token_id", "bos_id": "bos_token_id",
               "endofchunk_id": "endofchunk_token_id", "mask_id": "mask_token_id", "eot_id": "eot_id"}


def _flatten_nested(data: dict[str, Any]) -> dict[str, Any]:
    """The converter's nested layout as flat keys (concept `block_size` -> `concept_block_size`)."""
    flat = {k: v for k, v in data.items() if k != "concept"}
    concept = data.get("concept")
    if concept is None:
        # the package's loader builds a plain (non-interpretable) LM from such a file
        raise ConfigError("nested config has no 'concept' object: not an interpretable checkpoint")
    if not isinstance(concept, dict):
        raise ConfigError(f"concept must be a JSON object, got {type(concept).__name__}")
    for k, v in concept.items():
        key = "concept_block_size" if k == "block_size" else k
        if key in flat:
            raise ConfigError(f"concept.{k} repeats the top-level field {key!r}")
        flat[key] = v
    extra = flat.get("cde")
    if isinstance(extra, dict):
        extra = dict(extra)
        for old, new in _LEGACY_IDS.items():
            if old in extra:
                if new in flat:
                    raise ConfigError(f"cde.{old} repeats the top-level field {new!r}")
                flat[new] = extra.pop(old)
        flat["cde"] = extra
        # those files stored <|eot_id|> only; their header ids sat right after <|mask|>
        if flat.get("eot_id") is not None and "start_header_id" not in flat and isinstance(flat.get("mask_token_id"), int):
            flat["start_header_id"], flat["end_header_id"] = flat["mask_token_id"] + 1, flat["mask_token_id"] + 2
    return flat


class _Fields:
    """Typed, consumed-once access to a flat config; leftovers are refused by name."""

    def __init__(self, data: dict[str, Any]):
        self.data = data
        self.used: set[str] = {"model_type"}

    def has(self, key: str) -> bool:
        return key in self.data

    def raw(self, key: str, default: Any) -> Any:
        self.used.add(key)
        return self.data.get(key, default)

    def typed(self, key: str, default: Any, ok: Callable[[Any], bool], what: str) -> Any:
        value = self.raw(key, default)
        if not ok(value):
            raise ConfigError(f"{key} must be {what}, got {value!r}")
        return value

    def int_(self, key: str, default: Any = ..., minimum: int = 1, nullable: bool = False) -> Any:
        if default is ... and key not in self.data:
            raise ConfigError(f"{key} is required")
        return self.typed(key, default, lambda v: (v is None and nullable) or (
            isinstance(v, int) and not isinstance(v, bool) and v >= minimum),
            f"an integer >= {minimum}" + (" or null" if nullable else ""))

    def float_(self, key: str, default: float, positive: bool = True) -> float:
        v = self.typed(key, default, lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)
                       and (v > 0 or not positive), "a positive number" if positive else "a number")
        return float(v)

    def bool_(self, key: str, default: bool) -> bool:
        return self.typed(key, default, lambda v: isinstance(v, bool), "true or false")

    def fixed(self, key: str, default: Any, supported: Any, why: str = "") -> None:
        """A switch the package offers but this engine implements one way only."""
        value = self.raw(key, default)
        if value != supported or type(value) is not type(supported):
            raise ConfigError(f"{key} = {json.dumps(value)} is not supported (only {json.dumps(supported)}"
                              f"{'; ' + why if why else ''})")

    def leftovers(self) -> list[str]:
        return sorted(set(self.data) - self.used)


def _read_flat(f: _Fields) -> SteerlingConfig:
    # switches with one supported value (defaults: the package's)
    f.fixed("interpretable", False, True, "CDE serves the concept heads")
    f.fixed("use_rms_norm", True, True)
    f.fixed("norm_order", "post", "post")
    f.fixed("use_qk_norm", True, True)
    f.fixed("use_rope", True, True)
    f.fixed("rope_full_precision", True, True)
    f.fixed("mlp_type", "swiglu", "swiglu")
    f.typed("activation", "gelu", lambda v: v in ("gelu", "relu", "silu"), "'gelu', 'relu' or 'silu'")  # SwiGLU ignores it
    f.fixed("use_bias", False, False)
    f.fixed("weight_sharing", True, True, "the LM head is the token embedding")
    f.fixed("use_attention_known", False, False)
    f.fixed("use_attention_unknown", False, False)
    f.fixed("use_unknown", True, True)
    f.fixed("factorize_unknown", True, True)
    f.fixed("apply_topk_to_unknown", True, True)
    f.fixed("topk_on_logits", False, False)
    f.fixed("use_epsilon_correction", True, True, "logits are lm_head(known + discovered + residual)")
    f.bool_("store_unknown_weights", False)   # an analysis switch the package's model itself ignores
    f.int_("max_concepts", 16)                # training-time batch width (converter's files only)
    for key in _HF_BOOKKEEPING:
        f.raw(key, None)

    n_embd = f.int_("n_embd", 4096)
    n_head = f.int_("n_head", 32)
    n_kv = f.int_("n_kv_heads", 4, nullable=True)
    mlp_ratio = f.int_("mlp_ratio", 4)
    ffn = f.int_("intermediate_size", None, nullable=True)
    diff_block = f.int_("diff_block_size", 64)
    if diff_block != ENGINE_BLOCK:
        raise ConfigError(f"diff_block_size = {diff_block} is not supported (the engine's blocks are {ENGINE_BLOCK})")
    clip = f.typed("clip_qkv", 10.0, lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0,
                   "a positive number (null, no clamp, is not supported)")
    concept_dim = f.int_("concept_dim", 4096)
    if concept_dim != n_embd:
        raise ConfigError(f"concept_dim ({concept_dim}) must equal n_embd ({n_embd})")

    topk_known = f.int_("topk_known", 32, nullable=True)
    if topk_known is None:
        raise ConfigError("topk_known = null (every known concept active) is not supported")
    features = f.int_("topk_known_features", 32, nullable=True)
    if features is not None and features < topk_known:
        raise ConfigError(f"topk_known_features ({features}) < topk_known ({topk_known}) is not supported: "
                          f"the package's attributor expects topk_known recorded concepts")
    topk_disc = f.int_("unknown_topk", 128, nullable=True)
    if topk_disc is None:
        raise ConfigError("unknown_topk = null (every discovered concept active) is not supported")
    n_disc = f.int_("n_unknown_concepts", 101_196, nullable=True)
    if n_disc is None:
        raise ConfigError("n_unknown_concepts = null is not supported (use_unknown needs the discovered head)")

    kw: dict[str, Any] = dict(
        n_layers=f.int_("n_layers", 32), n_embd=n_embd, n_head=n_head, n_kv_heads=n_kv if n_kv is not None else n_head,
        mlp_ratio=mlp_ratio, ffn_size=ffn, vocab_size=f.int_("vocab_size"), block_size=f.int_("block_size", 4096),
        diff_block_size=diff_block, rope_base=f.float_("rope_base", 500_000.0), norm_eps=f.float_("norm_eps", 1e-5),
        clip_qkv=float(clip),
        n_known=f.int_("n_concepts", 33_732), n_discovered=n_disc,
        pad_multiple=f.int_("pad_multiple", 16), factorize_rank=f.int_("factorize_rank", 256),
        topk_known=topk_known, topk_known_features=None if features in (None, topk_known) else features,
        topk_discovered=topk_disc, concept_chunk=f.int_("concept_block_size", 4096),
        inject_layer=f.int_("inject_layer", 16, minimum=0), inject_alpha=f.float_("inject_alpha", 1.0, positive=False),
    )
    ids = {"eos_id": "eos_token_id", "pad_id": "pad_token_id", "bos_id": "bos_token_id",
           "endofchunk_id": "endofchunk_token_id", "mask_id": "mask_token_id"}
    for ours, key in ids.items():
        kw[ours] = f.int_(key, minimum=0)
    kw.update(_chat_ids(f, kw["mask_id"]))
    kw["tokenizer"] = _tokenizer_spec(f, kw["instruct"])

    left = f.leftovers()
    if left:
        raise ConfigError(f"unknown field(s) {', '.join(left)}: not part of the Steerling config layout "
                          f"(refused rather than ignored)")
    try:
        return SteerlingConfig(**kw)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _chat_ids(f: _Fields, mask_id: int) -> dict[str, Any]:
    """Instruct iff the file has the chat ids (the distributed layout) or says `instruct`
    (the converter's layout, which has no chat ids: the package's tokenizer puts them
    right after <|mask|>). A base model has none: its vocabulary ends at <|mask|>."""
    keys = ("start_header_id", "end_header_id", "eot_id")
    given = {k: f.int_(k, None, minimum=0, nullable=True) for k in keys}
    present = [k for k in keys if given[k] is not None]
    instruct = f.bool_("instruct", bool(present))
    if present and len(present) != len(keys):
        missing = [k for k in keys if given[k] is None]
        raise ConfigError(f"{', '.join(missing)} missing: an instruct config has all of {', '.join(keys)}")
    if present and not instruct:
        raise ConfigError(f"instruct = false but the file has the chat ids {', '.join(present)}")
    if instruct and not present:
        given = {k: mask_id + 1 + i for i, k in enumerate(keys)}
    return {"instruct": instruct, **given}


def _tokenizer_spec(f: _Fields, instruct: bool) -> dict[str, Any]:
    extra = f.typed("cde", {}, lambda v: isinstance(v, dict), "a JSON object")
    unknown = sorted(set(extra) - {"tokenizer"})
    if unknown:
        raise ConfigError(f"unknown field(s) cde.{', cde.'.join(unknown)}")
    spec = extra.get("tokenizer", default_tokenizer_spec(instruct))
    if not isinstance(spec, dict):
        raise ConfigError(f"cde.tokenizer must be a JSON object, got {spec!r}")
    if spec.get("kind") == "cl100k" and spec.get("instruct", True) != instruct:
        raise ConfigError(f"cde.tokenizer.instruct = {json.dumps(spec.get('instruct', True))} contradicts the "
                          f"config (instruct = {json.dumps(instruct)})")
    return dict(spec)


# The published Steerling-8B's architecture with the instruct vocabulary padded to 100,352 rows
# (the engine benchmarks' preset; a checkpoint's own config.json always wins).
STEERLING_8B = SteerlingConfig()

# A model small enough for CPU tests and the local demo. Its vocabulary is the
# self-contained byte tokenizer's (264 ids, padded to 320).
TINY = SteerlingConfig(
    n_layers=4, n_embd=128, n_head=4, n_kv_heads=2, vocab_size=320, block_size=1024,
    n_known=48, n_discovered=96, factorize_rank=16, topk_known=8, topk_discovered=16,
    concept_chunk=32, inject_layer=2,
    eos_id=256, pad_id=257, bos_id=258, endofchunk_id=259, mask_id=260,
    start_header_id=261, end_header_id=262, eot_id=263,
    instruct=True, tokenizer={"kind": "byte"},
)

PRESETS: dict[str, SteerlingConfig] = {"steerling-8b": STEERLING_8B, "tiny": TINY}


def preset(name: str) -> SteerlingConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; known: {', '.join(sorted(PRESETS))}") from None
