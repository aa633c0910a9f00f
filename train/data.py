"""The trainers' loader: memory-mapped shards (train/shards.py), random chunk-aligned windows.

    from train.data import ShardSet
    data = ShardSet.open(["/tmp/stories", "/tmp/prose"], weights={"stories": 0.85, "*": 0.15})
    batch = data.batch(64, seq_len=512, rng=np.random.default_rng(0), device="cuda")
    batch.tokens            # (64, 512) int64
    batch.token_labels      # (64, 512, TOKEN_K) int64, -1 = none
    batch.chunk_labels      # (64, 8, CHUNK_K) int64, -1 = none
    batch.chunk_targets(n_concepts)   # (64, 8, n_concepts) float multi-hot

Windows start at multiples of 64, so a window's chunks are the shard's chunks and the labels
line up with Steerling's 64-token blocks. The last `val_fraction` of every shard's chunks is
the held-out split (`split="val"`), never sampled for training. numpy only at import; torch is
imported when a batch is asked for.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from train.labeler import CHUNK, NO_LABEL
from train.shards import ShardMeta

WILDCARD = "*"


@dataclass
class Shard:
    meta: ShardMeta
    tokens: np.ndarray
    token_labels: np.ndarray
    chunk_labels: np.ndarray
    first_chunk: int  # of this split
    n_chunks: int

    @classmethod
    def open(cls, directory: Path, name: str, split: str, val_fraction: float) -> Shard:
        base = directory / name
        meta = ShardMeta.load(Path(f"{base}.json"))
        tokens = np.load(f"{base}.tokens.npy", mmap_mode="r")
        token_labels = np.load(f"{base}.token_labels.npy", mmap_mode="r")
        chunk_labels = np.load(f"{base}.chunk_labels.npy", mmap_mode="r")
        total = len(tokens) // CHUNK
        if chunk_labels.shape[0] != total or token_labels.shape[0] != len(tokens):
            raise ValueError(f"{base}: label arrays do not match the tokens")
        n_val = int(round(total * val_fraction))
        if split == "train":
            first, n = 0, total - n_val
        elif split == "val":
            first, n = total - n_val, n_val
        else:
            raise ValueError(f"split must be 'train' or 'val', got {split!r}")
        return cls(meta, tokens, token_labels, chunk_labels, first, n)


@dataclass
class Batch:
    tokens: Any        # torch.LongTensor (B, S)
    token_labels: Any  # (B, S, TOKEN_K), -1 = none
    chunk_labels: Any  # (B, S // 64, CHUNK_K), -1 = none
    sources: list[str]

    def chunk_targets(self, n_concepts: int, dtype: Any = None) -> Any:
        """Multi-hot (B, S // 64, n_concepts) of the chunk labels."""
        return _multi_hot(self.chunk_labels, n_concepts, dtype)

    def token_targets(self, n_concepts: int, dtype: Any = None) -> Any:
        """Multi-hot (B, S, n_concepts) of the token labels (large: prefer chunk_targets)."""
        return _multi_hot(self.token_labels, n_concepts, dtype)


def _multi_hot(labels: Any, n: int, dtype: Any) -> Any:
    import torch

    out = torch.zeros(*labels.shape[:-1], n + 1, dtype=dtype or torch.float32, device=labels.device)
    idx = torch.where(labels < 0, torch.full_like(labels, n), labels)
    if int(labels.max()) >= n:
        raise ValueError(f"a label id {int(labels.max())} is not below n_concepts={n}")
    out.scatter_(-1, idx, 1.0)
    return out[..., :n]


class ShardSet:
    """Every shard under some directories, grouped by source, sampled with weights."""

    def __init__(self, shards: list[Shard], weights: dict[str, float] | None = None):
        if not shards:
            raise ValueError("no shards found")
        self.shards = shards
        self.by_source: dict[str, list[Shard]] = {}
        for s in shards:
            self.by_source.setdefault(s.meta.source, []).append(s)
        self.set_weights(weights)

    @classmethod
    def open(cls, dirs: str | Path | list[str | Path], weights: dict[str, float] | None = None,
             split: str = "train", val_fraction: float = 0.01, sources: list[str] | None = None) -> ShardSet:
        if isinstance(dirs, (str, Path)):
            dirs = [dirs]
        shards = []
        for d in map(Path, dirs):
            for meta in sorted(d.glob("*.json")):
                name = meta.name[:-5]
                if not Path(f"{d / name}.tokens.npy").exists():
                    continue
                s = Shard.open(d, name, split, val_fraction)
                if (sources is None or s.meta.source in sources) and s.n_chunks > 0:
                    shards.append(s)
        return cls(shards, weights)

    def set_weights(self, weights: dict[str, float] | None) -> None:
        """Source -> sampling weight; `"*"` covers every source not named; default: by token count."""
        names = sorted(self.by_source)
        if weights is None:
            w = np.array([sum(s.n_chunks for s in self.by_source[n]) for n in names], np.float64)
        else:
            unknown = set(weights) - set(names) - {WILDCARD}
            if unknown:
                raise ValueError(f"weights name sources that are not loaded: {sorted(unknown)} (loaded: {names})")
            rest = [n for n in names if n not in weights]
            w = np.array([weights.get(n, 0.0) for n in names], np.float64)
            if WILDCARD in weights and rest:
                # the wildcard's weight is shared by the other sources in proportion to their size
                sizes = np.array([sum(s.n_chunks for s in self.by_source[n]) if n in rest else 0 for n in names], np.float64)
                w += weights[WILDCARD] * sizes / sizes.sum()
        if (w < 0).any() or w.sum() <= 0:
            raise ValueError(f"weights must be >= 0 with a positive sum, got {dict(zip(names, w))}")
        self.source_names = names
        self.source_p = w / w.sum()
        self.shard_p = {n: np.array([s.n_chunks for s in self.by_source[n]], np.float64) for n in names}
        for n in names:
            self.shard_p[n] /= self.shard_p[n].sum()

    @property
    def n_tokens(self) -> int:
        return sum(s.n_chunks for s in self.shards) * CHUNK

    def windows(self, batch_size: int, seq_len: int, rng: np.random.Generator) -> list[tuple[Shard, int]]:
        """(shard, first chunk) of `batch_size` random windows of `seq_len` tokens."""
        if seq_len % CHUNK or seq_len <= 0:
            raise ValueError(f"seq_len must be a positive multiple of {CHUNK}, got {seq_len}")
        need = seq_len // CHUNK
        out = []
        src = rng.choice(len(self.source_names), size=batch_size, p=self.source_p)
        for k in src:
            name = self.source_names[k]
            shard = self.by_source[name][rng.choice(len(self.by_source[name]), p=self.shard_p[name])]
            if shard.n_chunks < need:
                raise ValueError(f"shard {shard.meta.name} has {shard.n_chunks} chunks, fewer than a window ({need})")
            out.append((shard, shard.first_chunk + int(rng.integers(0, shard.n_chunks - need + 1))))
        return out

    def batch(self, batch_size: int, seq_len: int = 512, rng: np.random.Generator | None = None,
              device: Any = "cpu") -> Batch:
        import torch

        rng = rng if rng is not None else np.random.default_rng()
        need = seq_len // CHUNK
        wins = self.windows(batch_size, seq_len, rng)
        tok = np.stack([s.tokens[c * CHUNK:(c + need) * CHUNK] for s, c in wins]).astype(np.int64)
        tl = np.stack([s.token_labels[c * CHUNK:(c + need) * CHUNK] for s, c in wins]).astype(np.int64)
        cl = np.stack([s.chunk_labels[c:c + need] for s, c in wins]).astype(np.int64)
        tl[tl == NO_LABEL] = -1
        cl[cl == NO_LABEL] = -1
        pin = str(device).startswith("cuda")

        def put(a: np.ndarray) -> Any:
            t = torch.from_numpy(a)
            return t.pin_memory().to(device, non_blocking=True) if pin else t.to(device)

        return Batch(put(tok), put(tl), put(cl), [s.meta.source for s, _ in wins])
