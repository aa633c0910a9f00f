"""Device side of one ISD engine step: paged forward over query windows, proposals, verify.

Why its own runner: the Steerling runner (``steerling_runner.py``) works on 64-token block rows with
block-causal attention; ISD on a causal Qwen3 model works on short query windows (1 token
for AR, 2N-1 for stride N, up to 64 for a prompt chunk) with plain causal attention. One
step here is, for R rows padded to a common query length Q:

1. **forward**: every row writes the K/V of its real query tokens into its request's pages
   at their absolute positions (padding queries write to scratch page 0), then attends over
   its gathered page table with the mask ``key position <= query position``. That one rule
   is "everything cached before the window" plus "causal inside the window" (window index j
   sees indices <= j, so a [MASK] sees earlier masks); stale K/V of rejected drafts and old
   mask slots lie at positions past the row's window start and are overwritten by the next
   step before anything may see them, so trimming the cache is just the host moving the
   request's valid length back. Only the W = 2K+1 window positions are put through the LM
   head (K = the step's largest N - 1).
   The never-output ids (mask, a non-stop BOS, rows past the tokenizer's vocabulary:
   ``cde.isd.decoder.never_output_ids``) are set to -inf in those logits, as the reference does.
2. **propose**: the clean token (prefill's t0, a cold step's c, a verify step's bonus) and
   K drafts per row with the reference decoder's arithmetic (``cde/isd/decoder.py``):
   argmax at T = 0, else inverse-CDF draws from ``counter_uniform(seed, position, step,
   stream)`` with per-row temperature, top-k and top-p (``keep_mask_rows`` is
   ``keep_mask`` row by row). The new drafts' q logits go into the per-slot q table.
3. **verify** the drafts the host sent (last step's proposals) against this step's p with
   the stored q: ``verify_torch`` on the CPU, the Triton kernel's launcher on CUDA.

A step where no row samples (the host-known ``sampling`` flag is off) does only what greedy
rows need: argmaxes for the clean token and the drafts and ``greedy_verify`` (verify_torch's
greedy rule, bit for bit), with no draws, filters, q-table writes or verify kernel.

All three are one function of fixed-shape tensors per (rows, pages, Q, K) bucket with no
Python branching on data (rows that are not verify rows are verified as greedy dummies and
ignored by the host), so the step can later be compiled and captured as a CUDA graph. The
results come back packed as one int64 tensor: one device-to-host copy per step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from cde.isd.decoder import (STREAM_ACCEPT, STREAM_PROPOSAL, STREAM_RESID, STREAM_SAMPLE, ban_, draw, inverse_cdf,
                             never_output_ids)
from cde.isd.verify import onehot_logits, verify_torch
from cde.qwen3.model import Qwen3Model
from cde.steerling.sampling import counter_uniform
from cde.blocks import PAGE
from cde.regional import Kernels
from worker_svc.engine.attention import PagedKernelUse, query_windows_attend
from worker_svc.engine.kv_cache import KVCache
from worker_svc.engine.layouts import IsdCarry, IsdResultLayout

# the sampler's pure functions (IsdEngine._compile swaps in compiled ones): counter_uniform is
# ~60 int64 elementwise ops eager (five hash rounds) and a step calls it 4 times; one kernel compiled
SAMPLER_FUNCTIONS = {"counter_uniform": counter_uniform}

# proposal modes as ints on the device (cde.isd.decoder.PROPOSALS order)
PROPOSAL_CODES = {"sample": 0, "argmax_onehot": 1, "argmax": 2}

_EXACT_IN_F32 = (torch.float32, torch.bfloat16, torch.float16)

VerifyFn = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor], tuple[Tensor, Tensor]]


@dataclass
class IsdInputs:   # fields hold numpy arrays while the host builds them (IsdEngine._host_inputs)
    # ---- forward -------------------------------------------------------------------------
    tokens: Tensor       # (R, Q) long; padding queries hold any id
    positions: Tensor    # (R, Q) long absolute positions (RoPE and the causal mask)
    gate: Tensor         # (R, Q) bool LoRA gate (1 at [MASK] positions under R-ISD)
    write_idx: Tensor    # (R, Q) long page * 64 + offset receiving the token's K/V (padding: scratch page 0)
    pages: Tensor        # (R, P) long page table, padded with scratch page 0
    read_start: Tensor   # (R,) long query index of window index 0 (a prefill chunk: its last token)
    # ---- proposals and verify ------------------------------------------------------------
    slot: Tensor         # (R,) long row of the q table (0 = scratch: rows that propose nothing)
    win_pos: Tensor      # (R,) long absolute position of window index 0
    clean_j: Tensor      # (R,) long window index whose logits give the clean token
    mask_j0: Tensor      # (R,) long window index of the first [MASK]
    verify_row: Tensor   # (R,) bool the row carries drafts to verify
    drafts: Tensor       # (R, K) long last step's drafts (verify rows; 0 elsewhere)
    greedy: Tensor       # (R,) bool T == 0
    temperature: Tensor  # (R,) float64 (1 on greedy rows; never read there)
    top_k: Tensor        # (R,) long (0 = off)
    top_p: Tensor        # (R,) float64 (1 = off)
    seed: Tensor         # (R,) long
    fwd_index: Tensor    # (R,) long the request's logical forwards before this one (proposal draws' step)
    proposal: Tensor     # (R,) long PROPOSAL_CODES
    # ---- overlapped steps (IsdRunner.advance) ----------------------------------------------
    n_drafts: Tensor     # (R,) long the request's stride - 1
    from_carry: Tensor   # (R,) bool the row's window is derived on the device from the last step's results
    # ---- structured output ---------------------------------------------------------------------
    allow_slot: Tensor   # (R,) long row of the allowed-id table (0 = scratch, all allowed)


def keep_mask_rows(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    """``cde.isd.decoder.keep_mask`` with per-row settings: logits (R, ..., V), settings (R,).

    Row b equals ``keep_mask(logits[b], temperature[b], top_k[b], top_p[b])``: the k-th largest
    value from a sort equals topk's, and the top-p pass is the same arithmetic, skipped (kept
    all) where top_p >= 1 as the reference skips it.
    """
    v = logits.shape[-1]
    shape = (-1,) + (1,) * (logits.dim() - 1)
    x = logits.double() / temperature.double().view(shape)
    top_k_col = top_k.view(shape)
    kth = x.sort(dim=-1, descending=True).values.gather(-1, (top_k_col - 1).clamp(0, v - 1).expand(*x.shape[:-1], 1))
    keep = ((top_k_col <= 0) | (top_k_col >= v)) | (x >= kth)
    tp = top_p.double().view(shape)
    probs = torch.softmax(x.masked_fill(~keep, float("-inf")), dim=-1)
    sorted_p, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    before = torch.cumsum(sorted_p, dim=-1) - sorted_p
    keep_sorted = before < tp
    keep_sorted[..., 0] = True
    keep_p = torch.zeros_like(keep).scatter(-1, order, keep_sorted)
    return keep & (keep_p | (tp >= 1.0))


def scaled_rows(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor, filtered: bool = True) -> Tensor:
    """``cde.isd.decoder.scaled_logits`` per row: logits / T with filtered ids at -inf.
    filtered=False: no row of the step uses top-k / top-p, so nothing is filtered (and the two
    full-vocabulary sorts of `keep_mask_rows` are skipped: the same result, much cheaper)."""
    x = logits.to(torch.promote_types(logits.dtype, torch.float32))
    t = temperature.to(x.dtype).view((-1,) + (1,) * (logits.dim() - 1))
    if not filtered:
        return x / t
    return (x / t).masked_fill(~keep_mask_rows(logits, temperature, top_k, top_p), float("-inf"))


def draw_rows(scaled: Tensor, u: Tensor, few: int = 8, split: bool | None = None) -> Tensor:
    """``cde.isd.decoder.draw`` (inverse-CDF draw in vocabulary order from softmax(scaled) in
    float64) for a step's rows. With only a few rows on a GPU (split: the default there for at
    most `few` rows), torch's softmax and last-dim cumsum run one thread block per 151,936-long
    row (0.2 ms each for 1-3 rows on the H200); the same arithmetic as whole-GPU reductions and
    one 1-D scan per row is far faster. Mathematically the same draw; on a GPU the float64 sums
    associate differently (as any two GPU kernels do), so a uniform within ~1e-16 of a CDF step
    could pick the neighbour."""
    rows = scaled.numel() // max(scaled.shape[-1], 1)
    if split is None:
        split = scaled.device.type == "cuda" and 0 < rows <= few
    if not split:
        return draw(scaled, u)
    x = scaled.double().reshape(rows, -1)
    e = torch.exp(x - x.amax(-1, keepdim=True))
    probs = e / e.sum(-1, keepdim=True)
    cdf = torch.stack([torch.cumsum(probs[i], 0) for i in range(rows)])
    return inverse_cdf(probs, cdf, u.reshape(rows)).view(u.shape)


def greedy_verify(p_logits: Tensor, drafts: Tensor) -> tuple[Tensor, Tensor]:
    """``verify_torch``'s result when every row is greedy, bit for bit, without its softmaxes:
    best = argmax of the float32 p logits (first index on ties); n_accepted = the leading drafts
    equal to it; correction = best at the first rejection, -1 when all were accepted. Rows that
    are not verify rows (drafts 0) get the same rule, as the full path's greedy dummies do."""
    r, max_drafts = drafts.shape
    if max_drafts == 0:
        return (torch.zeros(r, dtype=torch.int64, device=drafts.device),
                torch.full((r,), -1, dtype=torch.int64, device=drafts.device))
    # verify_torch compares float32 logits: wider logits are rounded first (rounding can make
    # ties), narrower ones convert exactly, so their argmax is taken without the copy
    best = (p_logits if p_logits.dtype in _EXACT_IN_F32 else p_logits.float()).argmax(-1)    # (R, K)
    n_acc = torch.cumprod((drafts == best).long(), dim=-1).sum(-1)
    corr = best.gather(1, n_acc.clamp(max=max_drafts - 1)[:, None]).squeeze(1)
    return n_acc, torch.where(n_acc < max_drafts, corr, torch.full_like(corr, -1))


