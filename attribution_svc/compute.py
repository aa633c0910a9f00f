"""Raw concept records -> labelled token and chunk attributions: the attribution service's math.

Pure functions plus one small per-stream state object, no gRPC: the servicer calls
`attribute_block` once per request message, tests call it (and `AttributionTables`) directly.

The math is `cde.steerling.attribution` (the public package's `AttributionAccumulator.commit`
and `chunk_attribution`); this module only backs its embedding lookups with four memory-mapped
checkpoint tensors (never the transformer), checks untrusted records, and keeps the still-open
chunk's token terms across the blocks of one stream.

Chunks: a chunk is the span between `<|endofchunk|>` tokens of the generated context; it
closes at an end-of-chunk token, at `<|eot_id|>`, at the generation's last block, or where a
context ends short of its block (cut at a stop token or at max_new_tokens). Its
length counts every position (never-committed ones have no terms), exactly as
`chunk_spans` + `chunk_scores` do over the whole sequence. Empty spans (two end-of-chunk
tokens in a row) are not reported.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from cde import limits
from cde.checkpoint import CheckpointError, CheckpointReader
from cde.rpc.v1 import attribution_pb2, common_pb2
from cde.steerling.attribution import (
    OtherConcepts,
    RawRecords,
    TokenAttribution,
    chunk_scores,
    split_listed,
    token_attribution,
    token_top_terms,
)
from cde.steerling.catalog import ConceptCatalog
from cde.steerling.config import SteerlingConfig
from cde.steerling.loading import embedding_name

KNOWN_EMBEDDING = "known_head.concept_embedding.weight"
DISC_COEF = "unknown_head.embedding_coef.weight"
DISC_BASIS = "unknown_head.embedding_basis.weight"
TOKEN_EMBEDDING = "transformer.tok_emb.weight"  # tied with the LM head
TENSOR_NAMES = (KNOWN_EMBEDDING, DISC_COEF, DISC_BASIS, TOKEN_EMBEDDING)

DEFAULT_TOP_K = limits.DEFAULT_ATTRIBUTION_TOP_K
MAX_TOP_K = limits.ATTRIBUTION_TOP_K_MAX

_TOKENS = (common_pb2.ATTRIBUTION_TOKENS, common_pb2.ATTRIBUTION_ALL)
_CHUNKS = (common_pb2.ATTRIBUTION_CHUNKS, common_pb2.ATTRIBUTION_ALL)
_MODES = (common_pb2.ATTRIBUTION_NONE, *_TOKENS, common_pb2.ATTRIBUTION_CHUNKS)


class RecordsError(ValueError):
    """A request message the service cannot attribute (answered INVALID_ARGUMENT)."""


class AttributionTables:
    """The four checkpoint tensors attribution needs, as memory-mapped views, and lookups over them.

    Lookups match the in-memory model's (`cde.steerling.attribution.model_lookups`) bit for bit:
    the discovered embedding is `embedding_basis(embedding_coef[ids])`, i.e. F.linear.
    """

    def __init__(self, cfg: SteerlingConfig, tensors: dict[str, Tensor]):
        expected = {KNOWN_EMBEDDING: (cfg.n_known_padded, cfg.n_embd),
                    DISC_COEF: (cfg.n_discovered_padded, cfg.factorize_rank),
                    DISC_BASIS: (cfg.n_embd, cfg.factorize_rank),
                    TOKEN_EMBEDDING: (cfg.vocab_size, cfg.n_embd)}
        if set(tensors) != set(expected):
            raise ValueError(f"need exactly the tensors {sorted(expected)}, got {sorted(tensors)}")
        for name, shape in expected.items():
            if tuple(tensors[name].shape) != shape:
                raise CheckpointError(f"{name}: expected shape {shape} from config.json, "
                                      f"got {tuple(tensors[name].shape)}")
        self.cfg = cfg
        self.tensors = dict(tensors)

    @classmethod
    def open(cls, model_dir: str | Path) -> AttributionTables:
        cfg = SteerlingConfig.load(model_dir)
        reader = CheckpointReader(model_dir)
        stored = {name: embedding_name(reader) if name == TOKEN_EMBEDDING else name for name in TENSOR_NAMES}
        return cls(cfg, {name: reader.get(stored[name]) for name in TENSOR_NAMES})  # zero-copy mmap views

    def known_embed(self, ids: Tensor) -> Tensor:
        return self.tensors[KNOWN_EMBEDDING][ids]

    def disc_embed(self, ids: Tensor) -> Tensor:
        return F.linear(self.tensors[DISC_COEF][ids], self.tensors[DISC_BASIS])

    def lm_rows(self, ids: Tensor) -> Tensor:
        return self.tensors[TOKEN_EMBEDDING][ids]


# ---- untrusted records -> RawRecords ----------------------------------------------------------

def _ints(values, what: str, n: int, bound: int) -> np.ndarray:
    arr = np.asarray(values, dtype=np.int64)
    if arr.shape[0] != n:
        raise RecordsError(f"{what}: {arr.shape[0]} values, expected {n}")
    if arr.size and int(arr.max()) >= bound:
        raise RecordsError(f"{what}: value {int(arr.max())} is out of range (< {bound})")
    return arr


def _floats(values, what: str, n: int) -> np.ndarray:
    arr = np.asarray(values, dtype=np.float32)
    if arr.shape[0] != n:
        raise RecordsError(f"{what}: {arr.shape[0]} values, expected {n}")
    if not np.isfinite(arr).all():
        raise RecordsError(f"{what}: values must be finite")
    return arr


def records_from_proto(msg: common_pb2.RawConceptRecords, cfg: SteerlingConfig, start: int,
                       block_end: int) -> RawRecords:
    """Check a block's records against the model and the block [start, block_end); raise RecordsError."""
    n = len(msg.positions)
    k_known, k_disc = msg.k_known, msg.k_disc
    max_known, max_disc = min(cfg.topk_known, cfg.n_known), min(cfg.topk_discovered, cfg.n_discovered)
    if k_known > max_known:
        raise RecordsError(f"k_known {k_known} exceeds the model's {max_known}")
    if k_disc > max_disc:
        raise RecordsError(f"k_disc {k_disc} exceeds the model's {max_disc}")
    positions = np.asarray(msg.positions, dtype=np.int64)
    if n and (int(positions.min()) < start or int(positions.max()) >= block_end):
        raise RecordsError(f"positions must lie in this block [{start}, {block_end})")
    if len(np.unique(positions)) != n:
        raise RecordsError("positions must not repeat")
    arrays = (
        positions,
        _ints(msg.tokens, "tokens", n, cfg.vocab_size),
        _floats(msg.target_logits, "target_logits", n),
        _ints(msg.known_idx, "known_idx", n * k_known, cfg.n_known).reshape(n, k_known),
        _floats(msg.known_logits, "known_logits", n * k_known).reshape(n, k_known),
        _ints(msg.disc_idx, "disc_idx", n * k_disc, cfg.n_discovered).reshape(n, k_disc),
        _floats(msg.disc_logits, "disc_logits", n * k_disc).reshape(n, k_disc),
    )
    return RawRecords(*(torch.from_numpy(a) for a in arrays))


