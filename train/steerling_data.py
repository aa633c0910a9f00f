"""What train_steerling needs from the training corpus, in one place.

`open_data` returns a `SteerlingData`: token batches with aligned chunk and token concept labels,
the special ids, the concept word table for the steering loss, and the files a bundle carries
(tokenizer.json, concept_labels.parquet). It wraps the corpus package (train.data and friends);
`StandInData` (random tokens, random labels) exercises the mechanics before a corpus exists.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
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
                            "mask": base + 4, "start_header": base + 5, "end_header": base + 6, "eot": base + 7}
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


class CorpusData:
    """The training corpus (train.data shards, train.labeler, the catalog) as train_steerling sees it."""

    def __init__(self, train_dirs: list[Path], seed: int, log: Callable[[str], None]):
        from train import build_data
        from train.concepts import Lexicon
        from train.data import ShardSet
        from train.labeler import Labeler
        from train.tokenizer_build import SPECIAL_IDS, VOCAB_SIZE

        self._tokenizer_file, self._catalog_file = build_data.TOKENIZER, build_data.CATALOG
        self.lexicon = Lexicon.load(build_data.LEXICON)
        self.labeler = Labeler(self.lexicon, self._tokenizer_file)
        self.catalog = read_catalog_summary()
        self.n_known = len(self.catalog)
        self.vocab_size = self.tokenizer_vocab = VOCAB_SIZE
        s = SPECIAL_IDS
        self.special_ids = {"eos": s["<|endoftext|>"], "pad": s["<|pad|>"], "bos": s["<|bos|>"],
                            "endofchunk": s["<|endofchunk|>"], "mask": s["<|mask|>"], "eot": s["<|eot_id|>"],
                            "start_header": s["<|start_header_id|>"], "end_header": s["<|end_header_id|>"]}
        self.tokenizer_config = {"kind": "tokenizer_json", "file": "tokenizer.json"}
        weights = {"stories": 0.85, "*": 0.15}
        self.sets = {}
        for split, name in (("train", "train"), ("val", "heldout")):
            found = ShardSet.open(train_dirs, split=split)
            w = weights if "stories" in found.by_source and len(found.by_source) > 1 else None
            found.set_weights(w)
            self.sets[name] = found
        self.steerable_story = np.array([c["steerable"] and c["source"] == "story" for c in self.catalog])
        from tokenizers import Tokenizer
        self.tokenizer = Tokenizer.from_file(str(self._tokenizer_file))
        self._names = {c["id"]: c["name"] for c in self.catalog}

    def describe(self) -> str:
        tr = self.sets["train"]
        return (f"{tr.n_tokens / 1e6:.1f}M training tokens from {sorted(tr.by_source)}, "
                f"{self.n_known} known concepts ({int(self.steerable_story.sum())} steerable story concepts)")

    def concept_name(self, c: int) -> str:
        return self._names.get(int(c), str(c))

    def batch(self, split: str, batch_size: int, seq_len: int, rng: np.random.Generator) -> RawBatch:
        b = self.sets[split].batch(batch_size, seq_len, rng, device="cpu")
        chunk = b.chunk_targets(self.n_known).numpy().astype(np.uint8)
        tok_labels = b.token_labels[..., 0].numpy()                      # the labeler's first (priority) concept
        present = chunk.any(1) & self.steerable_story[None, :]           # (B, C)
        steer = np.full(batch_size, -1, dtype=np.int64)
        for i in range(batch_size):
            ids = np.flatnonzero(present[i])
            if len(ids):
                steer[i] = rng.choice(ids)
        return RawBatch(b.tokens.numpy(), chunk, tok_labels, steer)

    def concept_word_table(self) -> tuple[np.ndarray, np.ndarray]:
        """(C, W) first token ids of each concept's words (with a leading space, lower and title case)."""
        per: list[list[int]] = [[] for _ in range(self.n_known)]
        for word, ids in self.lexicon.words.items():
            for c in ids[:1]:                                            # the word's priority concept
                if len(per[c]) < 48:
                    for form in (" " + word, " " + word.capitalize()):
                        t = self.tokenizer.encode(form, add_special_tokens=False).ids
                        if t and t[0] not in per[c]:
                            per[c].append(t[0])
        width = max(1, max(len(p) for p in per))
        table = np.zeros((self.n_known, width), dtype=np.int64)
        mask = np.zeros((self.n_known, width), dtype=bool)
        for c, p in enumerate(per):
            table[c, :len(p)] = p
            mask[c, :len(p)] = True
        mask[:, 0] |= ~mask.any(1)                                       # no words: token 0, never hit
        return table, mask

    def write_model_files(self, out_dir: Path) -> None:
        shutil.copyfile(self._tokenizer_file, out_dir / "tokenizer.json")
        shutil.copyfile(self._catalog_file, out_dir / "concept_labels.parquet")

    # ---- evaluation helpers
    def chat_prompt(self, text: str) -> list[int]:
        """The serving chat template (cde.steerling.tokenizer.chat) for one user message."""
        enc = lambda t: self.tokenizer.encode(t, add_special_tokens=False).ids  # noqa: E731
        s = self.special_ids
        return ([s["start_header"]] + enc("user") + [s["end_header"]] + enc("\n\n" + text) + [s["eot"]]
                + [s["start_header"]] + enc("assistant") + [s["end_header"]] + enc("\n\n"))

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def concepts_in_text(self, text: str) -> set[int]:
        lab = self.labeler.label_text(text).labels
        return {int(c) for c in np.unique(lab) if c < self.n_known}

    def token_concepts(self, ids: list[int]) -> list[set[int]]:
        """Per generated token, the known concepts the labeler ties to it (empty where the
        re-encoded text does not reproduce the ids)."""
        text = self.tokenizer.decode(ids, skip_special_tokens=False)
        lab = self.labeler.label_text(text)
        if lab.ids.tolist() != list(ids):
            return [set() for _ in ids]
        return [{int(c) for c in row if c < self.n_known} for row in lab.labels]

    def eval_prompts(self, n: int, seed: int) -> list[str]:
        from train.stories import generate_story
        return [generate_story(HELDOUT_STORY_SEED + seed, i).prompt for i in range(n)]

    def steer_concepts(self, n: int) -> list[int]:
        return [c["id"] for c in self.catalog if c["steerable"] and c["group"] == "setting"][:n]