def advance(inp: IsdInputs, carry: Tensor, mask_id: int) -> IsdInputs:
    """The inputs of an overlapped step: rows with ``from_carry`` get the window the host would
    build after applying the last step's results (``carry``, row for row the same requests),
    other rows keep the host's values. Host-known fields (pages, slot, sampling settings,
    n_drafts, and the LoRA gate of query 0, which is always clean) come from ``inp``.

    After a cold step (or an AR step) the next window is a verify window at position + 1 with
    the new drafts (AR: cold again); after a verify step that accepted all K drafts, a verify
    window past them with the bonus token pending; after a rejection at draft a, a cold window
    at position + 1 + a with the correction pending. That is IsdEngine._apply's bookkeeping,
    and the fields are what IsdEngine._host_inputs builds from it (tests/test_isd_engine.py
    compares them field by field)."""
    r, q_len = inp.tokens.shape
    max_drafts = inp.drafts.shape[1]
    dev = inp.tokens.device
    c = carry[:r]
    res = c[:, IsdCarry.RESULTS:]                 # the last step's IsdResultLayout(max_drafts) columns
    lay = IsdResultLayout(max_drafts)
    was_verify = c[:, IsdCarry.VERIFY] != 0
    nk = inp.n_drafts
    n_acc, corr = res[:, lay.n_accepted], res[:, lay.correction]
    a = torch.minimum(n_acc, nk)
    rejected = was_verify & (a < nk)
    verify = ~rejected & (nk > 0)
    start = c[:, IsdCarry.WIN_POS] + 1 + torch.where(was_verify, a, torch.zeros_like(a))
    pending = torch.where(rejected, corr, res[:, lay.CLEAN])
    n = nk + 1
    length = torch.where(verify, 2 * n - 1, n)
    n_clean = torch.where(verify, n, torch.ones_like(n))
    j = torch.arange(q_len, device=dev)[None, :]
    real = j < length[:, None]
    tokens = torch.full_like(inp.tokens, mask_id)
    drafts = torch.zeros_like(inp.drafts)
    if max_drafts:
        new_specs = res[:, lay.drafts]
        drafts = torch.where(verify[:, None] & (torch.arange(max_drafts, device=dev)[None, :] < nk[:, None]), new_specs, 0)
        in_drafts = verify[:, None] & (j >= 1) & (j < n[:, None])
        tokens = torch.where(in_drafts, drafts.gather(1, (j - 1).clamp(0, max_drafts - 1).expand(r, q_len)), tokens)
    tokens = torch.where(j == 0, pending[:, None], tokens)
    tokens = torch.where(real, tokens, 0)                                  # padding queries: 0, as the host pads
    positions = start[:, None] + j
    gate = torch.where(j < n_clean[:, None], inp.gate[:, :1], real)
    p = inp.pages.shape[1]
    page_idx = positions // PAGE
    page_of = inp.pages.gather(1, page_idx.clamp(max=p - 1))
    page_of = torch.where(page_idx < p, page_of, 0)     # past the page table (a row that ends): scratch page
    write_idx = torch.where(real, page_of * PAGE + positions % PAGE, j % PAGE)
    sel, sel2 = inp.from_carry, inp.from_carry[:, None]
    return IsdInputs(
        tokens=torch.where(sel2, tokens, inp.tokens), positions=torch.where(sel2, positions, inp.positions),
        gate=torch.where(sel2, gate, inp.gate), write_idx=torch.where(sel2, write_idx, inp.write_idx),
        pages=inp.pages, read_start=torch.where(sel, 0, inp.read_start), slot=inp.slot,
        win_pos=torch.where(sel, start, inp.win_pos),
        clean_j=torch.where(sel, torch.where(verify, nk, 0), inp.clean_j),
        mask_j0=torch.where(sel, torch.where(verify, n, 1), inp.mask_j0),
        verify_row=torch.where(sel, verify, inp.verify_row), drafts=torch.where(sel2, drafts, inp.drafts),
        greedy=inp.greedy, temperature=inp.temperature, top_k=inp.top_k, top_p=inp.top_p, seed=inp.seed,
        fwd_index=torch.where(sel, c[:, IsdCarry.FWD] + 1, inp.fwd_index), proposal=inp.proposal,
        n_drafts=inp.n_drafts, from_carry=inp.from_carry, allow_slot=inp.allow_slot)