# ---- per-stream chunk state -------------------------------------------------------------------

def _cat(parts: list[TokenAttribution]) -> TokenAttribution:
    return TokenAttribution(*(torch.cat([getattr(p, f) for p in parts])
                              for f in TokenAttribution.__dataclass_fields__))


def _rows(attr: TokenAttribution, idx: Tensor) -> TokenAttribution:
    return TokenAttribution(*(getattr(attr, f)[idx] for f in TokenAttribution.__dataclass_fields__))


@dataclass
class StreamState:
    """What one Attribute stream remembers between messages: the open chunk and where it is.

    `positions`/`terms` hold the committed rows at or after `chunk_start` (the open chunk and,
    transiently, a block's later rows). Reset when the generation ends (stop token or last).
    """

    next_start: int | None = None     # where the next block must start (None: anywhere)
    chunk_start: int | None = None
    positions: Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))
    terms: TokenAttribution | None = None

    def reset(self) -> None:
        self.next_start = self.chunk_start = None
        self.positions = torch.zeros(0, dtype=torch.long)
        self.terms = None


def _score_messages(catalog: ConceptCatalog, scored) -> list[common_pb2.ConceptScore]:
    return [common_pb2.ConceptScore(concept_id=s.concept_id, label=catalog.label(s.concept_id), head=s.head,
                                    score=s.score) for s in scored]


def _close_chunk(state: StreamState, end: int, n_known: int, top_k: int,
                 catalog: ConceptCatalog) -> common_pb2.ChunkAttribution | None:
    """Score the open chunk [chunk_start, end) and open the next one after the boundary at `end`."""
    start = state.chunk_start
    assert start is not None and state.terms is not None
    state.chunk_start = end + 1
    if end <= start:
        return None
    inside = ((state.positions >= start) & (state.positions < end)).nonzero().squeeze(1)
    inside = inside[state.positions[inside].argsort(stable=True)]  # position order, as the reference
    scores, residual_pct = chunk_scores(state.terms, inside.tolist(), end - start, n_known)
    listed, other = split_listed(scores, top_k)
    return common_pb2.ChunkAttribution(start=start, end=end, residual_pct=residual_pct,
                                       top=_score_messages(catalog, listed), other=_other_message(other))


def _other_message(other: OtherConcepts) -> common_pb2.OtherConcepts:
    return common_pb2.OtherConcepts(known=other.known, discovered=other.discovered)


