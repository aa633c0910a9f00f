"""Token shards with aligned labels, and the parallel story-shard generator.

A shard `NAME` in a directory is four files:
  NAME.tokens.npy        uint16 (n,)            n a multiple of 64 (padded with <|pad|>)
  NAME.token_labels.npy  uint16 (n, TOKEN_K)    concept ids per token, NO_LABEL = 0xFFFF
  NAME.chunk_labels.npy  uint16 (n/64, CHUNK_K) concept ids per 64-token chunk
  NAME.json              ShardMeta
Documents are concatenated, each ending in <|endoftext|>; chunk k is tokens [64k, 64k+64).

Chat documents use the serving templates token for token: "llama3" is the Steerling template
(cde.steerling.tokenizer.Tokenizer.apply_chat_template), "chatml" the causal family's
(cde.qwen3.chat.ChatTokenizer): special ids are inserted as ids, text pieces encoded alone.
Stdlib + numpy + tokenizers only (the generator runs on the GPU machine).
"""

from __future__ import annotations

import hashlib
import io
import json
import lzma
import os
import random
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from train.labeler import CHUNK, CHUNK_K, NO_LABEL, TOKEN_K, Labeled, Labeler
from train.tokenizer_build import SPECIAL_IDS

CHAT_FORMATS = ("llama3", "chatml")
STORIES_PER_SHARD = 20_000


@dataclass
class ShardMeta:
    name: str
    source: str          # "stories" or a prose source name (train/sources.py)
    n_tokens: int
    n_docs: int
    token_k: int
    chunk_k: int
    chat_format: str     # "" for prose
    tokenizer_sha256: str
    lexicon_sha256: str
    seed: int = -1
    first_index: int = -1
    n_chat_docs: int = 0

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self), indent=1) + "\n")

    @classmethod
    def load(cls, path: Path) -> ShardMeta:
        return cls(**json.loads(path.read_text()))


