"""The concept bottleneck: a dense known head and a factorized discovered head.

Both heads read the final hidden state h (after ln_f). Each scores its concepts, keeps the
top-k, and mixes the chosen concept embeddings weighted by sigmoid(logit). Memory bound:
tokens are scored `TOKEN_CHUNK` (512) at a time against as many concepts as fit in
`SCORE_BUDGET` fp32 scores (64 Mi elements = 256 MiB; at most `concept_chunk` fewer never),
so one pass holds at most 256 MiB of scores plus O(tokens x k) for the running top-k,
whatever the input length: the (tokens x 101,200) logit matrix of a long input is never
formed. At 512 tokens the whole 101,200-concept head fits in one pass, so a decode step
does one top-k per head instead of dozens of chunk merges (much faster on a GPU).
Embeddings of the selected concepts are mixed with `embedding_bag`, which does not
materialize (tokens x k x D) either.

Parameter names and ranking rules follow the public `steerling` package exactly: the known
head ranks by sigmoid of the clamped logit, the discovered head by the clamped logit.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

LOGIT_CLAMP = 15.0
TOKEN_CHUNK = 512
SCORE_BUDGET = 1 << 26


def concept_chunk(configured: int) -> int:
    """Concepts per scoring pass: as many as the budget allows for a full token chunk.

    A constant (not a function of the row count), so a compiled step does not specialize on it.
    """
    return max(configured, SCORE_BUDGET // TOKEN_CHUNK)


def streaming_topk(
    h: Tensor, weight: Tensor, k: int, chunk: int, rank_by_sigmoid: bool, n_valid: int | None = None
) -> tuple[Tensor, Tensor]:
    """Top-k concepts of `h @ weight.T` (clamped, fp32) without the full score matrix.

    h: (N, d); weight: (C', d), of which the first C = n_valid (default all) rows are
    concepts and the rest padding. Returns (indices, logits), (N, k'), with k' = min(k, C),
    ordered by descending rank value.
    """
    n, c = h.shape[0], weight.shape[0] if n_valid is None else n_valid
    k = min(k, c)
    top_key = top_idx = top_logit = None
    for start in range(0, c, chunk):
        end = min(start + chunk, c)
        # the last pass multiplies the padding rows too and drops their scores: an output width
        # of 33,732 (not a multiple of 8) makes cuBLAS fall back to a slow unaligned kernel
        stop = weight.shape[0] if end == c else end
        logits = (h @ weight[start:stop].t().to(h.dtype))[:, : end - start]
        logits = logits.float().clamp_(-LOGIT_CLAMP, LOGIT_CLAMP)
        key = torch.sigmoid(logits) if rank_by_sigmoid else logits
        kk = min(k, end - start)
        v, i = torch.topk(key, kk, dim=1)
        lg = logits.gather(1, i)
        i = i + start
        if top_key is None:
            top_key, top_idx, top_logit = v, i, lg
        else:
            cand_v = torch.cat([top_key, v], dim=1)
            sel_v, sel = torch.topk(cand_v, min(k, cand_v.shape[1]), dim=1)
            top_idx = torch.cat([top_idx, i], dim=1).gather(1, sel)
            top_logit = torch.cat([top_logit, lg], dim=1).gather(1, sel)
            top_key = sel_v
    assert top_idx is not None and top_logit is not None and n == top_idx.shape[0]
    return top_idx, top_logit


def _by_token_chunks(fn, h: Tensor, token_chunk: int | None):
    """Apply fn to row chunks of h, concatenating results. token_chunk=None: one pass (the
    caller bounds the rows, as the engine does per step; keeps compiled shapes generic)."""
    if token_chunk is None or h.shape[0] <= token_chunk:
        return fn(h)
    outs = [fn(h[s:s + token_chunk]) for s in range(0, h.shape[0], token_chunk)]
    return tuple(torch.cat(parts, dim=0) for parts in zip(*outs))


class KnownHead(nn.Module):
    """Dense known-concept head: `concept_predictor` (C x D) and `concept_embedding` (C x D)."""

    def __init__(self, n_concepts: int, n_padded: int, n_embd: int, topk: int, chunk: int):
        super().__init__()
        self.n_concepts, self.topk, self.chunk = n_concepts, topk, chunk
        self.concept_predictor = nn.Linear(n_embd, n_padded, bias=False)
        self.concept_embedding = nn.Embedding(n_padded, n_embd)

    def embeddings(self, ids: Tensor) -> Tensor:
        return self.concept_embedding.weight[ids]

    def topk_of(self, h: Tensor, token_chunk: int | None = TOKEN_CHUNK) -> tuple[Tensor, Tensor]:
        w = self.concept_predictor.weight
        return _by_token_chunks(
            lambda x: streaming_topk(x, w, self.topk, concept_chunk(self.chunk), True, self.n_concepts), h, token_chunk)

    def mix(self, idx: Tensor, weights: Tensor) -> Tensor:
        """sum_i weights_i * E[idx_i] per row, without forming (N, k, D)."""
        table = self.concept_embedding.weight
        return F.embedding_bag(idx, table, per_sample_weights=weights.to(table.dtype), mode="sum")

    def features(self, idx: Tensor, logits: Tensor) -> Tensor:
        return self.mix(idx, torch.sigmoid(logits))


class DiscoveredHead(nn.Module):
    """Factorized discovered ("unknown") head: logits = up(down(h)); E = basis(coef)."""

    def __init__(self, n_concepts: int, n_padded: int, n_embd: int, rank: int, topk: int, chunk: int):
        super().__init__()
        self.n_concepts, self.topk, self.chunk = n_concepts, topk, chunk
        self.embedding_coef = nn.Embedding(n_padded, rank)
        self.embedding_basis = nn.Linear(rank, n_embd, bias=False)
        self.predictor_down = nn.Linear(n_embd, rank, bias=False)
        self.predictor_up = nn.Linear(rank, n_padded, bias=False)

    def embeddings(self, ids: Tensor) -> Tensor:
        return self.embedding_basis(self.embedding_coef.weight[ids])

    def up_weight_fp32(self) -> Tensor:
        """predictor_up in fp32 (the scores' precision), cast once per weight version: in a bf16
        model the cast of 101,200 x 256 weights was a 100 MB copy in every decode step."""
        w = self.predictor_up.weight
        if w.dtype == torch.float32:
            return w
        key = (w.data_ptr(), w._version, w.device)
        if getattr(self, "_up_fp32_key", None) != key:
            self._up_fp32, self._up_fp32_key = w.detach().float(), key
        return self._up_fp32

    def topk_of(self, h: Tensor, token_chunk: int | None = TOKEN_CHUNK) -> tuple[Tensor, Tensor]:
        up = self.up_weight_fp32()
        down = self.predictor_down.weight

        def one(x: Tensor) -> tuple[Tensor, Tensor]:
            compressed = (x @ down.t()).float()
            return streaming_topk(compressed, up, self.topk, concept_chunk(self.chunk), False, self.n_concepts)

        return _by_token_chunks(one, h, token_chunk)

    def features(self, idx: Tensor, logits: Tensor) -> Tensor:
        table = self.embedding_coef.weight
        coef = F.embedding_bag(idx, table, per_sample_weights=torch.sigmoid(logits).to(table.dtype), mode="sum")
        return coef @ self.embedding_basis.weight.t().to(coef.dtype)