HELDOUT_STORY_SEED = 900_000   # story seeds the trainer never generates
CATALOG_SUMMARY = Path(__file__).resolve().parent / "artifacts" / "catalog_summary.json"


def read_catalog_summary() -> list[dict]:
    """The catalog's id, name, group, source and steerable flag, in id order. A JSON copy of
    concept_labels.parquet's columns (`python -m train.steerling_data --write-catalog-summary`;
    a test keeps them equal): the GPU machine has no pandas/pyarrow to read the parquet."""
    rows = json.loads(CATALOG_SUMMARY.read_text())
    if [r["id"] for r in rows] != list(range(len(rows))):
        raise ValueError(f"{CATALOG_SUMMARY}: concept ids must be 0..n-1 in order")
    return rows


def catalog_summary_from_parquet(path: Path) -> list[dict]:
    import pandas as pd

    d = pd.read_parquet(path).sort_values("concept_id")
    return [{"id": int(r.concept_id), "name": r.concept_name, "group": r.group_name, "source": r.source,
             "steerable": bool(r.is_steerable)} for r in d.itertuples()]


def main() -> None:
    import argparse

    from train import build_data
    ap = argparse.ArgumentParser(description="write train/artifacts/catalog_summary.json from the parquet")
    ap.add_argument("--write-catalog-summary", action="store_true", required=True)
    ap.parse_args()
    rows = catalog_summary_from_parquet(build_data.CATALOG)
    CATALOG_SUMMARY.write_text("[\n" + ",\n".join(json.dumps(r) for r in rows) + "\n]\n")
    print(CATALOG_SUMMARY)


def open_data(directory: str | None, *, tiny: bool, seed: int, log: Callable[[str], None],
              time_budget_s: float, model_dir: str | None = None,
              story_grammar: int | None = None) -> SteerlingData:
    """The corpus: shards under `directory` when it has some, else generated there now (stories
    sized to the time budget + the committed prose; a temporary directory when None). A directory
    built with another story grammar than `story_grammar` is refused (its file `story_grammar` says which;
    None: any, and grammar 1 when built now)."""
    if tiny and directory is None:
        return StandInData(seed=seed)
    root = Path(directory) if directory else Path(tempfile.mkdtemp(prefix="steerling-data-"))
    marker = root / "story_grammar"
    if not any(root.rglob("*.tokens.npy")):
        build_corpus(root, seed, log, time_budget_s, story_grammar=story_grammar or 1)
        marker.write_text(f"{story_grammar or 1}\n")
    built = int(marker.read_text()) if marker.exists() else 1
    if story_grammar is not None and built != story_grammar:
        raise SystemExit(f"--data {root} holds stories of grammar {built}, not {story_grammar}: use another directory")
    dirs = sorted({p.parent for p in root.rglob("*.tokens.npy")})
    return CorpusData(dirs, seed, log)


def build_corpus(out: Path, seed: int, log: Callable[[str], None], time_budget_s: float,
                 tokens_per_s_per_worker: float = 55_000.0, story_grammar: int = 1) -> Path:
    """Story shards sized to the time budget (measured rate per worker) + the committed prose."""
    from train import build_data
    from train.shards import generate_story_shards, unpack_shards

    workers = max(1, (os.cpu_count() or 2) - 1)
    n_tokens = int(time_budget_s * workers * tokens_per_s_per_worker)
    t0 = time.monotonic()
    log(f"generating ~{n_tokens / 1e6:.0f}M story tokens on {workers} workers")
    generate_story_shards(out / "stories", n_tokens, seed, workers, "llama3", 0.35, build_data.TOKENIZER,
                          build_data.LEXICON, per_shard=2000, progress=True, grammar=story_grammar)
    if build_data.PROSE.exists():
        names = unpack_shards(build_data.PROSE, out / "prose", build_data.TOKENIZER, build_data.LEXICON,
                              workers=workers)
        log(f"unpacked {len(names)} prose shards")
    log(f"corpus ready in {time.monotonic() - t0:.0f}s")
    return out


if __name__ == "__main__":
    main()
