"""Configuration of causal LMs in the Qwen3 / SDAR layout (I-DLM checkpoints).

One frozen dataclass holds what the model and the decoder need. It reads and writes the
Hugging Face ``config.json`` of ``Qwen3ForCausalLM`` (``model_type`` "qwen3") and of the
I-DLM / SDAR releases (``SDARForCausalLM``, ``model_type`` "sdar"; same keys plus
``mask_token_id``). Features the model does not implement (RoPE scaling, sliding-window
layers, activations other than SiLU) are rejected with a ValueError instead of being
silently ignored.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

QWEN3_ARCH = "Qwen3ForCausalLM"
SDAR_ARCH = "SDARForCausalLM"
_MODEL_TYPES = {QWEN3_ARCH: "qwen3", SDAR_ARCH: "sdar"}


@dataclass(frozen=True)
class Qwen3Config:
    n_layers: int = 36
    hidden: int = 4096
    n_heads: int = 32
    n_kv_heads: int = 8
    head_dim: int = 128
    intermediate: int = 12288
    vocab_size: int = 151_936
    rope_theta: float = 1_000_000.0
    rms_eps: float = 1e-6
    max_positions: int = 40_960
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    # Tokens. eos_token_ids: every id that ends generation (config.json's eos_token_id,
    # int or list, plus generation_config.json's when loaded from a directory).
    mask_token_id: int | None = 151_669
    bos_token_id: int | None = 151_643
    eos_token_ids: tuple[int, ...] = (151_645,)
    architecture: str = SDAR_ARCH

    def __post_init__(self) -> None:
        for name in ("n_layers", "hidden", "n_heads", "n_kv_heads", "head_dim", "intermediate",
                     "vocab_size", "max_positions"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must be divisible by n_kv_heads ({self.n_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim ({self.head_dim}) must be even for rotary embeddings")
        if not self.rope_theta > 0 or not self.rms_eps > 0:
            raise ValueError("rope_theta and rms_eps must be positive")
        if self.architecture not in _MODEL_TYPES:
            raise ValueError(f"architecture must be one of {sorted(_MODEL_TYPES)}, got {self.architecture!r}")
        object.__setattr__(self, "eos_token_ids", tuple(int(i) for i in self.eos_token_ids))
        object.__setattr__(self, "rope_theta", float(self.rope_theta))
        object.__setattr__(self, "rms_eps", float(self.rms_eps))
        for name, ids in (("mask_token_id", [self.mask_token_id]), ("bos_token_id", [self.bos_token_id]),
                          ("eos_token_ids", list(self.eos_token_ids))):
            for i in ids:
                if i is not None and not 0 <= i < self.vocab_size:
                    raise ValueError(f"{name} {i} is outside the vocabulary (size {self.vocab_size})")

    @property
    def q_size(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.n_kv_heads * self.head_dim

    def replace(self, **changes: Any) -> Qwen3Config:
        return dataclasses.replace(self, **changes)

    # ---- Hugging Face config.json -------------------------------------------------------
    def to_hf_config(self) -> dict[str, Any]:
        """``config.json`` contents; transformers' ``Qwen3Config(**d)`` (4.x and 5.x) accepts it."""
        d: dict[str, Any] = {
            "architectures": [self.architecture],
            "model_type": _MODEL_TYPES[self.architecture],
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden,
            "intermediate_size": self.intermediate,
            "num_hidden_layers": self.n_layers,
            "num_attention_heads": self.n_heads,
            "num_key_value_heads": self.n_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_positions,
            "rms_norm_eps": self.rms_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": None,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},  # transformers >= 5
            "attention_bias": self.attention_bias,
            "attention_dropout": 0.0,
            "tie_word_embeddings": self.tie_word_embeddings,
            "use_sliding_window": False,
            "sliding_window": None,
            "max_window_layers": self.n_layers,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": (self.eos_token_ids[0] if len(self.eos_token_ids) == 1
                             else list(self.eos_token_ids) or None),
            "initializer_range": 0.02,
            "use_cache": True,
        }
        if self.mask_token_id is not None:
            d["mask_token_id"] = self.mask_token_id
        return d

    @classmethod
    def from_hf_config(cls, d: dict[str, Any]) -> Qwen3Config:
        """Read a ``Qwen3ForCausalLM`` / ``SDARForCausalLM`` ``config.json`` dict."""
        archs = d.get("architectures") or [QWEN3_ARCH]
        arch = next((a for a in archs if a in _MODEL_TYPES), None)
        if arch is None:
            mt = d.get("model_type")
            arch = {v: k for k, v in _MODEL_TYPES.items()}.get(mt)
            if arch is None:
                raise ValueError(f"unsupported architecture {archs} / model_type {mt!r} "
                                 f"(expected {QWEN3_ARCH} or {SDAR_ARCH})")
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act {act!r} is not supported (only 'silu')")
        rope_theta = float(d.get("rope_theta", 10000.0))
        # transformers >= 5 writes {"rope_parameters": {"rope_type", "rope_theta", ...}}
        # (or one such dict per layer type); 4.x writes rope_theta + rope_scaling.
        rp = d.get("rope_parameters")
        if isinstance(rp, dict) and rp and all(isinstance(v, dict) for v in rp.values()):
            kinds = {json.dumps(v, sort_keys=True) for v in rp.values()}
            if len(kinds) != 1:
                raise ValueError(f"per-layer-type rope_parameters {rp} are not supported")
            rp = next(iter(rp.values()))
        for key, rs in (("rope_scaling", d.get("rope_scaling")), ("rope_parameters", rp)):
            if rs is not None and (rs.get("rope_type") or rs.get("type")) not in ("default", None):
                raise ValueError(f"{key} {rs} is not supported (only plain RoPE)")
        if rp and rp.get("rope_theta") is not None:
            rope_theta = float(rp["rope_theta"])
        n_layers = int(d["num_hidden_layers"])
        layer_types = d.get("layer_types")
        if layer_types is not None:
            bad = [i for i, t in enumerate(layer_types) if t != "full_attention"]
            if bad:
                raise ValueError(f"layer {bad[0]} is {layer_types[bad[0]]!r}: only full attention is supported")
        elif d.get("use_sliding_window") and d.get("sliding_window") is not None \
                and int(d.get("max_window_layers", n_layers)) < n_layers:
            raise ValueError("sliding-window attention layers are not supported")
        n_heads = int(d["num_attention_heads"])
        hidden = int(d["hidden_size"])
        eos = d.get("eos_token_id")
        eos_ids = () if eos is None else (tuple(eos) if isinstance(eos, (list, tuple)) else (eos,))
        return cls(
            n_layers=n_layers, hidden=hidden, n_heads=n_heads,
            n_kv_heads=int(d.get("num_key_value_heads") or n_heads),
            head_dim=int(d.get("head_dim") or hidden // n_heads),
            intermediate=int(d["intermediate_size"]), vocab_size=int(d["vocab_size"]),
            rope_theta=rope_theta, rms_eps=float(d.get("rms_norm_eps", 1e-6)),
            max_positions=int(d.get("max_position_embeddings", 32768)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(d.get("attention_bias", False)),
            mask_token_id=d.get("mask_token_id"), bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids, architecture=arch,
        )

    def save(self, directory: str | Path) -> Path:
        path = Path(directory) / "config.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_hf_config(), indent=2) + "\n")
        return path

    @classmethod
    def load(cls, directory: str | Path) -> Qwen3Config:
        """``directory/config.json``; eos ids of ``generation_config.json`` (if any) are added."""
        directory = Path(directory)
        path = directory / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"model config not found: {path}")
        try:
            data = json.loads(path.read_text())
        except ValueError as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from e
        try:
            cfg = cls.from_hf_config(data)
        except (KeyError, TypeError) as e:
            raise ValueError(f"{path}: missing or malformed key {e}") from e
        gen = directory / "generation_config.json"
        if gen.is_file():
            extra = json.loads(gen.read_text()).get("eos_token_id")
            extra = [] if extra is None else (list(extra) if isinstance(extra, (list, tuple)) else [extra])
            ids = list(cfg.eos_token_ids) + [int(i) for i in extra if int(i) not in cfg.eos_token_ids]
            cfg = cfg.replace(eos_token_ids=tuple(ids))
        return cfg


# I-DLM-8B (Qwen3-8B layout, SDARForCausalLM): 8,190,735,360 parameters, untied head.
IDLM_8B = Qwen3Config()

# For CPU tests: GQA (4 query / 2 KV heads), tiny vocabulary with the mask as its last id.
TINY = Qwen3Config(
    n_layers=2, hidden=64, n_heads=4, n_kv_heads=2, head_dim=16, intermediate=128,
    vocab_size=512, rope_theta=1_000_000.0, rms_eps=1e-6, max_positions=2048,
    tie_word_embeddings=False, mask_token_id=511, bos_token_id=509, eos_token_ids=(510,),
)

PRESETS: dict[str, Qwen3Config] = {"idlm-8b": IDLM_8B, "tiny": TINY}


def preset(name: str) -> Qwen3Config:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; known: {', '.join(sorted(PRESETS))}") from None
