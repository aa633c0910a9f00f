"""Device side of one engine step: the forward over a batch of 64-token rows, then the sampler.

Every forward processes R rows; a row is one 64-token block of one request that attends to
its request's pages up to and including its own (block-causal attention = "all earlier
pages + my page"). A decode row is a request's active block (some positions still masked);
a commit row is a finished block (prompt block at prefill, or a generated block after its
last token) whose final K/V must be written once. Per layer, every row first writes its K/V
into its own page, then attends over the pages it may see, so a request's commit rows and
decode row can share a step.

Concept heads only where they are needed. Token logits are needed only at the masked
positions of decode rows (the confidence pass and the draw) and concept records only at the
positions a step commits, which are a subset of those. So the step compacts: `compact_heads`
puts the flat indices of the candidate positions (masked, on a decode row, within the row's
host bound) first, in order, into a fixed number HB of head rows (the host's bucket of an upper
bound on the candidates; padding entries point at position 0, a real hidden state whose
results are never read), `model.heads` runs on those HB hidden states only, and the sampler
scatters their confidences back into (R, 64) (-inf elsewhere) and gathers the chosen
positions' logits and records through the position -> head-row map. A step without decode
rows (HB = 0: prompt blocks and block commits only) runs no heads and no sampler at all.

Why the output is unchanged: the heads are row-wise, each position's concept top-k, composed
features and logits are a function of its own hidden state only, so computing them for a
subset of rows changes which rows are computed, not their arithmetic (the reference decoder
itself scores only the masked positions). The float64 CPU tests check it token for token and
record for record. On a GPU, fp32/bf16 GEMMs may pick another kernel or split for another
row count, so a row's logits can differ in the last bit between batch shapes (as they already
did between row buckets); the CPU tests do not see that.

A step is two parts with their own shapes: the trunk (`trunk`: the rows' tokens, the
forward, the K/V writes), whose shapes are (rows, pages), and the heads and sampler
(`heads_and_sample`), whose shapes are (rows, tokens per step, head rows). Each has fixed shapes
for its bucket: no Python branching on data, steering always in, so they compile once and are
captured as separate CUDA graphs (steerling_engine.py says why two).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor

from cde.blocks import BLOCK
from cde.steerling import kernels
from cde.steerling.model import HeadsOutput, SteeringInputs, SteerlingModel
from cde.steerling.sampling import draw, entropy_temperature, most_confident, top_p_filter
from worker_svc.engine.attention import BlockKernelUse, block_rows_attend
from worker_svc.engine.kv_cache import KVCache
from worker_svc.engine.layouts import TOP_LOGPROBS, BlockResultLayout


@dataclass
class ForwardInputs:   # fields hold numpy arrays while the host fills them (runtime.to_device)
    tokens: Tensor        # (R, 64) long; pad id beyond the row's length
    positions: Tensor     # (R, 64) long absolute positions
    write_page: Tensor    # (R,) physical page of the row's own block
    pages: Tensor         # (R, P) physical pages of blocks 0..block (padded with scratch page 0)
    n_visible: Tensor     # (R,) long: number of valid keys = 64 * block + row_len
    steer_slot: Tensor    # (R,) long: the request's slot (steering table, block-token table)
    alpha: Tensor         # (R,) fp32 current steering strength (0 = off)
    inject_layer: Tensor  # (R,) long
    from_table: Tensor    # (R,) bool: take the row's tokens from the slot's block-token table (the
                          # previous step's samples are not on the host yet: overlapped steps)


@dataclass
class SamplerInputs:
    decode: Tensor        # (R,) bool: sample this row (commit rows do not)
    slot: Tensor          # (R,) long: index into seen / relu tables
    rep: Tensor           # (R,) fp32 repetition penalty
    greedy: Tensor        # (R,) bool
    entropy: Tensor       # (R,) bool entropy-adaptive temperature
    temperature: Tensor   # (R,) fp32
    top_p: Tensor         # (R,) fp32
    seed: Tensor          # (R,) long
    step: Tensor          # (R,) long: the request's step counter
    tokens_per_step: Tensor  # (R,) long
    threshold: Tensor     # (R,) fp32 confidence threshold (-inf = off)
    heads: Tensor         # (R,) long: most masked positions of the row that get heads (the host's
                          # upper bound; 0 on commit rows). Caps a row whose block an <|eot_id|>
                          # filled differently than an overlapped launch assumed (its results are
                          # dropped), so the step's candidates never exceed its head rows.


@dataclass
class HeadInputs:
    """What the heads and sampler need of the step's rows besides the trunk's outputs."""

    positions: Tensor     # (R, 64) long absolute positions (ForwardInputs.positions)
    n_visible: Tensor     # (R,) long (ForwardInputs.n_visible): a row's length is n_visible - positions[:, 0]


@dataclass
class HeadRows:
    """Which positions of a step the heads run on (`compact_heads`)."""

    flat: Tensor          # (HB,) long: row * 64 + position of each head row; candidates first, in order
    index: Tensor         # (R, 64) long: a candidate's head row (clamped into [0, HB) elsewhere)
    candidate: Tensor     # (R, 64) bool: masked, on a decode row, within the row's bound


def compact_heads(tokens: Tensor, mask_id: int, decode: Tensor, bound: Tensor, head_rows: int) -> HeadRows:
    """The step's candidate positions compacted into `head_rows` entries with a cumsum scatter:
    fixed shapes, no host sync (CUDA-graph capturable). The host guarantees sum(bound) <= head_rows."""
    masked = (tokens == mask_id) & decode[:, None]
    rank_in_row = torch.cumsum(masked.long(), 1) - 1
    candidate = masked & (rank_in_row < bound[:, None])
    flat_candidate = candidate.reshape(-1)
    rank = torch.cumsum(flat_candidate.long(), 0) - 1
    # non-candidates all land on the extra entry `head_rows`, which is cut off
    dest = torch.where(flat_candidate, rank, torch.full_like(rank, head_rows))
    flat = torch.zeros(head_rows + 1, dtype=torch.long, device=tokens.device)
    flat.scatter_(0, dest, torch.arange(flat_candidate.numel(), device=tokens.device))
    index = rank.clamp(0, head_rows - 1).view_as(tokens)
    return HeadRows(flat[:head_rows], index, candidate)


class DeviceTables:
    """Per-slot state that lives on the device: steering vectors, relu masks, seen-token bitmaps.

    Slot 0 is scratch (padding rows point at it).
    """

    def __init__(self, n_slots: int, n_embd: int, vocab: int, dtype: torch.dtype, device):
        self.steer = torch.zeros(n_slots, n_embd, dtype=dtype, device=device)
        self.relu = torch.zeros(n_slots, vocab, dtype=torch.float32, device=device)
        self.seen = torch.zeros(n_slots, vocab, dtype=torch.bool, device=device)
        # each request's active block as the device last left it (its decode row's tokens after
        # the step's samples and an <|eot_id|> fill): the input of a step launched before the
        # previous one's results reached the host
        self.block_tokens = torch.zeros(n_slots, BLOCK, dtype=torch.long, device=device)
        # the ids a constrained request's grammar allows at its next position (all True otherwise)
        self.allow = torch.ones(n_slots, vocab, dtype=torch.bool, device=device)


class StepRunner:
    def __init__(self, model: SteerlingModel, kv: KVCache, tables: DeviceTables, banned: Tensor):
        self.model = model
        self.cfg = model.cfg
        self.kv = kv
        self.tables = tables
        vocab = self.cfg.vocab_size
        self.banned_mask = torch.zeros(vocab, dtype=torch.bool, device=banned.device)
        self.banned_mask[banned] = True
        self.banned_mask[self.cfg.eos_id] = True
        self.kernels = kernels.EAGER   # the engine swaps in compiled ones (SteerlingEngine._compile)
        self.block_kernel = BlockKernelUse()   # Triton attention over the pages in place (CUDA, bf16/fp16)
        self.heads_rows = 0            # rows model.heads received, summed over eager calls

    def resolve_tokens(self, inp: ForwardInputs) -> Tensor:
        """The rows' tokens: the host's, or the block-token table's for `from_table` rows."""
        table = self.tables.block_tokens.index_select(0, inp.steer_slot)
        return torch.where(inp.from_table[:, None], table, inp.tokens)

    # ---- the trunk ----------------------------------------------------------------------
    def hidden_states(self, inp: ForwardInputs) -> Tensor:
        """The rows' final hidden states (R * 64, D); every row writes its K/V on the way."""
        cfg = self.cfg
        attend = block_rows_attend(self.kv, inp.write_page, inp.pages, inp.n_visible, self.block_kernel)
        steering = SteeringInputs(self.tables.steer.index_select(0, inp.steer_slot), inp.alpha,
                                  (inp.tokens == cfg.mask_id).float(), inp.inject_layer)
        h = self.model.hidden_states(inp.tokens, inp.positions, attend, steering)
        return h.reshape(-1, h.shape[-1])

    def trunk(self, fwd: ForwardInputs) -> tuple[Tensor, Tensor]:
        """The rows' tokens (`resolve_tokens`) and final hidden states (R * 64, D): everything of
        a step that reads the page table."""
        tokens = self.resolve_tokens(fwd)
        return tokens, self.hidden_states(dataclasses.replace(fwd, tokens=tokens))

    # ---- heads ------------------------------------------------------------------------
    def score(self, hidden: Tensor, head_rows: HeadRows) -> HeadsOutput:
        """The concept heads + LM head on the step's head rows only."""
        h = hidden.index_select(0, head_rows.flat)
        # One scoring pass over the head rows (transient HB x 101,200 fp32 scores for the
        # discovered head), so the compiled shapes stay generic in HB.
        self.heads_rows += h.shape[0]   # Python-side: every eager step; under CUDA graphs only captures
        return self.model.heads(h, token_chunk=None)

    def heads_and_sample(self, layout: BlockResultLayout, tokens: Tensor, hidden: Tensor, hin: HeadInputs,
                         smp: SamplerInputs, head_rows: int) -> Tensor:
        """The trunk's (tokens, hidden) -> heads on `head_rows` compacted positions -> sampled,
        packed results."""
        rows = compact_heads(tokens, self.cfg.mask_id, smp.decode, smp.heads, head_rows)
        heads = self.score(hidden, rows)
        return self.sample(layout, tokens, hin.positions, heads, rows, smp, hin.n_visible - hin.positions[:, 0])

    # ---- sampler ----------------------------------------------------------------------
    def neutral_inputs(self, rows: int, pages: int) -> tuple[ForwardInputs, SamplerInputs]:
        """Inputs of a step whose rows are all padding (scratch page and slot 0, nothing sampled):
        a CUDA graph's static buffers, which its warm-up runs execute without touching any request."""
        dev = self.tables.seen.device
        long = dict(dtype=torch.long, device=dev)
        f32 = dict(dtype=torch.float32, device=dev)
        b = dict(dtype=torch.bool, device=dev)
        fwd = ForwardInputs(
            tokens=torch.full((rows, BLOCK), self.cfg.pad_id, **long), positions=torch.zeros((rows, BLOCK), **long),
            write_page=torch.zeros(rows, **long), pages=torch.zeros((rows, pages), **long),
            n_visible=torch.full((rows,), BLOCK, **long), steer_slot=torch.zeros(rows, **long),
            alpha=torch.zeros(rows, **f32), inject_layer=torch.zeros(rows, **long), from_table=torch.zeros(rows, **b))
        smp = SamplerInputs(
            decode=torch.zeros(rows, **b), slot=torch.zeros(rows, **long), rep=torch.ones(rows, **f32),
            greedy=torch.ones(rows, **b), entropy=torch.zeros(rows, **b), temperature=torch.ones(rows, **f32),
            top_p=torch.ones(rows, **f32), seed=torch.zeros(rows, **long), step=torch.zeros(rows, **long),
            tokens_per_step=torch.zeros(rows, **long), threshold=torch.full((rows,), float("-inf"), **f32),
            heads=torch.zeros(rows, **long))
        return fwd, smp

    def neutral_head_inputs(self, rows: int) -> HeadInputs:
        dev = self.tables.seen.device
        return HeadInputs(positions=torch.zeros((rows, BLOCK), dtype=torch.long, device=dev),
                          n_visible=torch.full((rows,), BLOCK, dtype=torch.long, device=dev))

    def sample(self, layout: BlockResultLayout, tokens: Tensor, positions: Tensor, heads: HeadsOutput,
               head_rows: HeadRows, s: SamplerInputs, row_len: Tensor | None = None) -> Tensor:
        """Pick and draw up to layout.tokens_per_step positions per decode row; returns the packed
        host-bound results (`layout`). `heads` holds one entry per head row (`head_rows`).

        Same arithmetic as the reference decoder, row by row: relu mask, repetition penalty,
        bans, confidence = max softmax prob over the masked positions, top-k positions (with
        the threshold rule), then argmax or an inverse-CDF draw with u(seed, position, step).
        """
        cfg = self.cfg
        r = tokens.shape[0]
        logits = heads.logits                                                              # (HB, V)
        v = logits.shape[-1]
        max_tokens = layout.tokens_per_step
        relu = self.tables.relu.index_select(0, s.slot)[:, None, :]
        seen = self.tables.seen.index_select(0, s.slot)[:, None, :]
        # confidence per head row, its request's tables looked up per entry (fused when compiled)
        entry_row = head_rows.flat // BLOCK
        conf_rows = self.kernels.confidence_at(logits, self.tables.relu, self.tables.seen, s.slot[entry_row],
                                               s.rep[entry_row], self.banned_mask)         # (HB,)
        conf = torch.where(head_rows.candidate, conf_rows[head_rows.index], torch.full_like(conf_rows[:1], float("-inf")))
        conf_sel, idx = most_confident(conf, max_tokens)                                   # (R, max_tokens)
        j = torch.arange(max_tokens, device=tokens.device)[None, :]
        valid = (j < s.tokens_per_step[:, None]) & (conf_sel > float("-inf")) & ((j == 0) | (conf_sel >= s.threshold[:, None]))

        # the chosen positions' head rows (a harmless clamped entry where nothing was chosen)
        chosen = head_rows.index.gather(1, idx).reshape(-1)                               # (R * max_tokens,)
        lg_sel = logits.index_select(0, chosen)
        # the chosen positions' adjusted logits, recomputed (elementwise: the same bits)
        adj_sel = kernels.adjust_logits(lg_sel.view(r, max_tokens, v), relu, seen, s.rep, self.banned_mask)
        # structured output: the grammar's allowed ids (a constrained row commits one position a step)
        allow = self.tables.allow.index_select(0, s.slot)[:, None, :]
        adj_sel = adj_sel.masked_fill(~allow, float("-inf")).reshape(r * max_tokens, v)
        pos_sel = positions.gather(1, idx)
        u = self.kernels.counter_uniform(s.seed[:, None].expand(r, max_tokens).reshape(-1), pos_sel.reshape(-1),
                            s.step[:, None].expand(r, max_tokens).reshape(-1))
        greedy = s.greedy[:, None].expand(r, max_tokens).reshape(-1)
        entropy = s.entropy[:, None].expand(r, max_tokens).reshape(-1)
        top_p = s.top_p[:, None].expand(r, max_tokens).reshape(-1)
        temp = torch.where(entropy, entropy_temperature(adj_sel, top_p),
                           s.temperature[:, None].expand(r, max_tokens).reshape(-1))
        temp = torch.where(greedy, torch.ones_like(temp), temp)
        filtered, sorted_ids = top_p_filter(torch.softmax(adj_sel / temp[:, None], dim=-1), top_p)
        drawn = draw(filtered, sorted_ids, u)
        tok_sel = torch.where(greedy, adj_sel.argmax(-1), drawn).view(r, max_tokens)

        if cfg.eot_id is not None:  # nothing after an <|eot_id|> in the same step is committed
            is_eot = (tok_sel == cfg.eot_id) & valid
            valid = valid & ((torch.cumsum(is_eot.long(), 1) - is_eot.long()) == 0)

        slot_w = torch.where(valid, s.slot[:, None].expand(r, max_tokens), torch.zeros_like(tok_sel))
        self.tables.seen.index_put_((slot_w.reshape(-1), tok_sel.reshape(-1)),
                                    torch.ones(r * max_tokens, dtype=torch.bool, device=tokens.device))
        if row_len is not None:
            self._store_block_tokens(tokens, idx, tok_sel, valid, s, row_len)

        raw = lg_sel.float()
        target = raw.gather(1, tok_sel.reshape(-1, 1)).view(r, max_tokens)
        # logprobs: the chosen positions' raw distribution (before penalties, bans and temperature;
        # steering acts inside the trunk, so it is the steered model's); copied back only when asked
        lse = torch.logsumexp(raw, -1).view(r, max_tokens)
        top_v, top_i = raw.topk(TOP_LOGPROBS, -1)
        # One int32 tensor for the single device-to-host copy.
        return layout.pack(positions=pos_sel, tokens=tok_sel, valid=valid, target=target, logprob=target - lse,
                           top_ids=top_i, top_logprobs=top_v.view(r, max_tokens, -1) - lse[..., None],
                           known_idx=heads.known_idx[chosen], known_logits=heads.known_logits[chosen],
                           disc_idx=heads.disc_idx[chosen], disc_logits=heads.disc_logits[chosen])

    def _store_block_tokens(self, tokens: Tensor, idx: Tensor, tok_sel: Tensor, valid: Tensor, s: SamplerInputs,
                            row_len: Tensor) -> None:
        """Decode rows' blocks after this step, as the host will have them (SteerlingEngine._apply): the
        samples put in and, after a committed <|eot_id|>, every later position of the row set
        to EOS. Other rows write the scratch slot 0."""
        cfg = self.cfg
        new = tokens.scatter(1, idx, torch.where(valid, tok_sel, tokens.gather(1, idx)))
        if cfg.eot_id is not None:
            j = torch.arange(BLOCK, device=tokens.device)[None, :]
            eot_at = torch.where(valid & (tok_sel == cfg.eot_id), idx, torch.full_like(idx, BLOCK)).amin(1)
            fill = (j > eot_at[:, None]) & (j < row_len[:, None])
            new = torch.where(fill, torch.full_like(new, cfg.eos_id), new)
        slots = torch.where(s.decode, s.slot, torch.zeros_like(s.slot))
        self.tables.block_tokens.index_copy_(0, slots, new)
