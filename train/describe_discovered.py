"""Bundle time: describe every discovered concept of a Steerling bundle, for the catalog.

    python -m train.describe_discovered models/steerling-small [--sequences 384] [--seq-len 256]

Writes `discovered_concepts.parquet` (cde.steerling.catalog.DISCOVERED_FILE) into the bundle:
one row per discovered concept j, user-facing id n_known + j, with

- `concept_name`: "Discovered #N: tok1 / tok2 / tok3", the concept's top distinct tokens through
  the tied LM head (its embedding basis(coef[j]), unit length, scored against every head row, as
  steering_svc's `top_tokens` does);
- `concept_description`: those top tokens, then the text around the positions of a sample of the
  training data (the bundled prose in train/artifacts/prose and stories from train/stories.py,
  both deterministic) where the discovered head scores the concept highest;
- `top_token_ids`, `top_token_scores`, `top_snippets`, `top_snippet_scores`: the same as data.

The model runs on the CPU in fp32 (steerling-small: about a minute for the default sample). The
file holds no pickle and stays small (steerling-small: ~0.4 MB). Imported by no service.
"""

from __future__ import annotations

import argparse
import lzma
import time
from pathlib import Path

import numpy as np
import torch

from cde.checkpoint import CheckpointReader
from cde.steerling.catalog import DISCOVERED_FILE
from cde.steerling.config import SteerlingConfig
from cde.steerling.loading import embedding_name, load_model
from cde.steerling.model import dense_block_causal_attend
from cde.steerling.tokenizer import load_model_tokenizer

ROOT = Path(__file__).resolve().parents[1]
PROSE_DIR = ROOT / "train" / "artifacts" / "prose"
TOP_TOKENS = 10       # in the description and the data columns
NAME_TOKENS = 3       # in the name
SNIPPETS = 3          # top activating snippets per concept, from distinct sequences
CONTEXT_BEFORE, CONTEXT_AFTER = 12, 4   # tokens around the activating one