def token_messages(records: RawRecords, attr: TokenAttribution, n_known: int, top_k: int,
                   catalog: ConceptCatalog) -> list[common_pb2.TokenAttribution]:
    """One TokenAttribution per committed token, in position order (records come in commit order,
    kept as `commit_order`): its top_k concepts of both heads by |contribution|, and the rest of
    its record summed per head (`other`), so the terms add up to the logit."""
    terms = token_top_terms(attr, top_k, n_known)
    kk = terms.k_known
    order, top_ids, top_scores = terms.columns.tolist(), terms.concept_ids.tolist(), terms.scores.tolist()
    out = []
    for i, (pos, tok, target, resid, ok, od) in enumerate(zip(
            records.positions.tolist(), records.tokens.tolist(), attr.target_logits.tolist(), attr.residual.tolist(),
            terms.other_known.tolist(), terms.other_discovered.tolist())):
        top = [common_pb2.ConceptScore(concept_id=cid, label=catalog.label(cid),
                                       head="known" if col < kk else "discovered", score=s)
               for col, cid, s in zip(order[i], top_ids[i], top_scores[i])]
        out.append(common_pb2.TokenAttribution(position=pos, token=tok, target_logit=target, residual=resid, top=top,
                                               other=common_pb2.OtherConcepts(known=ok, discovered=od),
                                               commit_order=i))
    out.sort(key=lambda t: t.position)
    return out


def attribute_block(tables: AttributionTables, catalog: ConceptCatalog, state: StreamState,
                    request: attribution_pb2.AttributeRequest) -> attribution_pb2.AttributeResponse:
    """Attribute one committed block and advance the stream's chunk state.

    Raises RecordsError, leaving `state` untouched, when the message is malformed.
    """
    cfg = tables.cfg
    if request.mode not in _MODES:
        raise RecordsError(f"unknown attribution mode {request.mode}")
    top_k = min(request.top_k or DEFAULT_TOP_K, MAX_TOP_K)
    start = request.start
    block_end = (start // cfg.diff_block_size + 1) * cfg.diff_block_size
    context = list(request.context_tokens)
    if start + len(context) > block_end:
        raise RecordsError(f"{len(context)} context tokens from {start} run past the block's end {block_end}")
    if context and max(context) >= cfg.vocab_size:
        raise RecordsError(f"context token {max(context)} is out of range (< {cfg.vocab_size})")
    if state.next_start is not None and start != state.next_start:
        raise RecordsError(f"block starts at {start}, expected {state.next_start} (the previous block's end)")
    records = records_from_proto(request.records, cfg, start, block_end)
    # <|eot_id|> turns every later position into EOS, including positions committed in earlier
    # steps (the reference generator does the same): their records describe tokens that are not
    # in the output, so they are dropped rather than attributed.
    overwritten = [i for i, pos in enumerate(records.positions.tolist())
                   if pos < start + len(context) and context[pos - start] == cfg.eos_id
                   and records.tokens[i].item() != cfg.eos_id]
    if overwritten:
        keep = torch.tensor(sorted(set(range(len(records))) - set(overwritten)), dtype=torch.long)
        records = RawRecords(*(getattr(records, f)[keep] for f in RawRecords.__dataclass_fields__))
    for pos, tok in zip(records.positions.tolist(), records.tokens.tolist()):
        if pos < start + len(context) and context[pos - start] != tok:
            raise RecordsError(f"position {pos}: record token {tok} differs from context token {context[pos - start]}")
        if pos == start + len(context) and tok == cfg.eot_id:
            context.append(tok)  # the context was cut just before the stop token: put it back
    stop = next((i for i, tok in enumerate(context) if tok == cfg.eot_id), None)
    # A context that ends before the block does is cut at a stop token (the caller knows stop ids
    # we do not) or at max_new_tokens: either way the generation ends here, as with last=True.
    ends = stop is not None or request.last or start + len(context) < block_end

    attr = token_attribution(records, tables.known_embed, tables.disc_embed, tables.lm_rows)
    response = attribution_pb2.AttributeResponse(request_id=request.request_id, block_index=request.block_index)
    if request.mode in _TOKENS:
        response.token_attributions.extend(token_messages(records, attr, cfg.n_known, top_k, catalog))

    # Chunks: the state advances whatever the mode, so a later message may ask for chunks.
    if state.chunk_start is None:
        state.chunk_start = start
    state.positions = torch.cat([state.positions, records.positions])
    state.terms = attr if state.terms is None else _cat([state.terms, attr])
    end = len(context) if stop is None else stop
    boundaries = [i for i in range(end) if context[i] == cfg.endofchunk_id]
    if ends:
        boundaries.append(end)  # the stop token (excluded, as chunk_spans does) or the context's end
    closed = [_close_chunk(state, start + i, cfg.n_known, top_k, catalog) for i in boundaries]
    if request.mode in _CHUNKS:
        response.chunk_attributions.extend(c for c in closed if c is not None)
    if ends:
        state.reset()
    else:
        keep = (state.positions >= state.chunk_start).nonzero().squeeze(1)
        state.positions, state.terms = state.positions[keep], _rows(state.terms, keep)
        state.next_start = start + len(context)
    return response
