"""Reference decoders for a causal Qwen3 model: plain AR and Introspective Strided Decoding.

Plain and full-recompute, written to be the oracle for the engine (docs/ISD.md):
every forward runs prompt + committed tokens + the query window through the model with a
plain causal mask (mask positions see earlier masks); nothing is cached, so "freeing KV"
is implicit: a rejected or mask slot is simply not part of the next forward's prefix.

The functions take many rows (requests) at once only so tests can run tens of thousands of
seeded decodes quickly; rows never interact. Their randomness is a pure function of
(request seed, absolute position, step, stream) through ``counter_uniform``, so a row's
output does not depend on what it is batched with, and AR and ISD share their draws:

* ``STREAM_SAMPLE``   a clean token (AR's every token; ISD's t0, cold c, bonus), step 0;
* ``STREAM_ACCEPT``   the accept test of the draft at a position, step 0;
* ``STREAM_RESID``    the residual (correction) draw at a position, step 0;
* ``STREAM_PROPOSAL`` a draft proposed for a position, step = the request's forward index
  (a position can be proposed twice when the first proposals were discarded).

Each (position, stream) key decides at most one thing in a request, so the draws are
independent. Sampling (and proposals) use inverse CDF in vocabulary order over
``softmax(filtered logits / T)``; top-k keeps every id tied with the k-th logit, top-p keeps
the smallest probability-sorted prefix whose mass reaches top_p (HF's warpers' semantics,
applied in the order T, top-k, top-p).

ISD step machine (stride N, 2N-1 query positions; logits at window index j predict the
token at absolute position P + j + 1, P the absolute position of the window's first token):

* prefill: t0 is sampled from the prompt's last logits; the first step is cold.
* cold ``[t0, M x (N-1), pad x (N-1)]``: c ~ logits[0]; drafts for P+2..P+N from mask
  logits[1..N-1]. Emits c; the pad only keeps the shape fixed and is never read.
* verify ``[pending, s_1..s_{N-1}, M x (N-1)]``: p_i = logits[i-1] (filtered, / T) checks
  s_i with the stored q_i. All accepted: emit s_1..s_{N-1} and a bonus c ~ logits[N-1];
  new drafts from mask logits[N..2N-2]. Rejected at i: emit s_1..s_{i-1} and the
  correction, discard the new drafts; the next step is cold with t0 = the correction.

Drafts (``proposal``):

* ``"sample"`` (default): s ~ q = softmax(filtered mask logits / T), q stored scaled once.
  The rule ``min(1, p/q)`` + residual is then exactly lossless.
* ``"argmax_onehot"``: s = argmax of the mask logits, stored q = the point mass at s (the
  rule accepts with probability p(s) and corrects from p without s): also lossless.
* ``"argmax"``: s = argmax with the soft q stored (what the spec text and the released
  I-DLM code do). NOT lossless at T > 0: the ratio then uses a q the draft was not drawn
  from. At T = 0 all three are argmax and the output is greedy AR's, token for token.

R-ISD: with a LoRA attached, ``lora_gated=True`` applies it only at the N-1 mask positions
(per-token gate), so clean/verify positions -- all causally before the masks -- are
computed with base weights and p is the base model's: output follows base AR exactly.
``lora_gated=False`` applies it everywhere (plain PEFT), which changes p: the failure mode.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from cde.options import PROPOSALS
from cde.isd.verify import onehot_logits, verify_torch
from cde.qwen3.model import Qwen3Model, masked_attend
from cde.steerling.sampling import counter_uniform

# counter_uniform hashes ``step ^ (0x9E3779B9 + stream)`` first, so two streams whose
# (constant + stream) differ only in low bits collide for some small step (stream 0x15D4 at
# step 1 hashes like 0x15D3 at step 0: a proposal draw equal to the residual draw at the same
# position, which the chi-square test in tests/test_isd.py caught).
# These differ in bits 24+ only, so with steps < 2**24 no two (step, stream) pairs collide,
# nor with stream 0.
STREAM_SAMPLE = 0x11 << 24
STREAM_ACCEPT = 0x12 << 24
STREAM_RESID = 0x13 << 24
STREAM_PROPOSAL = 0x14 << 24


VerifyFn = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor], tuple[Tensor, Tensor]]


@dataclass
class DecodeStats:
    """Per-request counters. ``forwards`` counts the prefill too (AR: forwards == tokens)."""

    forwards: int = 0
    cold_steps: int = 0
    verify_steps: int = 0
    proposed: int = 0   # drafts put up for verification (N - 1 per verify step)
    accepted: int = 0   # of those, accepted
    full_accepts: int = 0  # verify steps that accepted every draft (and so emitted a bonus token)
    generated: int = 0  # tokens returned

    @property
    def tokens_per_forward(self) -> float:
        return self.generated / self.forwards if self.forwards else 0.0

    @property
    def acceptance(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0


@dataclass
class Generation:
    tokens: list[int]
    finish_reason: str  # "stop" (an EOS id was generated; it is included) | "length"
    stats: DecodeStats = field(default_factory=DecodeStats)


# ---- never-output ids ------------------------------------------------------------------------
def never_output_ids(cfg, tokenizer_vocab_size: int | None = None, unassigned: Iterable[int] = ()) -> list[int]:
    """Ids no decoder may sample (AR, ISD clean tokens, drafts, corrections): the mask id, a BOS
    that is not a stop id (the gateway's detokenizer drops it, so sampled it would be a token the
    response does not hold), embedding rows at or past the tokenizer's vocabulary (padding
    rows no text maps to) and `unassigned`, the tokenizer's holes below it (its
    `unassigned_ids()`: the gateway could not decode them). A stop id is never banned (a BOS
    that is one ends the output like any EOS), even one past a tokenizer vocabulary that does
    not count it."""
    ids = {int(i) for i in unassigned}
    if cfg.mask_token_id is not None:
        ids.add(int(cfg.mask_token_id))
    if cfg.bos_token_id is not None:
        ids.add(int(cfg.bos_token_id))
    if tokenizer_vocab_size is not None:
        ids.update(range(tokenizer_vocab_size, cfg.vocab_size))
    return sorted(i for i in ids - set(cfg.eos_token_ids) if i < cfg.vocab_size)


def ban_(logits: Tensor, banned: Tensor) -> Tensor:
    """Set the never-output ids' logits to -inf, in place, over the last dim (banned: long ids).
    Every distribution the decoders form (p, q, the residual) then gives them zero mass and every
    argmax skips them, so AR and ISD sample the same banned distribution and ISD stays lossless."""
    if banned.numel():
        logits.index_fill_(-1, banned.to(logits.device), float("-inf"))
    return logits


# ---- sampling helpers ---------------------------------------------------------------------
def keep_mask(logits: Tensor, temperature: float, top_k: int, top_p: float) -> Tensor:
    """Which ids survive top-k then top-p at temperature T (bool, same shape as logits (..., V))."""
    keep = torch.ones_like(logits, dtype=torch.bool)
    x = logits.double() / temperature
    v = logits.shape[-1]
    if 0 < top_k < v:
        kth = torch.topk(x, top_k, dim=-1).values[..., -1:]
        keep &= x >= kth
    if top_p < 1.0:
        probs = torch.softmax(x.masked_fill(~keep, float("-inf")), dim=-1)
        sorted_p, order = torch.sort(probs, dim=-1, descending=True, stable=True)
        before = torch.cumsum(sorted_p, dim=-1) - sorted_p
        keep_sorted = before < top_p
        keep_sorted[..., 0] = True
        keep &= torch.zeros_like(keep).scatter(-1, order, keep_sorted)
    return keep


def scaled_logits(logits: Tensor, temperature: float, top_k: int, top_p: float) -> Tensor:
    """logits / T with filtered ids at -inf: the distribution a token is drawn from (T > 0)."""
    x = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return (x / temperature).masked_fill(~keep_mask(logits, temperature, top_k, top_p), float("-inf"))


def draw(scaled: Tensor, u: Tensor) -> Tensor:
    """Inverse-CDF draw in vocabulary order from softmax(scaled) (float64), one uniform per row."""
    probs = torch.softmax(scaled.double(), dim=-1)
    return inverse_cdf(probs, torch.cumsum(probs, dim=-1), u)


def inverse_cdf(probs: Tensor, cdf: Tensor, u: Tensor) -> Tensor:
    """The id whose CDF step holds u * total (never past the last id with mass): `draw`'s pick,
    given float64 probabilities and their running sums over the last dim."""
    j = torch.searchsorted(cdf, (u.double() * cdf[..., -1])[..., None].contiguous(), right=True).squeeze(-1)
    last_pos = torch.where(probs > 0, torch.arange(probs.shape[-1], device=probs.device), -1).max(-1).values
    return torch.minimum(j, last_pos)


def _uniforms(seeds: Sequence[int], positions: Tensor, step: Tensor | int, stream: int) -> Tensor:
    """counter_uniform for rows: seeds (B,), positions (B, ...) -> float64 (B, ...)."""
    s = torch.tensor(list(seeds), dtype=torch.int64).reshape((-1,) + (1,) * (positions.dim() - 1))
    st = torch.as_tensor(step, dtype=torch.int64)
    if st.dim():
        st = st.reshape((-1,) + (1,) * (positions.dim() - 1))
    return counter_uniform(s.expand_as(positions), positions, st.expand_as(positions), stream)


def _sample_clean(logits: Tensor, temperature: float, top_k: int, top_p: float, seeds: Sequence[int],
                  positions: Tensor) -> Tensor:
    """One clean token per row at absolute ``positions`` (B,): argmax at T = 0, else a seeded draw."""
    if temperature == 0:
        return logits.argmax(-1)
    return draw(scaled_logits(logits, temperature, top_k, top_p), _uniforms(seeds, positions, 0, STREAM_SAMPLE))


# ---- the forward ----------------------------------------------------------------------------
def forward_rows(model: Qwen3Model, seqs: Sequence[Sequence[int]], gates: Sequence[Sequence[int]] | None) -> Tensor:
    """Causal logits for rows of different lengths, left-padded: (B, L_max, V).

    Row b's token t sits at index ``L_max - len(b) + t`` with RoPE position t. Pad keys are
    masked out; a pad query attends to itself only (so no row is all -inf). gates: per-row
    0/1 LoRA gates as long as the rows, or None for "LoRA everywhere" (plain PEFT).
    Identical (row, gate) pairs are computed once: seeded test runs of one prompt share
    most of their forwards. Runs on the model's device; the logits come back on the CPU.
    """
    dev = model.lm_head.weight.device
    keys = [(tuple(s), tuple(gates[r]) if gates is not None else None) for r, s in enumerate(seqs)]
    uniq: dict[tuple, int] = {}
    inverse = [uniq.setdefault(key, len(uniq)) for key in keys]
    rows = list(uniq)
    lens = torch.tensor([len(s) for s, _ in rows])
    lmax = int(lens.max())
    pad = lmax - lens
    tokens = torch.tensor([[0] * (lmax - len(s)) + list(s) for s, _ in rows], dtype=torch.long)
    gate = None
    if gates is not None:
        gate = torch.tensor([[0] * (lmax - len(g)) + list(g) for _, g in rows], dtype=torch.bool)
    idx = torch.arange(lmax)
    positions = (idx[None, :] - pad[:, None]).clamp(min=0)
    causal = idx[None, :, None] >= idx[None, None, :]
    valid_key = idx[None, None, :] >= pad[:, None, None]
    mask = (causal & valid_key) | torch.eye(lmax, dtype=torch.bool)[None]
    with torch.inference_mode():
        h = model.hidden_states(tokens.to(dev), positions.to(dev), masked_attend(mask[:, None].to(dev)),
                                None if gate is None else gate.to(dev))
        logits = model.logits(h).cpu()
    return logits[torch.tensor(inverse)]


def cut_at_stop(tokens: list[int], stops, max_new: int) -> tuple[list[int], str | None]:
    """Cut at the first stop id (kept) within max_new, else at max_new; the finish reason, or
    None to go on. The engine (worker_svc/engine/isd_engine.py) applies the same rule."""
    for i, t in enumerate(tokens[:max_new]):
        if t in stops:
            return tokens[:i + 1], "stop"
    if len(tokens) >= max_new:
        return tokens[:max_new], "length"
    return tokens, None


def _stops(model: Qwen3Model, tokens: list[int], max_new: int) -> tuple[list[int], str | None]:
    """The model's EOS ids end a generation."""
    return cut_at_stop(tokens, set(model.cfg.eos_token_ids), max_new)