def discovered_top_tokens(model_dir: Path, cfg: SteerlingConfig, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(n_discovered, k) token ids and scores: each concept's unit embedding through the LM head."""
    with CheckpointReader(model_dir) as reader:
        coef = reader.get("unknown_head.embedding_coef.weight").float()[: cfg.n_discovered]
        basis = reader.get("unknown_head.embedding_basis.weight").float()
        head = reader.get(embedding_name(reader)).float()
    emb = torch.nn.functional.linear(coef, basis)             # (n_discovered, D)
    emb = emb / (emb.norm(dim=-1, keepdim=True) + 1e-12)
    values, ids = (emb @ head.t()).topk(k, dim=-1)
    return ids, values


def prose_documents(eos: int) -> list[np.ndarray]:
    """The bundled prose shards' documents (packed as train/shards.py:pack_shard writes them)."""
    docs = []
    for packed in sorted(PROSE_DIR.glob("*.tokens.xz")):
        raw = lzma.decompress(packed.read_bytes())
        n_meta = int.from_bytes(raw[:4], "little")
        tokens = np.frombuffer(raw[4 + n_meta:], "<u2").astype(np.int64)
        ends = np.flatnonzero(tokens == eos)
        starts = np.concatenate([[0], ends[:-1] + 1])
        docs.extend(tokens[s:e] for s, e in zip(starts, ends) if e - s >= 32)
    return docs


def sample_sequences(tok, cfg: SteerlingConfig, n: int, seq_len: int, seed: int) -> list[list[int]]:
    """n sequences of seq_len tokens: half prose windows, half stories, deterministic."""
    from train.stories import generate_story

    rng = np.random.default_rng(seed)
    out: list[list[int]] = []
    docs = prose_documents(cfg.eos_id)
    for i in rng.choice(len(docs), size=min(n // 2, len(docs)), replace=False) if docs else []:
        d = docs[int(i)]
        start = int(rng.integers(0, max(1, len(d) - seq_len)))
        out.append(d[start:start + seq_len].tolist())
    index = 0
    while len(out) < n:
        ids: list[int] = []
        while len(ids) < seq_len:
            ids += tok.encode(generate_story(seed, index).text + " ")
            index += 1
        out.append(ids[:seq_len])
    return out


def top_activations(model_dir: Path, cfg: SteerlingConfig, seqs: list[list[int]], batch: int = 16
                    ) -> list[list[tuple[float, int, int]]]:
    """Per discovered concept, its SNIPPETS best (logit, sequence, position), one per sequence,
    from the discovered head's top-k at every position of clean text."""
    model = load_model(model_dir, dtype=torch.float32).eval()
    n = cfg.n_discovered
    best = torch.full((len(seqs), n), -torch.inf)        # per sequence, each concept's best logit
    where = torch.zeros((len(seqs), n), dtype=torch.long)  # and its position
    with torch.inference_mode():
        for b in range(0, len(seqs), batch):
            part = seqs[b:b + batch]
            length = min(len(s) for s in part)
            x = torch.tensor([s[:length] for s in part])
            positions = torch.arange(length).expand(len(part), length)
            h = model.hidden_states(x, positions, dense_block_causal_attend(positions, cfg.diff_block_size))
            d_idx, d_logits = model.unknown_head.topk_of(h.reshape(len(part) * length, -1))  # as served
            k = d_idx.shape[-1]
            idx = d_idx.view(len(part), length * k).clamp(max=n)      # padding rows -> a spare column
            val = d_logits.view(len(part), length * k).float()
            pos = torch.arange(length).repeat_interleave(k).expand(len(part), -1)
            m = torch.full((len(part), n + 1), -torch.inf).scatter_reduce(1, idx, val, "amax")
            hit = val == m.gather(1, idx)                                      # the entries at the maximum
            w = torch.zeros((len(part), n + 1), dtype=torch.long)
            w.scatter_reduce_(1, idx, torch.where(hit, pos, torch.zeros_like(pos)), "amax", include_self=False)
            best[b:b + len(part)], where[b:b + len(part)] = m[:, :n], w[:, :n]
    top_v, top_s = best.topk(min(SNIPPETS, len(seqs)), dim=0)                 # (SNIPPETS, n)
    return [[(float(v), int(si), int(where[si, j])) for v, si in zip(top_v[:, j].tolist(), top_s[:, j].tolist())
             if v != -float("inf")] for j in range(n)]


def _clean(text: str) -> str:
    return " ".join(text.replace("\ufffd", "").split())


def snippet(tok, seq: list[int], pos: int) -> str:
    before = tok.decode(seq[max(0, pos - CONTEXT_BEFORE):pos])
    at = tok.decode(seq[pos:pos + 1])
    after = tok.decode(seq[pos + 1:pos + 1 + CONTEXT_AFTER])
    return _clean(f"{before}[[{at.strip() or at}]]{after}")


def token_label(tok, token_id: int) -> str:
    try:
        text = tok.token_bytes(int(token_id)).decode("utf-8", errors="replace")
    except ValueError:
        return f"<{token_id}>"
    s = text.strip()
    return s if s and s.isprintable() else repr(text)


def describe(model_dir: Path, n_sequences: int, seq_len: int, seed: int, log=print) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    t0 = time.time()
    cfg = SteerlingConfig.load(model_dir)
    tok = load_model_tokenizer(cfg, model_dir)
    ids, scores = discovered_top_tokens(model_dir, cfg, TOP_TOKENS)
    acts: list[list[tuple[float, int, int]]] = [[] for _ in range(cfg.n_discovered)]
    seqs: list[list[int]] = []
    if n_sequences:
        seqs = sample_sequences(tok, cfg, n_sequences, min(seq_len, cfg.block_size), seed)
        log(f"[describe] {len(seqs)} sequences x {len(seqs[0])} tokens sampled ({time.time() - t0:.1f}s)")
        acts = top_activations(model_dir, cfg, seqs)
        log(f"[describe] activations done ({time.time() - t0:.1f}s)")
    rows: dict[str, list] = {k: [] for k in ("concept_id", "concept_name", "concept_description", "top_token_ids",
                                             "top_token_scores", "top_snippets", "top_snippet_scores")}
    for j in range(cfg.n_discovered):
        cid = cfg.n_known + j
        labels = [token_label(tok, t) for t in ids[j].tolist()]
        distinct = list(dict.fromkeys(labels))
        snips = [snippet(tok, seqs[s], p) for _, s, p in acts[j]]
        desc = f"Discovered-head concept {j} (id {cid}). Top tokens through the LM head: {', '.join(distinct)}."
        if snips:
            desc += " Most active on: " + " | ".join(f"\u201c{s}\u201d" for s in snips)
        elif n_sequences:
            desc += " Never in the discovered head's top-k on the sampled training text."
        rows["concept_id"].append(cid)
        rows["concept_name"].append(f"Discovered #{cid}: " + " / ".join(distinct[:NAME_TOKENS]))
        rows["concept_description"].append(desc)
        rows["top_token_ids"].append([int(t) for t in ids[j].tolist()])
        rows["top_token_scores"].append([round(float(v), 5) for v in scores[j].tolist()])
        rows["top_snippets"].append(snips)
        rows["top_snippet_scores"].append([round(v, 4) for v, _, _ in acts[j]])
    table = pa.table({
        "concept_id": pa.array(rows["concept_id"], pa.int64()),
        "concept_name": pa.array(rows["concept_name"], pa.string()),
        "concept_description": pa.array(rows["concept_description"], pa.string()),
        "top_token_ids": pa.array(rows["top_token_ids"], pa.list_(pa.int32())),
        "top_token_scores": pa.array(rows["top_token_scores"], pa.list_(pa.float32())),
        "top_snippets": pa.array(rows["top_snippets"], pa.list_(pa.string())),
        "top_snippet_scores": pa.array(rows["top_snippet_scores"], pa.list_(pa.float32())),
    })
    out = model_dir / DISCOVERED_FILE
    pq.write_table(table, out, compression="zstd")
    log(f"[describe] wrote {out} ({out.stat().st_size / 1e6:.2f} MB, {cfg.n_discovered} concepts, "
        f"{sum(1 for a in acts if a)} with snippets, {time.time() - t0:.1f}s)")
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model_dir", type=Path)
    ap.add_argument("--sequences", type=int, default=384, help="sampled training sequences (0: top tokens only)")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    describe(args.model_dir, args.sequences, args.seq_len, args.seed)


if __name__ == "__main__":
    main()