def default_verify(device: torch.device) -> VerifyFn:
    """verify_torch on the CPU; the Triton kernel (no host-syncing checks) on CUDA when available."""
    if device.type == "cuda":
        try:
            from cde.isd.verify_kernel import launch
        except ImportError:
            return verify_torch
        return launch
    return verify_torch


class IsdRunner:
    """Holds the model, the KV cache and the q table; ``step`` is the device step."""

    def __init__(self, model: Qwen3Model, kv: KVCache, n_slots: int, max_drafts: int,
                 verify_fn: VerifyFn | None = None, max_rows: int = 128, tokenizer_vocab_size: int | None = None,
                 never_output: tuple[int, ...] = ()):
        self.model = model
        self.cfg = model.cfg
        self.kv = kv
        dev = model.lm_head.weight.device
        # ids never sampled (cde.isd.decoder.never_output_ids): -inf in every step's logits
        self.banned = torch.tensor(never_output_ids(self.cfg, tokenizer_vocab_size, never_output), dtype=torch.long,
                                   device=dev)
        # stored draft logits, already temperature-scaled (float32 as the reference's q_buf); slot 0 is scratch
        self.q_table = torch.zeros(n_slots, max_drafts, self.cfg.vocab_size, dtype=torch.float32, device=dev)
        # structured output: per slot, the ids its grammar allows at window indices 0..max_drafts (the
        # clean token and the verified drafts' positions); written by the host before a step
        self.allow_table = torch.ones(n_slots, max_drafts + 1, self.cfg.vocab_size, dtype=torch.bool, device=dev)
        self.verify_fn = verify_fn or default_verify(dev)
        # each step's rows' window start, kind, forward count and results, for `advance` (one
        # fixed buffer: every CUDA graph reads and writes the same one)
        self.carry = torch.zeros(max_rows, IsdCarry.width(max_drafts), dtype=torch.int64, device=dev)
        self.mask_id = self.cfg.mask_token_id if self.cfg.mask_token_id is not None else 0
        self.kernels = Kernels(SAMPLER_FUNCTIONS)
        # Triton attention over the pages for decode windows (CUDA, bf16/fp16); else gather + SDPA
        self.paged_kernel = PagedKernelUse()

    @property
    def use_paged_attention(self) -> bool:
        return self.paged_kernel.enabled

    @use_paged_attention.setter
    def use_paged_attention(self, on: bool) -> None:
        self.paged_kernel.enabled = on

    @property
    def paged_calls(self) -> int:
        return self.paged_kernel.calls

    def uniforms(self, seed: Tensor, position: Tensor, step: Tensor, stream: int) -> Tensor:
        """counter_uniform through `kernels`, on flattened (equal-shape) tensors: one 1-D graph
        serves every call when compiled."""
        return self.kernels.counter_uniform(seed.reshape(-1), position.reshape(-1), step.reshape(-1),
                                            stream).view(position.shape)

    # ---- 1. forward ---------------------------------------------------------------------
    def forward(self, inp: IsdInputs, window: int) -> Tensor:
        """Logits (R, window, V) at query indices read_start .. read_start + window - 1 (clamped)."""
        r, q_len = inp.tokens.shape
        dev = inp.tokens.device
        attend = query_windows_attend(self.kv, inp.write_idx, inp.pages, inp.positions, self.paged_kernel)
        h = self.model.hidden_states(inp.tokens, inp.positions, attend, inp.gate)
        idx = (inp.read_start[:, None] + torch.arange(window, device=dev)[None, :]).clamp(max=q_len - 1)
        hw = h.gather(1, idx[..., None].expand(r, window, h.shape[-1]))
        return self.model.logits(hw)

    # ---- 2. + 3. proposals and verify -----------------------------------------------------
    def propose_and_verify(self, inp: IsdInputs, logits: Tensor, filtered: bool = True,
                           sampling: bool = True) -> Tensor:
        """Packed (R, K + 3) int64: clean token, K new drafts, n_accepted, correction.

        sampling: some row of the step samples (T > 0), a host-known flag (part of the graph
        bucket). Without it every row is greedy and the step is argmaxes only: no draws, no
        vocabulary filters, no q-table write (a greedy request never reads its q), and verify
        is `greedy_verify` instead of ``verify_fn``; the packed result is the same."""
        r, w, v = logits.shape
        max_drafts = inp.drafts.shape[1]
        dev = logits.device
        rows = torch.arange(r, device=dev)
        # clean token at absolute position win_pos + clean_j + 1
        clean_logits = logits[rows, inp.clean_j]                                        # (R, V)
        # K new drafts from the mask logits (window indices mask_j0 .. mask_j0 + K - 1)
        mask_j = (inp.mask_j0[:, None] + torch.arange(max_drafts, device=dev)[None, :]).clamp(max=w - 1)
        mlog = logits[rows[:, None], mask_j]                                            # (R, K, V)
        # last step's drafts s_i are verified against window index i - 1 (i = 1..K)
        raw = logits[:, :max_drafts]
        if not sampling:
            n_acc, corr = greedy_verify(raw, inp.drafts)
            return IsdResultLayout.pack(clean_logits.argmax(-1), mlog.argmax(-1), n_acc, corr)

        greedy = inp.greedy
        temp = torch.where(greedy, torch.ones_like(inp.temperature), inp.temperature)
        zeros = torch.zeros_like(inp.seed)

        u = self.uniforms(inp.seed, inp.win_pos + inp.clean_j + 1, zeros, STREAM_SAMPLE)
        drawn = draw_rows(scaled_rows(clean_logits, temp, inp.top_k, inp.top_p, filtered), u)
        clean = torch.where(greedy, clean_logits.argmax(-1), drawn)

        scaled = scaled_rows(mlog, temp, inp.top_k, inp.top_p, filtered)
        seed_per_draft = inp.seed[:, None].expand(r, max_drafts)
        u = self.uniforms(seed_per_draft, inp.win_pos[:, None] + mask_j + 1, inp.fwd_index[:, None].expand(r, max_drafts),
                            STREAM_PROPOSAL)
        sampled = draw_rows(scaled, u)
        top = scaled.argmax(-1)
        g2, prop = greedy[:, None], inp.proposal[:, None]
        new_specs = torch.where(g2, mlog.argmax(-1),
                                torch.where(prop == PROPOSAL_CODES["sample"], sampled, top))
        new_q = torch.where(g2[..., None], mlog.float(),
                            torch.where((prop == PROPOSAL_CODES["argmax_onehot"])[..., None],
                                        onehot_logits(top, v), scaled.float()))

        p_in = raw.float()   # unfiltered steps: every row's p is its raw logits (greedy or not)
        if filtered:
            p_in = torch.where(greedy[:, None, None], p_in,
                               p_in.masked_fill(~keep_mask_rows(raw, temp, inp.top_k, inp.top_p), float("-inf")))
        spos = inp.win_pos[:, None] + 1 + torch.arange(max_drafts, device=dev)[None, :]
        ua = self.uniforms(seed_per_draft, spos, torch.zeros_like(spos), STREAM_ACCEPT)
        ur = self.uniforms(seed_per_draft, spos, torch.zeros_like(spos), STREAM_RESID)
        q_table = self.q_table.narrow(1, 0, max_drafts)
        q_old = q_table.index_select(0, inp.slot)
        vgreedy = greedy | ~inp.verify_row
        vtemp = torch.where(vgreedy, torch.zeros_like(temp), temp).float()
        n_acc, corr = self.verify_fn(p_in, q_old, inp.drafts, vtemp, ua, ur, vgreedy)
        # the new drafts' q: read by the next step only if it is a verify step (rejection -> cold)
        q_table.index_copy_(0, inp.slot, new_q)
        return IsdResultLayout.pack(clean, new_specs, n_acc, corr)

    def step(self, inp: IsdInputs, window: int, filtered: bool = True, sampling: bool = True,
             overlapped: bool = False, constrained: bool = False) -> Tensor:
        """filtered: some row of the step uses top-k or top-p; sampling: some row samples (T > 0);
        constrained: some row follows a grammar (its allowed ids mask the logits of window indices
        0..K, which give the clean token and verify's p: the target is the base model's
        distribution restricted to the grammar; the new drafts stay unconstrained proposals, which
        speculative sampling's rule keeps exact whatever q is).
        All are host-known flags (part of the graph bucket) that switch off work no row needs.
        overlapped: the step was launched before the last one's results reached the host; its
        ``from_carry`` rows' windows are derived here (`advance`). Every step leaves its rows'
        state in the carry buffer for the next one."""
        if overlapped:
            inp = advance(inp, self.carry, self.mask_id)
        # the never-output ids go to -inf before anything reads the logits, as in the reference
        logits = ban_(self.forward(inp, window), self.banned)
        if constrained:
            w = min(inp.drafts.shape[1] + 1, logits.shape[1])
            allow = self.allow_table.index_select(0, inp.allow_slot)[:, :w]
            logits[:, :w] = logits[:, :w].masked_fill(~allow, float("-inf"))
        packed = self.propose_and_verify(inp, logits, filtered, sampling)
        r = packed.shape[0]
        state = IsdCarry.pack(inp.win_pos, inp.verify_row, inp.fwd_index, packed)
        self.carry[:r, :state.shape[1]].copy_(state)
        return packed