# ---- plain AR -------------------------------------------------------------------------------
def generate_ar_batch(model: Qwen3Model, prompts: Sequence[Sequence[int]], max_new: int, temperature: float = 0.0,
                      top_k: int = 0, top_p: float = 1.0, seeds: Sequence[int] | None = None,
                      use_lora: bool = False, tokenizer_vocab_size: int | None = None,
                      constraints: Sequence | None = None) -> list[Generation]:
    """Plain autoregressive decoding (stride 1), one forward per token, many rows.

    use_lora: with an adapter attached, False computes the base model (gate 0 everywhere),
    True applies the adapter everywhere. tokenizer_vocab_size: embedding rows from there on are
    never sampled (``never_output_ids``). constraints: per row a ``cde.grammar.Constraint`` or
    None; a constrained row's logits outside what its grammar allows next are -inf (structured
    output: the base model's distribution restricted to the grammar, the oracle of the engine's).
    """
    _check_args(prompts, max_new, temperature, top_k, top_p)
    banned = torch.tensor(never_output_ids(model.cfg, tokenizer_vocab_size), dtype=torch.long)
    seeds = list(seeds) if seeds is not None else [0] * len(prompts)
    outs: list[list[int]] = [[] for _ in prompts]
    results: list[Generation | None] = [None] * len(prompts)
    live = list(range(len(prompts)))
    forwards = 0
    while live:
        seqs = [list(prompts[r]) + outs[r] for r in live]
        gates = None if use_lora else [[0] * len(s) for s in seqs]
        logits = ban_(forward_rows(model, seqs, gates)[:, -1], banned)
        if constraints is not None:
            for i, r in enumerate(live):
                if constraints[r] is not None:
                    logits[i].masked_fill_(~torch.from_numpy(constraints[r].allowed()), float("-inf"))
        forwards += 1
        pos = torch.tensor([len(s) for s in seqs])
        toks = _sample_clean(logits, temperature, top_k, top_p, [seeds[r] for r in live], pos).tolist()
        still = []
        for r, t in zip(live, toks):
            if constraints is not None and constraints[r] is not None:
                constraints[r].advance(int(t))
            outs[r].append(int(t))
            cut, reason = _stops(model, outs[r], max_new)
            if reason is None:
                still.append(r)
            else:
                results[r] = Generation(cut, reason, DecodeStats(forwards=forwards, generated=len(cut)))
        live = still
    return [g for g in results if g is not None]


