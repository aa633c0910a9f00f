"""The training objective of steerling-small: block diffusion + concept heads + steering.

Everything here runs the project's own model (`cde.steerling.model.SteerlingModel`) with a
pluggable attention function; nothing of the architecture is copied.

Layout (all blocks of a sequence trained at once). A sample of T clean tokens x0 becomes the
2T-long input [x_t | x_0] with the same absolute positions in both halves, where x_t masks each
position of diffusion block b with probability t_b ~ U(T_MIN, 1) (one noise level per block):
- a noisy block b sees itself bidirectionally and the clean blocks before it: exactly what the
  serving engine's active block sees (its own 64 positions + the committed pages);
- a clean block sees the clean blocks up to itself (the ordinary block-causal forward, which is
  what a committed block's K/V are); clean never sees noisy.

Losses (weights in `LossWeights`; choices where the spec is silent are written beside them):
- `mdm`: cross-entropy of the true token at masked positions of x_t, mean over masked tokens.
  We do not weight by 1/t (MDLM's ELBO weight): at this size and budget the unweighted mean
  trained faster and more stably in small trials, and serving samples by confidence anyway.
- `known`: the known head is supervised by the chunk labels. Per 64-token chunk, pooled
  p_c = 1 - prod_t (1 - sigmoid(logit_t,c)) over the chunk's positions, BCE against the label,
  on both halves (the noisy half is what the committing forward sees, the clean half what a
  clean read of the text sees). Token labels add a token-level BCE at labelled positions.
- `disc`: the discovered head reconstructs the residual r = h - known (known detached, top-k as
  in serving) by MSE at the noisy half, plus an independence penalty: the squared Frobenius norm
  of the cross-covariance between the discovered features and the (detached) known features.
- `steer`: the express intervention. For a share of the rows whose text carries a steerable
  concept c, the project's own steering math (`cde.steerling.steering`: unit direction of E_c,
  alpha = target / max_v(W_lm[v] . dir), injected after blocks i with i + 1 >= inject_layer at
  still-masked positions) is applied in the same forward, with those rows' noise raised to
  t in [STEER_T_MIN, 1] so the concept must come from the injection; their cross-entropy counts
  in `mdm` and a word-set term -log sum_{w in words(c)} p(w) at their masked positions makes the
  concept's words likelier. Alpha is computed from the current weights and detached.

Without an intervention the LM logits equal lm_head(h) (composed == h up to rounding: the heads
decompose h rather than change it), so the LM loss does not pass gradient into the heads and we
skip the composition for it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from cde.steerling.concept_heads import LOGIT_CLAMP
from cde.steerling.model import SteeringInputs, SteerlingModel
from cde.limits import default_inject_layer
from cde.steerling.steering import AMPLIFY_TARGET

T_MIN = 0.05          # lowest per-block mask rate (a block with no mask teaches nothing)
ALPHA_CAP = 200.0     # training-time cap on the steering strength (see steering_for_rows)
STEER_T_MIN = 0.7     # steered rows are mostly masked: the concept must come from the injection


@dataclass(frozen=True)
class LossWeights:
    mdm: float = 1.0
    known: float = 1.0
    known_token: float = 0.5
    disc: float = 1.0
    independence: float = 1.0
    steer_words: float = 0.5
    steer_share: float = 0.3   # share of the rows (with a steerable concept) that are steered
    # v2: route meaning through the bottleneck. CE of the masked tokens read from the concept
    # features alone (known + discovered, no residual), and from the known features alone: the
    # known embeddings then point at the words their concepts predict, so attributions name known
    # concepts and a steering direction raises a concept's words broadly, not one token
    concept_lm: float = 0.0
    known_lm: float = 0.0
    concept_rows: int = 8192   # masked positions sampled per batch for the two terms above
    steer_somewhere: bool = False   # steer_words per block (some position), not per position
    # v3: attribution names the labelled concept. At masked positions whose token the labeler ties
    # to a concept, that concept's served contribution sigmoid(logit) * E . W_lm[y] should rank
    # first among the known concepts (CE over the row's contributions, scaled by their spread)
    known_attr: float = 0.0
    # v4: the same ranking over what a served record holds (the known_attr_k concepts of largest
    # logit, plus the label), and a hinge that puts the label's logit among them (0: v3's ranking)
    known_attr_k: int = 0


@dataclass
class Batch:
    """One training batch on the training device.

    tokens (B, T) long; chunk_labels (B, T // 64, C) float 0/1 over the known concepts;
    token_labels (B, T) long: a known concept id tied to the token by the labeler, -1 for none;
    steer_concept (B,) long: a steerable concept the row's text carries, -1 for none.
    """

    tokens: Tensor
    chunk_labels: Tensor
    token_labels: Tensor
    steer_concept: Tensor

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "Batch":
        return Batch(*(t.to(device, non_blocking=non_blocking)
                       for t in (self.tokens, self.chunk_labels, self.token_labels, self.steer_concept)))


def noisy_clean_mask(seq_len: int, block: int, device: torch.device | str) -> Tensor:
    """(2T, 2T) bool: True where a query (row) may attend to a key (column)."""
    blk = torch.arange(seq_len, device=device) // block
    same = blk[:, None] == blk[None, :]
    before = blk[:, None] > blk[None, :]
    upto = blk[:, None] >= blk[None, :]
    top = torch.cat([same, before], dim=1)                               # noisy queries
    bottom = torch.cat([torch.zeros_like(upto), upto], dim=1)            # clean queries
    return torch.cat([top, bottom], dim=0)


def noisy_clean_mask_mod(seq_len: int, block: int):
    """`noisy_clean_mask` as a FlexAttention mask_mod (b, h, q, k) -> allowed."""
    t = seq_len

    def allowed(_b, _h, q, k):
        q_noisy, k_noisy = q < t, k < t
        qb, kb = (q % t) // block, (k % t) // block
        noisy_row = (k_noisy & (qb == kb)) | (~k_noisy & (kb < qb))
        clean_row = ~k_noisy & (kb <= qb)
        return torch.where(q_noisy, noisy_row, clean_row)

    return allowed


def flex_attend(seq_len: int, block: int, device: torch.device | str):
    """The [noisy | clean] mask of `noisy_clean_mask` as a compiled FlexAttention (GPU): only the
    allowed 128 x 128 tiles are computed and no (2T, 2T) mask or score matrix is formed. With a
    dense bool mask and grouped KV heads SDPA falls back to its math kernel, which materialised
    fp32 scores of every head: the trainer's largest cost."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    t = seq_len
    mask = create_block_mask(noisy_clean_mask_mod(seq_len, block), None, None, 2 * t, 2 * t, device=device)
    fused = torch.compile(flex_attention, dynamic=False)

    def attend(_i: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return fused(q, k, v, block_mask=mask, enable_gqa=True)

    return attend


def corrupt(tokens: Tensor, mask_id: int, block: int, generator: torch.Generator,
            t_floor: Tensor) -> tuple[Tensor, Tensor]:
    """x_t and the bool mask of corrupted positions; t_floor (B,) is each row's lowest block rate."""
    b, t = tokens.shape
    n_blocks = t // block
    dev = tokens.device
    u = torch.rand(b, n_blocks, generator=generator, device=dev)
    rate = t_floor[:, None] + (1.0 - t_floor[:, None]) * u                # (B, blocks)
    rate = rate.repeat_interleave(block, dim=1)
    masked = torch.rand(b, t, generator=generator, device=dev) < rate
    return torch.where(masked, torch.full_like(tokens, mask_id), tokens), masked


def pooled_chunk_bce(known_logits: Tensor, labels: Tensor, block: int) -> Tensor:
    """BCE of p = 1 - prod(1 - sigmoid(l)) over each chunk's positions. logits (B, T, C)."""
    b, t, c = known_logits.shape
    log_not = F.logsigmoid(-known_logits.float()).view(b, t // block, block, c).sum(2)  # log(1 - p)
    log_p = torch.log((-torch.expm1(log_not)).clamp_min(1e-12))
    return -(labels * log_p + (1.0 - labels) * log_not).mean()


def token_bce(known_logits: Tensor, token_labels: Tensor) -> Tensor:
    """BCE at labelled positions: the labelled concept is positive, every other concept negative."""
    sel = token_labels >= 0
    if not bool(sel.any()):
        return known_logits.sum() * 0.0
    rows = known_logits[sel].float()                                   # (n, C)
    target = F.one_hot(token_labels[sel], rows.shape[-1]).float()
    pos_weight = torch.tensor(float(rows.shape[-1]) ** 0.5, device=rows.device)
    return F.binary_cross_entropy_with_logits(rows, target, pos_weight=pos_weight)


def cross_covariance(a: Tensor, b: Tensor) -> Tensor:
    """Mean squared cross-correlation between the columns of a and b (rows are samples), in [0, 1]."""
    def standardize(x: Tensor) -> Tensor:
        x = x.float() - x.float().mean(0)
        return x * torch.rsqrt(x.pow(2).mean(0) + 1e-6)   # rsqrt of var + eps: finite gradient at var 0
    corr = standardize(a).t() @ standardize(b) / a.shape[0]
    return corr.pow(2).mean()


def steering_for_rows(model: SteerlingModel, concept: Tensor, inject_layer: int, target: float) -> tuple[Tensor, Tensor]:
    """Unit directions (B, D) and detached alphas (B,) for rows' concepts (-1: none), by the serving math."""
    emb = model.known_head.concept_embedding.weight
    lm = model.transformer.lm_head.weight
    ids = concept.clamp_min(0)
    vec = emb[ids].float()
    direction = vec / (vec.norm(dim=-1, keepdim=True) + 1e-12)
    peak = (direction.detach() @ lm.detach().float().t()).amax(-1).clamp_min(1e-6)
    # serving's alpha, capped while training: early directions can align with no token at all
    alpha = torch.where(concept >= 0, (target / peak).clamp_max(ALPHA_CAP), torch.zeros_like(peak))
    return direction, alpha.detach()


def attribution_rank_loss(model: SteerlingModel, known_logits: Tensor, tokens: Tensor, token_labels: Tensor,
                          masked: Tensor, max_rows: int = 4096, served_k: int = 0,
                          margin: float = 1.0) -> Tensor:
    """CE that the labelled concept's contribution sigmoid(l_c) * E_c . W_lm[y] ranks first, at
    masked labelled positions (what the committing forward attributes). Contributions are divided
    by their (detached) spread per row so the loss cannot be lowered by growing the embeddings alone.
    known_logits (B, T, C) of the noisy half.

    served_k = 0 (v3): the ranking is over all known concepts. served_k > 0 (v4): over what a served
    record holds, the served_k concepts of largest logit (plus the label), and a hinge
    relu(l_(k) - l_label + margin) pushes the label's logit into that top-k (l_(k): the k-th
    largest logit of the other concepts): a label outside the record is a miss whatever its
    contribution."""
    sel = masked & (token_labels >= 0)
    logits = known_logits[sel][:max_rows]                                # (n, C)
    if logits.shape[0] == 0:
        return known_logits.sum() * 0.0
    y = tokens[sel][:max_rows]
    label = token_labels[sel][:max_rows]
    emb = model.known_head.concept_embedding.weight[: model.cfg.n_known].float()
    lm_rows = model.transformer.lm_head.weight[y].float()               # (n, D)
    contrib = torch.sigmoid(logits) * (lm_rows @ emb.t())              # (n, C)
    if not served_k or served_k >= logits.shape[1]:
        spread = contrib.detach().std(dim=-1, keepdim=True).clamp_min(1e-6)
        return F.cross_entropy(contrib / spread, label)
    rows = torch.arange(logits.shape[0], device=logits.device)
    served = torch.zeros_like(logits, dtype=torch.bool)
    served.scatter_(1, logits.detach().topk(served_k, dim=-1).indices, True)
    served[rows, label] = True
    spread = torch.where(served, contrib.detach(), torch.nan).nanmean(-1, keepdim=True)
    spread = (torch.where(served, contrib.detach() - spread, 0.0).pow(2).sum(-1, keepdim=True)
              / (served.sum(-1, keepdim=True) - 1).clamp_min(1)).sqrt().clamp_min(1e-6)
    rank = F.cross_entropy(torch.where(served, contrib / spread, float("-inf")), label)
    others = logits.scatter(1, label[:, None], float("-inf"))
    kth = others.topk(served_k, dim=-1).values[:, -1]
    into_topk = F.relu(kth - logits[rows, label] + margin).mean()
    return rank + into_topk


@dataclass
class LossParts:
    """The total loss and its terms; `parts` turns the terms into floats (one device sync), so
    call it only when logging: a sync per term per step idled the GPU between steps."""

    total: Tensor
    terms: dict[str, Tensor]

    @property
    def parts(self) -> dict[str, float]:
        names = list(self.terms)
        values = torch.stack([self.terms[k].detach().float().reshape(()) for k in names]).tolist()
        return dict(zip(names, values))


def training_loss(model: SteerlingModel, batch: Batch, generator: torch.Generator, weights: LossWeights,
                  concept_words: Tensor, concept_word_mask: Tensor, attend_mask,
                  inject_layer: int | None = None, target: float = AMPLIFY_TARGET) -> LossParts:
    """One batch's loss. concept_words (C, W) token ids of each known concept's words (padded),
    concept_word_mask (C, W) bool marks the real entries. attend_mask: `noisy_clean_mask`'s
    (2T, 2T) bool mask for SDPA, or an attend function (`flex_attend`)."""
    cfg = model.cfg
    block = cfg.diff_block_size
    tokens = batch.tokens
    b, t = tokens.shape
    dev = tokens.device
    # which rows are steered this batch
    has = batch.steer_concept >= 0
    pick = torch.rand(b, generator=generator, device=dev) < weights.steer_share
    steered = has & pick
    concept = torch.where(steered, batch.steer_concept, torch.full_like(batch.steer_concept, -1))
    t_floor = torch.where(steered, torch.full((b,), STEER_T_MIN, device=dev), torch.full((b,), T_MIN, device=dev))
    xt, masked = corrupt(tokens, cfg.mask_id, block, generator, t_floor)

    inp = torch.cat([xt, tokens], dim=1)
    pos = torch.arange(t, device=dev).repeat(2)[None].expand(b, 2 * t)
    layer = default_inject_layer(cfg.n_layers, True) if inject_layer is None else inject_layer
    steering = None
    if bool(steered.any()):
        direction, alpha = steering_for_rows(model, concept, layer, target)
        gate = torch.cat([masked, torch.zeros_like(masked)], dim=1).float()
        steering = SteeringInputs(direction.to(model.transformer.tok_emb.weight.dtype), alpha, gate,
                                  torch.full((b,), layer, device=dev, dtype=torch.long))

    if callable(attend_mask):          # e.g. flex_attend(): block-sparse, fused
        attend = attend_mask
    else:
        def attend(_i: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=attend_mask, enable_gqa=True)

    h = model.hidden_states(inp, pos, attend, steering)                 # (B, 2T, D)
    h_noisy, h_clean = h[:, :t], h[:, t:]
    lm = model.transformer.lm_head

    # masked-token CE (steered rows under their injection: the steering signal's own CE)
    logits_m = lm(h_noisy[masked]).float()
    mdm = F.cross_entropy(logits_m, tokens[masked])

    # steered rows: raise the mass of the concept's words at their masked positions
    steer_words = logits_m.new_zeros(())
    if steering is not None:
        row_of = torch.arange(b, device=dev)[:, None].expand(b, t)[masked]
        on = steered[row_of]
        if bool(on.any()):
            lp = torch.log_softmax(logits_m[on], dim=-1)                  # (n, V)
            words = concept_words[concept[row_of[on]]]                    # (n, W)
            wmask = concept_word_mask[concept[row_of[on]]]
            got = lp.gather(1, words).masked_fill(~wmask, float("-inf"))
            word_lp = torch.logsumexp(got, dim=-1)                        # (n,) log p(some concept word)
            if weights.steer_somewhere:
                # the concept's words somewhere in each steered block, not at every position: the
                # per-position form taught injections to repeat one word ("sea sea sea")
                blk_of = (row_of[on] * (t // block)
                          + torch.arange(t, device=dev)[None].expand(b, t)[masked][on] // block)
                n_seg = b * (t // block)
                # log P(a concept word at >= 1 masked position of the block) = log(1 - prod(1 - p_i)):
                # bounded by 0, so once a block shows the concept there is nothing to gain from more
                log_not = torch.log1p(-torch.exp(word_lp).clamp_max(1 - 1e-6))
                none = torch.zeros(n_seg, device=dev, dtype=log_not.dtype).index_add(0, blk_of, log_not)
                seen = torch.zeros(n_seg, device=dev, dtype=torch.bool).index_fill(0, blk_of, True)
                steer_words = -torch.log((-torch.expm1(none[seen])).clamp_min(1e-12)).mean()
            else:
                steer_words = -word_lp.mean()

    # known head (dense over the known concepts)
    w_pred = model.known_head.concept_predictor.weight[: cfg.n_known]
    kl_noisy = (h_noisy @ w_pred.t()).float().clamp(-LOGIT_CLAMP, LOGIT_CLAMP)
    kl_clean = (h_clean @ w_pred.t()).float().clamp(-LOGIT_CLAMP, LOGIT_CLAMP)
    known = 0.5 * (pooled_chunk_bce(kl_noisy, batch.chunk_labels, block)
                   + pooled_chunk_bce(kl_clean, batch.chunk_labels, block))
    known_tok = 0.5 * (token_bce(kl_noisy, batch.token_labels) + token_bce(kl_clean, batch.token_labels))

    # discovered head: reconstruct the residual of the known head (top-k as served) at the noisy half
    rows = h_noisy.reshape(b * t, -1)
    sample = torch.randperm(rows.shape[0], generator=generator, device=dev)[: min(rows.shape[0], 4096)]
    hr = rows[sample]
    k_idx, k_logits = model.known_head.topk_of(hr, None)
    known_feat = model.known_head.features(k_idx, k_logits).detach()
    d_idx, d_logits = model.unknown_head.topk_of(hr, None)
    disc_feat = model.unknown_head.features(d_idx, d_logits)
    target_r = (hr.float() - known_feat.float()).detach()
    disc = F.mse_loss(disc_feat.float(), target_r) / target_r.pow(2).mean().clamp_min(1e-12)
    indep = cross_covariance(disc_feat, known_feat)

    # the bottleneck read alone: masked tokens from known + discovered features, and from known
    concept_lm = known_lm = mdm.new_zeros(())
    if weights.concept_lm or weights.known_lm:
        hm = h_noisy[masked]
        ym = tokens[masked]
        if hm.shape[0] > weights.concept_rows:
            pick_rows = torch.randperm(hm.shape[0], generator=generator, device=dev)[: weights.concept_rows]
            hm, ym = hm[pick_rows], ym[pick_rows]
        mk_idx, mk_logits = model.known_head.topk_of(hm, None)
        kf = model.known_head.features(mk_idx, mk_logits).to(hm.dtype)
        known_lm = F.cross_entropy(lm(kf).float(), ym)
        if weights.concept_lm:
            md_idx, md_logits = model.unknown_head.topk_of(hm, None)
            df = model.unknown_head.features(md_idx, md_logits).to(hm.dtype)
            concept_lm = F.cross_entropy(lm(kf + df).float(), ym)

    known_attr = mdm.new_zeros(())
    if weights.known_attr:
        known_attr = attribution_rank_loss(model, kl_noisy, tokens, batch.token_labels, masked,
                                           served_k=weights.known_attr_k)

    total = (weights.mdm * mdm + weights.known * known + weights.known_token * known_tok
             + weights.disc * disc + weights.independence * indep + weights.steer_words * steer_words
             + weights.concept_lm * concept_lm + weights.known_lm * known_lm + weights.known_attr * known_attr)
    terms = {"mdm": mdm, "known": known, "known_tok": known_tok, "disc": disc, "indep": indep,
             "steer_words": steer_words, "concept_lm": concept_lm, "known_lm": known_lm,
             "known_attr": known_attr, "steered_rows": steered.sum()}
    return LossParts(total, terms)
