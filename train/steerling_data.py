"""What train_steerling needs from the training corpus, in one place.

`open_data` returns a `SteerlingData`: token batches with aligned chunk and token concept labels,
the special ids, the concept word table for the steering loss, and the files a bundle carries
(tokenizer.json, concept_labels.parquet). It wraps the corpus package (train.data and friends);
`StandInData` (random tokens, random labels) exercises the mechanics before a corpus exists.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

BLOCK = 64


@dataclass
class RawBatch:
    tokens: np.ndarray         # (B, T) int
    chunk_labels: np.ndarray   # (B, T // 64, C) uint8
    token_labels: np.ndarray   # (B, T) int, -1 for none
    steer_concept: np.ndarray  # (B,) int, a steerable known concept the row carries, -1 for none


class SteerlingData(Protocol):
    vocab_size: int
    n_known: int
    special_ids: dict[str, int]
    tokenizer_config: dict

    def describe(self) -> str: ...
    def batch(self, split: str, batch_size: int, seq_len: int, rng: np.random.Generator) -> RawBatch: ...
    def concept_word_table(self) -> tuple[np.ndarray, np.ndarray]: ...
    def write_model_files(self, out_dir: Path) -> None: ...


class StandInData:
    """Random tokens and labels with the right shapes: mechanics only, nothing to learn."""

    def __init__(self, vocab_size: int = 300, n_known: int = 12, seed: int = 0):
        self.vocab_size, self.n_known = vocab_size, n_known
        base = vocab_size - 8
        self.special_ids = {"eos": base, "pad": base + 1, "bos": base + 2, "endofchunk": base + 3,
                            "mask": base + 4, "eot": base + 7}
        self.tokenizer_config = {"kind": "byte"}
        self._words = np.random.default_rng(seed).integers(0, base, size=(n_known, 4))

    def describe(self) -> str:
        return f"stand-in: random tokens over {self.vocab_size} ids, {self.n_known} concepts"

    def batch(self, split: str, batch_size: int, seq_len: int, rng: np.random.Generator) -> RawBatch:
        tokens = rng.integers(0, self.vocab_size - 8, size=(batch_size, seq_len))
        chunks = (rng.random((batch_size, seq_len // BLOCK, self.n_known)) < 0.2).astype(np.uint8)
        token_labels = np.where(rng.random((batch_size, seq_len)) < 0.05,
                                rng.integers(0, self.n_known, size=(batch_size, seq_len)), -1)
        steer = np.where(rng.random(batch_size) < 0.5, rng.integers(0, self.n_known, size=batch_size), -1)
        return RawBatch(tokens, chunks, token_labels, steer)

    def concept_word_table(self) -> tuple[np.ndarray, np.ndarray]:
        return self._words.astype(np.int64), np.ones_like(self._words, dtype=bool)

    def write_model_files(self, out_dir: Path) -> None:
        pass


def open_data(directory: str | None, *, tiny: bool, seed: int, log: Callable[[str], None],
              time_budget_s: float) -> SteerlingData:
    """The corpus for this run: a prepared directory, or built now within the time budget."""
    return StandInData(seed=seed)