def generate_ar(model: Qwen3Model, prompt: Sequence[int], max_new: int, temperature: float = 0.0, top_k: int = 0,
                top_p: float = 1.0, seed: int = 0, use_lora: bool = False,
                tokenizer_vocab_size: int | None = None) -> Generation:
    """One request of ``generate_ar_batch``."""
    return generate_ar_batch(model, [prompt], max_new, temperature, top_k, top_p, [seed], use_lora,
                             tokenizer_vocab_size)[0]


# ---- ISD ------------------------------------------------------------------------------------
def generate_isd_batch(model: Qwen3Model, prompts: Sequence[Sequence[int]], max_new: int, stride: int,
                       temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                       seeds: Sequence[int] | None = None, lora_gated: bool = True, proposal: str = "sample",
                       verify_fn: VerifyFn = verify_torch,
                       tokenizer_vocab_size: int | None = None) -> list[Generation]:
    """Introspective Strided Decoding with stride N = ``stride`` (>= 2), many independent rows.

    verify_fn: the verify rule (``verify_torch`` / ``verify_triton`` / ``verify_reference``,
    or a deliberately broken one in tests). Every logit row of every forward has the
    never-output ids banned (``never_output_ids``) before anything reads it: p, q, clean
    tokens, drafts and corrections alike.
    """
    _check_args(prompts, max_new, temperature, top_k, top_p)
    banned = torch.tensor(never_output_ids(model.cfg, tokenizer_vocab_size), dtype=torch.long)
    if stride < 2:
        raise ValueError("ISD needs stride >= 2 (stride 1 is generate_ar)")
    if proposal not in PROPOSALS:
        raise ValueError(f"proposal must be one of {PROPOSALS}, got {proposal!r}")
    mask_id = model.cfg.mask_token_id
    if mask_id is None:
        raise ValueError("the model config has no mask_token_id")
    n, k, v = stride, stride - 1, model.cfg.vocab_size
    greedy = temperature == 0
    nrows = len(prompts)
    seeds = list(seeds) if seeds is not None else [0] * nrows
    stats = [DecodeStats() for _ in range(nrows)]
    outs: list[list[int]] = [[] for _ in range(nrows)]
    results: list[Generation | None] = [None] * nrows
    # Per row: drafts for the next verify step (None: the next step is cold) and their q logits.
    specs: list[list[int] | None] = [None] * nrows
    q_buf = torch.zeros(nrows, k, v, dtype=torch.float32)

    def finish_or_keep(r: int) -> bool:
        cut, reason = _stops(model, outs[r], max_new)
        if reason is None:
            return True
        stats[r].generated = len(cut)
        results[r] = Generation(cut, reason, stats[r])
        return False

    # Prefill: no mask position, so base weights when gated; t0 from the prompt's last logits.
    logits = ban_(forward_rows(model, [list(p) for p in prompts],
                               [[0] * len(p) for p in prompts] if lora_gated else None)[:, -1], banned)
    t0 = _sample_clean(logits, temperature, top_k, top_p, seeds, torch.tensor([len(p) for p in prompts])).tolist()
    live = []
    for r in range(nrows):
        stats[r].forwards = 1
        outs[r].append(int(t0[r]))
        if finish_or_keep(r):
            live.append(r)

    while live:
        seqs, gates, is_verify = [], [], []
        for r in live:
            prefix = list(prompts[r]) + outs[r][:-1]  # everything with KV; outs[r][-1] is t0 / pending
            if specs[r] is None:
                window = [outs[r][-1]] + [mask_id] * k + [mask_id] * k  # cold, padded to 2N-1
                wgate = [0] + [1] * k + [0] * k
            else:
                window = [outs[r][-1]] + specs[r] + [mask_id] * k
                wgate = [0] * n + [1] * k
            seqs.append(prefix + window)
            gates.append([0] * len(prefix) + wgate)
            is_verify.append(specs[r] is not None)
        wl = ban_(forward_rows(model, seqs, gates if lora_gated else None)[:, -(2 * n - 1):], banned)  # (B, 2N-1, V)
        b = len(live)
        ver = torch.tensor(is_verify)
        p_abs = torch.tensor([len(prompts[r]) + len(outs[r]) - 1 for r in live])  # abs position of window[0]
        for r in live:
            stats[r].forwards += 1

        # Clean token: cold -> c at P+1 from logits[0]; verify -> bonus at P+N from logits[N-1].
        clean_j = torch.where(ver, n - 1, 0)
        clean_logits = wl[torch.arange(b), clean_j]
        clean = _sample_clean(clean_logits, temperature, top_k, top_p, [seeds[r] for r in live],
                              p_abs + clean_j + 1).tolist()

        # New drafts from the N-1 mask logits (cold: window 1..N-1, verify: N..2N-2).
        mask_j = torch.where(ver, n, 1)[:, None] + torch.arange(k)[None, :]
        mlog = wl[torch.arange(b)[:, None], mask_j]  # (B, K, V)
        draft_pos = p_abs[:, None] + mask_j + 1
        if greedy:
            new_specs = mlog.argmax(-1)
            new_q = mlog.float()
        else:
            new_q = scaled_logits(mlog, temperature, top_k, top_p)
            if proposal == "sample":
                steps = torch.tensor([stats[r].forwards - 1 for r in live])
                new_specs = draw(new_q, _uniforms([seeds[r] for r in live], draft_pos, steps, STREAM_PROPOSAL))
            else:
                new_specs = new_q.argmax(-1)
                if proposal == "argmax_onehot":
                    new_q = onehot_logits(new_specs, v)
        new_specs_l = new_specs.tolist()

        # Verify the rows that carried drafts.
        n_acc = {}
        corr = {}
        vrows = [i for i in range(b) if is_verify[i]]
        if vrows:
            vi = torch.tensor(vrows)
            rows = [live[i] for i in vrows]
            raw = wl[vi, :k]  # p for s_i comes from window index i-1
            p_in = raw if greedy else raw.float().masked_fill(~keep_mask(raw, temperature, top_k, top_p),
                                                              float("-inf"))
            drafts = torch.tensor([specs[r] for r in rows], dtype=torch.long)
            spos = p_abs[vi][:, None] + 1 + torch.arange(k)[None, :]
            ua = _uniforms([seeds[r] for r in rows], spos, 0, STREAM_ACCEPT)
            ur = _uniforms([seeds[r] for r in rows], spos, 0, STREAM_RESID)
            temps = torch.full((len(rows),), float(temperature))
            acc_t, corr_t = verify_fn(p_in, q_buf[torch.tensor(rows)], drafts, temps, ua, ur,
                                      torch.full((len(rows),), greedy))
            for i, a, c in zip(vrows, acc_t.tolist(), corr_t.tolist()):
                n_acc[i], corr[i] = int(a), int(c)

        still = []
        keep_q_rows, keep_q_src = [], []
        for i, r in enumerate(live):
            st = stats[r]
            if not is_verify[i]:
                st.cold_steps += 1
                outs[r].append(clean[i])
                specs[r] = new_specs_l[i]
                keep_q_rows.append(r)
                keep_q_src.append(i)
            else:
                st.verify_steps += 1
                st.proposed += k
                a = n_acc[i]
                st.accepted += a
                drafted = specs[r]
                assert drafted is not None
                if a == k:
                    st.full_accepts += 1
                    outs[r].extend(drafted + [clean[i]])
                    specs[r] = new_specs_l[i]
                    keep_q_rows.append(r)
                    keep_q_src.append(i)
                else:
                    outs[r].extend(drafted[:a] + [corr[i]])
                    specs[r] = None
            if finish_or_keep(r):
                still.append(r)
        if keep_q_rows:
            q_buf[torch.tensor(keep_q_rows)] = new_q[torch.tensor(keep_q_src)].float()
        live = still
    return [g for g in results if g is not None]


def generate_isd(model: Qwen3Model, prompt: Sequence[int], max_new: int, stride: int, temperature: float = 0.0,
                 top_k: int = 0, top_p: float = 1.0, seed: int = 0, lora_gated: bool = True,
                 proposal: str = "sample", verify_fn: VerifyFn = verify_torch,
                 tokenizer_vocab_size: int | None = None) -> Generation:
    """One request of ``generate_isd_batch``."""
    return generate_isd_batch(model, [prompt], max_new, stride, temperature, top_k, top_p, [seed], lora_gated,
                              proposal, verify_fn, tokenizer_vocab_size)[0]


def _check_args(prompts: Sequence[Sequence[int]], max_new: int, temperature: float, top_k: int,
                top_p: float) -> None:
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    if max_new <= 0:
        raise ValueError("max_new must be positive")
    if temperature < 0 or top_k < 0 or not 0.0 < top_p <= 1.0:
        raise ValueError("need temperature >= 0, top_k >= 0 and 0 < top_p <= 1")
