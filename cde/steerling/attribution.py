"""Concept attribution as pure functions over raw concept records.

For a committed token y with top-k concepts from the forward pass that committed it:
    C(c_i, y) = sigmoid(logit_i) * (E_i . W_lm[y])
for every top-k concept of both heads; the residual is target_logit(y) - sum_i C(c_i, y),
so each token's terms sum exactly to its logit. A chunk (span between `<|endofchunk|>`
tokens) scores concept i as the mean over its tokens of C_i,t / (sum_j |C_j,t| + |eps_t|).
Discovered concepts get user-facing ids offset by the number of known concepts.
This is the public package's `AttributionAccumulator.commit` and `chunk_attribution`.

Reproducible to the bit: every sum (the dot products, a token's terms, a chunk's mass per
concept and its residual share) accumulates in float64 in a fixed order and is rounded to
float32 once at the end, so the kernel a BLAS picks for a block's size or thread count
cannot change a result, and a replayed or re-placed request gets identical attributions.
Served attributions list only the `top_k` terms by |score|; `token_top_terms` and `split_listed`
also return, per head, the sum of the terms left out ("other"), so that for every token
    sum(listed) + other.known + other.discovered + residual == target_logit
whatever `top_k` is (and for a chunk, listed + other == the sum over all of its concepts).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class RawRecords:
    """Raw concept records of committed tokens, as the engine emits them (n tokens)."""

    positions: Tensor      # (n,) absolute positions
    tokens: Tensor         # (n,) committed ids
    target_logits: Tensor  # (n,) raw model logit of the committed id
    known_idx: Tensor      # (n, k_known)
    known_logits: Tensor   # (n, k_known)
    disc_idx: Tensor       # (n, k_disc)
    disc_logits: Tensor    # (n, k_disc)

    @staticmethod
    def cat(parts: Sequence[RawRecords]) -> RawRecords:
        return RawRecords(*(torch.cat([getattr(p, f) for p in parts]) for f in RawRecords.__dataclass_fields__))

    def __len__(self) -> int:
        return int(self.tokens.shape[0])


@dataclass
class TokenAttribution:
    """Per-token contributions; known_contrib.sum(-1) + disc_contrib.sum(-1) + residual == target."""

    known_idx: Tensor
    known_weight: Tensor
    known_contrib: Tensor
    disc_idx: Tensor
    disc_weight: Tensor
    disc_contrib: Tensor
    residual: Tensor
    target_logits: Tensor


# Embedding lookups: ids (n, k) -> (n, k, D). The attribution service backs these with
# memory-mapped checkpoint tensors; in-process callers pass the model's heads.
EmbedFn = Callable[[Tensor], Tensor]
LmRowsFn = Callable[[Tensor], Tensor]


_DOT_CHUNK = 1 << 21   # float64 elements per product tile (16 MiB)


def _row_dots(embed: Tensor, w_y: Tensor) -> Tensor:
    """(n, k, D) . (n, D) -> (n, k) in float64, each dot product summed in one fixed order.

    Not einsum/bmm: a BLAS picks its kernel (and summation order) by the row count, so a row's
    result would change with the company it is computed in, by an ulp that float32 rounding
    sometimes keeps. An elementwise product reduced over the last dim sums every row the same
    way whatever n is; rows go in tiles to bound the temporary."""
    n, k, d = embed.shape
    rows = max(1, _DOT_CHUNK // max(1, k * d))
    out = torch.empty(n, k, dtype=torch.float64)
    for i in range(0, n, rows):
        out[i:i + rows] = (embed[i:i + rows].double() * w_y[i:i + rows, None, :]).sum(-1)
    return out


def _sigmoid(logits: Tensor) -> Tensor:
    """float64 sigmoid of each value by libm, so a value's result does not depend on the tensor
    it sits in (torch's vectorized and scalar-tail exp paths differ by an ulp)."""
    def one(v: float) -> float:
        if v >= 0:
            return 1.0 / (1.0 + math.exp(-v))
        e = math.exp(v)
        return e / (1.0 + e)
    flat = [one(v) for v in logits.double().reshape(-1).tolist()]
    return torch.tensor(flat, dtype=torch.float64).reshape(logits.shape)


def _row_sums(x: Tensor) -> Tensor:
    """(n, k) -> (n,), left to right over k: a reduction kernel may vectorize a short inner dim
    across rows for one n and not another, which changes the order."""
    acc = torch.zeros(x.shape[0], dtype=x.dtype)
    for j in range(x.shape[1]):
        acc = acc + x[:, j]
    return acc


@torch.no_grad()
def token_attribution(records: RawRecords, known_embed: EmbedFn, disc_embed: EmbedFn,
                      lm_rows: LmRowsFn) -> TokenAttribution:
    """Contributions of every top-k concept to each committed token's logit (fp32 results,
    accumulated in float64: see the module docstring). Every row is computed alone: its result
    is the same to the bit in a block of 64, alone, or in any other company."""
    w_y = lm_rows(records.tokens).double()                                  # (n, D)
    k_w = _sigmoid(records.known_logits.float())
    k_contrib = k_w * _row_dots(known_embed(records.known_idx), w_y)
    d_w = _sigmoid(records.disc_logits.float())
    d_contrib = d_w * _row_dots(disc_embed(records.disc_idx), w_y)
    target = records.target_logits.float()
    residual = target.double() - _row_sums(k_contrib) - _row_sums(d_contrib)
    return TokenAttribution(records.known_idx, k_w.float(), k_contrib.float(), records.disc_idx, d_w.float(),
                            d_contrib.float(), residual.float(), target)


def model_lookups(model) -> tuple[EmbedFn, EmbedFn, LmRowsFn]:
    """Lookups backed by an in-memory SteerlingModel."""
    lm = model.transformer.lm_head.weight
    return model.known_head.embeddings, model.unknown_head.embeddings, lambda ids: lm[ids]


def chunk_spans(tokens: Sequence[int], endofchunk_id: int, stop_ids: Sequence[int] = (),
                include_final: bool = True) -> list[tuple[int, int]]:
    """Half-open spans between end-of-chunk tokens (excluded), ending at the first stop token."""
    stops = set(stop_ids)
    end = len(tokens)
    hit_stop = False
    for i, t in enumerate(tokens):
        if t in stops:
            end, hit_stop = i, True
            break
    spans, prev = [], 0
    for i in range(end):
        if tokens[i] == endofchunk_id:
            spans.append((prev, i))
            prev = i + 1
    if prev < end and (hit_stop or include_final):
        spans.append((prev, end))
    return spans


@dataclass(frozen=True)
class ConceptScore:
    concept_id: int        # user-facing: discovered ids offset by n_known
    head: str              # "known" | "discovered"
    score: float


def chunk_scores(attr: TokenAttribution, rows: Sequence[int], span_len: int, n_known: int,
                 top: int | None = None) -> tuple[list[ConceptScore], float]:
    """Score concepts over a chunk: rows are the committed tokens of the chunk (indices into attr),
    span_len its length in positions (uncommitted positions count as zero, as in the reference).

    Returns scores sorted by |score| (optionally the first `top`) and the residual's share in %.
    """
    if span_len <= 0:
        return [], 0.0
    idx = torch.as_tensor(list(rows), dtype=torch.long)
    k_c, u_c, eps = attr.known_contrib[idx].double(), attr.disc_contrib[idx].double(), attr.residual[idx].double()
    total = (k_c.abs().sum(-1) + u_c.abs().sum(-1) + eps.abs()).clamp(min=1e-8)
    out: list[ConceptScore] = []
    for head, ids, contrib, offset in (("known", attr.known_idx[idx], k_c, 0),
                                       ("discovered", attr.disc_idx[idx], u_c, n_known)):
        flat = ids.reshape(-1)
        uniq, inverse = flat.unique(return_inverse=True)
        mass = torch.zeros(len(uniq), dtype=torch.float64)   # summed in row order (CPU scatter_add)
        mass.scatter_add_(0, inverse, (contrib / total[:, None]).reshape(-1))
        scores = (mass / span_len).float()   # rounded to float32 once
        out += [ConceptScore(int(c) + offset, head, s) for c, s in zip(uniq.tolist(), scores.tolist())]
    out.sort(key=lambda s: abs(s.score), reverse=True)
    eps_pct = float(((eps / total).sum() / len(idx) * 100).float()) if len(idx) else 0.0
    return (out[:top] if top is not None else out), eps_pct


@dataclass(frozen=True)
class OtherConcepts:
    """Summed scores, per head, of the concepts of a record that are not listed."""

    known: float = 0.0
    discovered: float = 0.0


@dataclass
class TopTerms:
    """Each token's listed terms (its top_k by |contribution|, both heads) and the rest, summed per head."""

    columns: Tensor          # (n, m) int64 column in [known terms | discovered terms] (m = min(top_k, k_known + k_disc))
    concept_ids: Tensor      # (n, m) user-facing ids (discovered offset by n_known)
    scores: Tensor           # (n, m) fp32 contributions
    other_known: Tensor      # (n,) fp32 sum of the known terms not listed
    other_discovered: Tensor  # (n,) fp32 sum of the discovered terms not listed
    k_known: int             # columns below this are known-head terms


def token_top_terms(attr: TokenAttribution, top_k: int, n_known: int) -> TopTerms:
    """The top_k terms of each token by |contribution| (ties: lower column first) and the sum,
    per head, of the others: listed + other_known + other_discovered + residual == target."""
    kk = attr.known_contrib.shape[1]
    scores = torch.cat([attr.known_contrib, attr.disc_contrib], dim=1).float()
    ids = torch.cat([attr.known_idx, attr.disc_idx + n_known], dim=1)
    order = scores.abs().argsort(dim=1, descending=True, stable=True)[:, :top_k]
    listed = torch.zeros_like(scores, dtype=torch.bool).scatter_(1, order, True)
    rest = scores.masked_fill(listed, 0.0)
    return TopTerms(order, ids.gather(1, order), scores.gather(1, order), rest[:, :kk].sum(-1), rest[:, kk:].sum(-1),
                    kk)


def split_listed(scores: Sequence[ConceptScore], top: int | None) -> tuple[list[ConceptScore], OtherConcepts]:
    """The first `top` of scores sorted by |score| (all when None) and the rest summed per head."""
    listed = list(scores if top is None else scores[:top])
    rest = [] if top is None else scores[top:]
    return listed, OtherConcepts(sum(s.score for s in rest if s.head == "known"),
                                 sum(s.score for s in rest if s.head == "discovered"))