def sha256_file(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


class DocumentBuilder:
    """Concatenates labeled pieces and special ids into one document's arrays."""

    def __init__(self) -> None:
        self.parts: list[Labeled] = []

    def text(self, piece: Labeled) -> None:
        self.parts.append(piece)

    def special(self, *token_ids: int) -> None:
        n = len(token_ids)
        self.parts.append(Labeled(np.asarray(token_ids, np.int64), np.full((n, TOKEN_K), NO_LABEL, np.uint16),
                                  np.zeros(n, np.float32)))


def chat_document(lab: Labeler, prompt: str, reply: str, fmt: str) -> list[Labeled]:
    """A user prompt and assistant reply in the serving chat template of `fmt`, ending with eos."""
    d = DocumentBuilder()
    pieces = lab.label_texts(["user", "assistant", "\n\n" + prompt, "\n\n" + reply, prompt, reply, "\n"])
    user, assistant, p2, r2, p1, r1, nl = pieces
    s = SPECIAL_IDS
    if fmt == "llama3":
        d.special(s["<|start_header_id|>"]); d.text(user); d.special(s["<|end_header_id|>"]); d.text(p2)
        d.special(s["<|eot_id|>"], s["<|start_header_id|>"]); d.text(assistant); d.special(s["<|end_header_id|>"])
        d.text(r2); d.special(s["<|eot_id|>"])
    elif fmt == "chatml":
        d.special(s["<|im_start|>"]); d.text(user); d.text(nl); d.text(p1); d.special(s["<|im_end|>"]); d.text(nl)
        d.special(s["<|im_start|>"]); d.text(assistant); d.text(nl); d.text(r1); d.special(s["<|im_end|>"]); d.text(nl)
    else:
        raise ValueError(f"chat format must be one of {CHAT_FORMATS}, got {fmt!r}")
    d.special(s["<|endoftext|>"])
    return d.parts


class ShardWriter:
    def __init__(self, out_dir: Path, name: str, meta: ShardMeta, labeler: Labeler):
        self.out_dir, self.name, self.meta, self.lab = out_dir, name, meta, labeler
        self.parts: list[Labeled] = []

    def add(self, parts: Iterable[Labeled]) -> None:
        self.parts.extend(parts)
        self.meta.n_docs += 1

    def close(self) -> ShardMeta:
        ids = np.concatenate([p.ids for p in self.parts]) if self.parts else np.zeros(0, np.int64)
        labels = np.concatenate([p.labels for p in self.parts]) if self.parts else np.zeros((0, TOKEN_K), np.uint16)
        valence = np.concatenate([p.valence for p in self.parts]) if self.parts else np.zeros(0, np.float32)
        pad = (-len(ids)) % CHUNK
        ids = np.concatenate([ids, np.full(pad, SPECIAL_IDS["<|pad|>"], np.int64)])
        labels = np.concatenate([labels, np.full((pad, TOKEN_K), NO_LABEL, np.uint16)])
        valence = np.concatenate([valence, np.zeros(pad, np.float32)])
        if ids.size and ids.max() > 0xFFFF:
            raise ValueError("token id does not fit uint16")
        self.out_dir.mkdir(parents=True, exist_ok=True)
        base = self.out_dir / self.name
        np.save(f"{base}.tokens.npy", ids.astype(np.uint16))
        np.save(f"{base}.token_labels.npy", labels)
        np.save(f"{base}.chunk_labels.npy", self.lab.chunk_labels(labels, valence))
        self.meta.n_tokens = int(len(ids))
        self.meta.save(Path(f"{base}.json"))
        return self.meta


# ---------------------------------------------------------------------------- stories


def _story_shard(args: tuple) -> ShardMeta:
    """(seed, shard, per_shard, out_dir, fmt, chat_share, tokenizer_file, lexicon_file[, grammar])."""
    seed, shard, per_shard, out_dir, fmt, chat_share, tokenizer_file, lexicon_file = args[:8]
    grammar = args[8] if len(args) > 8 else 1
    from train.concepts import Lexicon
    from train.stories import generate_story

    lab = Labeler(Lexicon.load(Path(lexicon_file)), tokenizer_file)
    name = f"stories-{fmt}-s{seed}-{shard:05d}" if grammar == 1 else f"stories-{fmt}-g{grammar}-s{seed}-{shard:05d}"
    meta = ShardMeta(name, "stories", 0, 0, TOKEN_K, CHUNK_K, fmt, sha256_file(tokenizer_file),
                     sha256_file(lexicon_file), seed, shard * per_shard)
    w = ShardWriter(Path(out_dir), name, meta, lab)
    first = shard * per_shard
    batch = 256
    for a in range(first, first + per_shard, batch):
        stories = [generate_story(seed, i, grammar) for i in range(a, min(a + batch, first + per_shard))]
        # chat or plain: decided from (seed, index) alone, like the story itself
        chat = [random.Random(seed * 7_919 + i * 31 + 1).random() < chat_share for i in range(a, a + len(stories))]
        plain = lab.label_texts([s.text for s, c in zip(stories, chat) if not c])
        eos = SPECIAL_IDS["<|endoftext|>"]
        k = 0
        for s, c in zip(stories, chat):
            if c:
                w.add(chat_document(lab, s.prompt, s.text, fmt))
                meta.n_chat_docs += 1
            else:
                d = DocumentBuilder()
                d.text(plain[k]); d.special(eos)
                k += 1
                w.add(d.parts)
    return w.close()


def generate_story_shards(out_dir: Path, n_tokens: int, seed: int, workers: int, chat_format: str,
                          chat_share: float, tokenizer_file: Path, lexicon_file: Path,
                          per_shard: int = STORIES_PER_SHARD, progress: bool = True,
                          grammar: int = 1) -> list[ShardMeta]:
    """Story shards until about `n_tokens` (shard count from ~155 tokens a story, measured), in parallel.
    grammar: train.stories' (2 varies the narration; shard names carry it)."""
    import multiprocessing as mp

    if chat_format not in CHAT_FORMATS:
        raise ValueError(f"chat format must be one of {CHAT_FORMATS}, got {chat_format!r}")
    if not 0.0 <= chat_share <= 1.0:
        raise ValueError(f"chat share must be in [0, 1], got {chat_share}")
    n_shards = max(1, -(-n_tokens // (per_shard * 155)))
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    os.environ["RAYON_NUM_THREADS"] = "1"
    jobs = [(seed, k, per_shard, str(out_dir), chat_format, chat_share, str(tokenizer_file), str(lexicon_file),
             grammar) for k in range(n_shards)]
    metas: list[ShardMeta] = []
    t0 = time.time()
    with mp.get_context("spawn").Pool(workers) as pool:
        for m in pool.imap_unordered(_story_shard, jobs):
            metas.append(m)
            if progress:
                done = sum(x.n_tokens for x in metas)
                print(f"\r[stories] {len(metas)}/{n_shards} shards, {done / 1e6:.1f}M tokens, "
                      f"{done / max(time.time() - t0, 1e-9) / 1e6:.2f}M tok/s", end="", flush=True)
    if progress:
        print()
    return sorted(metas, key=lambda m: m.name)


# ---------------------------------------------------------------------------- compressed prose

# Only the token ids travel (xz); the labels are recomputed on unpacking: each document is
# decoded and labeled again, and its re-encoding must give back the same ids (checked).
PACKED_SUFFIX = ".tokens.xz"


def pack_shard(shard_dir: Path, name: str, dst: Path) -> Path:
    base = shard_dir / name
    tokens = np.load(f"{base}.tokens.npy")
    meta = Path(f"{base}.json").read_bytes()
    header = len(meta).to_bytes(4, "little")
    out = dst / f"{name}{PACKED_SUFFIX}"
    out.write_bytes(lzma.compress(header + meta + tokens.astype("<u2").tobytes(), preset=9 | lzma.PRESET_EXTREME))
    return out


def _unpack_one(args: tuple[str, str, str, str]) -> str:
    packed, dst, tokenizer_file, lexicon_file = map(Path, args)
    from train.concepts import Lexicon

    raw = lzma.decompress(packed.read_bytes())
    n_meta = int.from_bytes(raw[:4], "little")
    meta = ShardMeta(**json.loads(raw[4:4 + n_meta]))
    tokens = np.frombuffer(raw[4 + n_meta:], "<u2").astype(np.int64)
    lab = Labeler(Lexicon.load(lexicon_file), tokenizer_file)
    if meta.tokenizer_sha256 != sha256_file(tokenizer_file):
        raise ValueError(f"{packed.name} was tokenized with another tokenizer.json")
    eos, pad = SPECIAL_IDS["<|endoftext|>"], SPECIAL_IDS["<|pad|>"]
    ends = np.flatnonzero(tokens == eos)
    w = ShardWriter(dst, meta.name, dataclasses_replace(meta, n_docs=0, n_tokens=0,
                                                         lexicon_sha256=sha256_file(lexicon_file)), lab)
    start = 0
    for e in ends:
        doc = tokens[start:e]
        text = lab.tok.decode(doc.tolist(), skip_special_tokens=False)
        piece = lab.label_text(text)
        if not np.array_equal(piece.ids, doc):
            raise ValueError(f"{packed.name}: a document does not re-encode to its ids")
        d = DocumentBuilder()
        d.text(piece)
        d.special(eos)
        w.add(d.parts)
        start = int(e) + 1
    if not (tokens[start:] == pad).all():
        raise ValueError(f"{packed.name}: tokens after the last document are not padding")
    w.close()
    return meta.name


def dataclasses_replace(meta: ShardMeta, **kw: object) -> ShardMeta:
    return ShardMeta(**dict(asdict(meta), **kw))


def unpack_shards(src: Path, dst: Path, tokenizer_file: Path, lexicon_file: Path, workers: int = 8) -> list[str]:
    """Unpack (and label) every packed shard of `src` into `dst`, skipping those already there."""
    import multiprocessing as mp

    dst.mkdir(parents=True, exist_ok=True)
    todo, names = [], []
    for packed in sorted(src.glob(f"*{PACKED_SUFFIX}")):
        name = packed.name[: -len(PACKED_SUFFIX)]
        names.append(name)
        if not (dst / f"{name}.json").exists():
            todo.append((str(packed), str(dst), str(tokenizer_file), str(lexicon_file)))
    if todo:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
        with mp.get_context("spawn").Pool(max(1, min(workers, len(todo)))) as pool:
            for name in pool.imap_unordered(_unpack_one, todo):
                print(f"[unpack] {name}", flush=True)
    return names
