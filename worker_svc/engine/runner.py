"""Device side of one engine step: the forward over a batch of 64-token rows, then the sampler.

Every forward processes R rows; a row is one 64-token block of one request that attends to
its request's pages up to and including its own (block-causal attention = "all earlier
pages + my page"). A decode row is a request's active block (some positions still masked);
a commit row is a finished block (prompt block at prefill, or a generated block after its
last token) whose final K/V must be written once. Per layer, every row first writes its K/V
into its own page, then attends over the pages it may see, so a request's commit rows and
decode row can share a step.

Both functions have fixed shapes for a given (rows, pages, k) bucket: no Python branching on
data, steering and concept heads always in, so they compile once and can be captured as
CUDA graphs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from cde.steerling import kernels
from cde.steerling.model import SteeringInputs, SteerlingModel
from cde.steerling.sampling import draw, entropy_temperature, top_p_filter
from worker_svc.engine.kv_cache import KVCache, additive_mask

BLOCK = 64


@dataclass
class ForwardInputs:
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
    k: Tensor             # (R,) long tokens per step
    threshold: Tensor     # (R,) fp32 confidence threshold (-inf = off)


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
        self.kernels = kernels.EAGER   # the engine swaps in compiled ones (Engine._compile)

    def resolve_tokens(self, inp: ForwardInputs) -> Tensor:
        """The rows' tokens: the host's, or the block-token table's for `from_table` rows."""
        table = self.tables.block_tokens.index_select(0, inp.steer_slot)
        return torch.where(inp.from_table[:, None], table, inp.tokens)

    # ---- forward ----------------------------------------------------------------------
    def forward(self, inp: ForwardInputs) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        cfg, kv = self.cfg, self.kv
        r, p = inp.pages.shape
        n_kv, hd = cfg.n_kv_heads, cfg.head_dim
        key_pos = torch.arange(p * BLOCK, device=inp.tokens.device)
        visible = (key_pos[None, :] < inp.n_visible[:, None])[:, None, None, :]   # (R, 1, 1, P*64)
        flat_pages = inp.pages.reshape(-1)
        masks: dict[torch.dtype, Tensor] = {}

        def attend(layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            mask = masks.get(q.dtype)
            if mask is None:
                mask = masks[q.dtype] = additive_mask(visible, q.dtype)
            kc, vc = kv.k[layer], kv.v[layer]                                   # (pages, 64, KV, hd)
            kc.index_copy_(0, inp.write_page, k.transpose(1, 2).to(kc.dtype))
            vc.index_copy_(0, inp.write_page, v.transpose(1, 2).to(vc.dtype))
            keys = kc.index_select(0, flat_pages).view(r, p * BLOCK, n_kv, hd).transpose(1, 2)
            vals = vc.index_select(0, flat_pages).view(r, p * BLOCK, n_kv, hd).transpose(1, 2)
            return F.scaled_dot_product_attention(q, keys.to(q.dtype), vals.to(q.dtype), attn_mask=mask, enable_gqa=True)

        steering = SteeringInputs(self.tables.steer.index_select(0, inp.steer_slot), inp.alpha,
                                  (inp.tokens == cfg.mask_id).float(), inp.inject_layer)
        h = self.model.hidden_states(inp.tokens, inp.positions, attend, steering)
        # One scoring pass over the step's rows (transient rows x 64 x 101,200 fp32 scores for
        # the discovered head: 2.5 GB at 96 rows), so the compiled shapes stay generic in R.
        heads = self.model.heads(h.reshape(r * BLOCK, -1), token_chunk=None)
        return heads.logits, heads.known_idx, heads.known_logits, heads.disc_idx, heads.disc_logits

    # ---- sampler ----------------------------------------------------------------------
    def step(self, kmax: int, fwd: ForwardInputs, smp: SamplerInputs) -> Tensor:
        """The whole device step: resolve the rows' tokens, forward, sample (packed results)."""
        tokens = self.resolve_tokens(fwd)
        fwd = dataclasses.replace(fwd, tokens=tokens)
        logits, kidx, klog, didx, dlog = self.forward(fwd)
        row_len = fwd.n_visible - fwd.positions[:, 0]
        return self.sample(kmax, tokens, fwd.positions, logits, kidx, klog, didx, dlog, smp, row_len)

    def sample(self, kmax: int, tokens: Tensor, positions: Tensor, logits: Tensor, known_idx: Tensor,
               known_logits: Tensor, disc_idx: Tensor, disc_logits: Tensor, s: SamplerInputs,
               row_len: Tensor | None = None) -> Tensor:
        """Pick and draw up to kmax positions per decode row; returns the packed host-bound results.

        Same arithmetic as the reference decoder, row by row: relu mask, repetition penalty,
        bans, confidence = max softmax prob over the masked positions, top-k positions (with
        the threshold rule), then argmax or an inverse-CDF draw with u(seed, position, step).
        """
        cfg = self.cfg
        r = tokens.shape[0]
        v = logits.shape[-1]
        lg = logits.view(r, BLOCK, v)
        relu = self.tables.relu.index_select(0, s.slot)[:, None, :]
        seen = self.tables.seen.index_select(0, s.slot)[:, None, :]
        conf = self.kernels.confidence(lg, relu, seen, s.rep, self.banned_mask)        # (R, 64)
        candidate = (tokens == cfg.mask_id) & s.decode[:, None]
        conf = torch.where(candidate, conf, torch.full_like(conf, float("-inf")))
        conf_sel, idx = conf.topk(kmax, dim=1)                                       # (R, kmax)
        j = torch.arange(kmax, device=tokens.device)[None, :]
        valid = (j < s.k[:, None]) & (conf_sel > float("-inf")) & ((j == 0) | (conf_sel >= s.threshold[:, None]))

        rows = torch.arange(r, device=tokens.device)[:, None].expand(r, kmax)
        # the chosen positions' adjusted logits, recomputed (elementwise: the same bits)
        adj_sel = kernels.adjust_logits(lg[rows, idx], relu, seen, s.rep, self.banned_mask).reshape(r * kmax, v)
        pos_sel = positions.gather(1, idx)
        u = self.kernels.counter_uniform(s.seed[:, None].expand(r, kmax).reshape(-1), pos_sel.reshape(-1),
                            s.step[:, None].expand(r, kmax).reshape(-1))
        greedy = s.greedy[:, None].expand(r, kmax).reshape(-1)
        entropy = s.entropy[:, None].expand(r, kmax).reshape(-1)
        top_p = s.top_p[:, None].expand(r, kmax).reshape(-1)
        temp = torch.where(entropy, entropy_temperature(adj_sel, top_p),
                           s.temperature[:, None].expand(r, kmax).reshape(-1))
        temp = torch.where(greedy, torch.ones_like(temp), temp)
        filtered, sorted_ids = top_p_filter(torch.softmax(adj_sel / temp[:, None], dim=-1), top_p)
        drawn = draw(filtered, sorted_ids, u)
        tok_sel = torch.where(greedy, adj_sel.argmax(-1), drawn).view(r, kmax)

        if cfg.eot_id is not None:  # nothing after an <|eot_id|> in the same step is committed
            is_eot = (tok_sel == cfg.eot_id) & valid
            valid = valid & ((torch.cumsum(is_eot.long(), 1) - is_eot.long()) == 0)

        slot_w = torch.where(valid, s.slot[:, None].expand(r, kmax), torch.zeros_like(tok_sel))
        self.tables.seen.index_put_((slot_w.reshape(-1), tok_sel.reshape(-1)),
                                    torch.ones(r * kmax, dtype=torch.bool, device=tokens.device))
        if row_len is not None:
            self._store_block_tokens(tokens, idx, tok_sel, valid, s, row_len)

        flat = (rows * BLOCK + idx).reshape(-1)
        target = logits.view(r * BLOCK, v)[flat, tok_sel.reshape(-1)].float().view(r, kmax)
        # One int32 tensor for the single device-to-host copy: ints as values, floats as bits.
        as_int = lambda t: t.to(torch.int32).reshape(r, -1)          # noqa: E731
        as_bits = lambda t: t.float().contiguous().view(torch.int32).reshape(r, -1)  # noqa: E731
        return torch.cat([as_int(pos_sel), as_int(tok_sel), as_int(valid), as_bits(target),
                          as_int(known_idx[flat]), as_bits(known_logits[flat]),
                          as_int(disc_idx[flat]), as_bits(disc_logits[flat])], dim=1)


    def _store_block_tokens(self, tokens: Tensor, idx: Tensor, tok_sel: Tensor, valid: Tensor, s: SamplerInputs,
                            row_len: Tensor) -> None:
        """Decode rows' blocks after this step, as the host will have them (engine._apply): the
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


def unpack(packed: Tensor, kmax: int, k_known: int, k_disc: int, with_records: bool) -> tuple[Tensor, ...]:
    """Split the host copy of `StepRunner.sample`'s output back into typed tensors."""
    r = packed.shape[0]
    sizes = [kmax, kmax, kmax, kmax, kmax * k_known, kmax * k_known, kmax * k_disc, kmax * k_disc]
    parts = list(packed.split(sizes, dim=1)) if with_records else list(packed[:, : 4 * kmax].split([kmax] * 4, 1))
    pos, tok, valid = parts[0].long(), parts[1].long(), parts[2].bool()
    target = parts[3].contiguous().view(torch.float32)
    if not with_records:
        return pos, tok, valid, target, None, None, None, None
    kidx = parts[4].long().view(r, kmax, k_known)
    klog = parts[5].contiguous().view(torch.float32).view(r, kmax, k_known)
    didx = parts[6].long().view(r, kmax, k_disc)
    dlog = parts[7].contiguous().view(torch.float32).view(r, kmax, k_disc)
    return pos, tok, valid, target, kidx, klog, didx, dlog
