"""Introspective Strided Decoding: the verify rule, its Triton kernel, and the reference decoder.

What is checked, and against what:

* Verify rule: ``verify_torch`` (batched float32) and the Triton kernel against the plain
  float64 ``verify_reference``, on random rows and edge cases (p == q, certain rejection,
  filtered p, greedy ties, vocabularies that are not a multiple of the tile). Inputs are
  fixed; a disagreement is only excused when the float64 reference puts the decision
  within 1e-5 of its boundary (float32 rounding).
* Triton: the kernel runs under Triton's CPU interpreter in a child process
  (``TRITON_INTERPRET=1`` must be set before ``triton`` is imported: its own jit helpers are
  built at import), and is compiled for sm_90 (H100/H200) without a GPU to prove the
  compiled path is valid Triton, not just valid Python.
* Greedy: ISD at T = 0 is token-identical to greedy AR for N = 2, 3, 4, 8, on the random
  tiny Qwen3 preset (drafts nearly always rejected) and on ``cde.isd.toy.lag_model`` (drafts
  often accepted: full windows, bonus tokens, rejections at every index); R-ISD with a
  random LoRA equals the *base* model's greedy AR, and without the gate it follows the
  adapted model instead.
* Distribution: 20,000 seeded ISD runs (4 new tokens, V = 6, so 6**4 = 1,296 sequences)
  against the exact AR distribution computed from the model in float64. Statistic:
  Pearson chi-square after pooling the least likely sequences into one bin until it
  expects >= 5 counts; p-value from the regularized upper incomplete gamma. A correct
  rule must give p > 1e-5; each deliberately broken rule (double temperature scaling,
  always accept, correction drawn from p instead of max(0, p - q), argmax drafts with the
  soft q as the released code does, R-ISD without the gate) must give p < 1e-12. Decoding
  seeds are fresh each run (printed in failures); the small model's weights are fixed so the
  broken rules' effect sizes -- measured at p < 1e-40 -- stay far from the threshold.

Models run in float64: the decoders recompute everything with different padding and
batch shapes, and float32 near-ties could flip an argmax between two runs that are
mathematically identical.
"""

from __future__ import annotations

import json
import random

import pytest
import torch

from cde.isd.decoder import (STREAM_ACCEPT, STREAM_PROPOSAL, STREAM_RESID, STREAM_SAMPLE, draw, generate_ar,
                             generate_ar_batch, generate_isd, generate_isd_batch, keep_mask)
from cde.isd.distribution import pooled_chi_square
from cde.isd.toy import lag_model
from cde.isd.verify import verify_reference, verify_torch
from cde.qwen3.config import Qwen3Config, preset
from cde.qwen3.model import Qwen3Model
from tests.tiny_models import random_lora
from tests.triton_child import HAS_TRITON, run_child
from tests.verify_cases import TRITON_ROWS, assert_same_decisions, check_case_semantics, verify_cases

pytestmark = pytest.mark.parity


# =========================================================================================
# The verify rule
# =========================================================================================


@pytest.mark.parametrize("name", ["random", "p_equals_q", "first_rejected", "filtered_p", "greedy_ties",
                                  "random_v1000", "banned_ids"])
def test_verify_torch_matches_float64_reference(name):
    args = verify_cases()[name]
    got = verify_torch(*args)
    want = verify_reference(*args)
    check_case_semantics(name, args, want)
    check_case_semantics(name, args, got)
    assert_same_decisions(name, got, want, args)


def test_verify_rejects_bad_inputs():
    p, q, d, t, ua, ur, g = verify_cases()["random"]
    with pytest.raises(ValueError, match="temperature > 0"):
        verify_torch(p, q, d, torch.zeros_like(t), ua, ur, torch.zeros_like(g))
    with pytest.raises(ValueError, match="drafts"):
        verify_torch(p, q, d[:, :2], t, ua, ur, g)
    with pytest.raises(ValueError, match=r"\[0, V\)"):
        verify_torch(p, q, d + 100, t, ua, ur, g)


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (pip install -r requirements-test.txt)")
def test_verify_triton_interpreter():
    """The kernels under Triton's CPU interpreter equal the torch rule and the float64 reference, with
    the vocabulary in one split or several, tiles partial or not."""
    proc = run_child("from tests.verify_cases import triton_child; triton_child()", interpret=True)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-6000:]}"
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["p_equals_q/16x1"] == TRITON_ROWS and report["first_rejected/16x1"] == 0, report
    assert 0 < report["decoder_acceptance"] < 1, report


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (pip install -r requirements-test.txt)")
def test_verify_kernel_compiles_for_sm90():
    """Compile (no GPU needed) for sm_90: the compiled dialect is stricter than the interpreter."""
    code = """
import inspect
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from cde.isd.verify_kernel import KERNELS, kernel
ints = {"drafts_ptr", "greedy_ptr", "best_ptr", "n_acc_ptr", "corr_ptr", "rej_ptr", "rlast_ptr"}
consts = {"BLOCK": 1024, "S_POW2": 64}
for name, fn in KERNELS.items():
    params = list(inspect.signature(fn).parameters)
    sig = {a: "constexpr" if a in consts else "*bf16" if a == "p_ptr" else "*i32" if a in ints
           else "*fp32" if a.endswith("_ptr") else "i32" for a in params}
    k = triton.compile(ASTSource(kernel(name), sig, constexprs={c: consts[c] for c in consts if c in params}),
                       target=GPUTarget("cuda", 90, 32))
    print(name, sorted(k.asm))
"""
    proc = run_child(code, interpret=False)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-6000:]}"
    assert proc.stdout.count("cubin") == 4 and proc.stdout.count("ptx") == 4, proc.stdout


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (pip install -r requirements-test.txt)")
def test_jitted_kernels_see_their_constexpr_parameters():
    """The launcher's jitted kernels (not the plain functions the sm_90 test compiles with an explicit
    signature) must mark the parameters annotated `tl.constexpr` as such: `tl.arange(0, BLOCK)`
    does not compile otherwise. A copy that dropped the annotations failed on the H200 only."""
    code = """
import inspect
from cde.isd.verify_kernel import KERNELS, kernel
for name, fn in KERNELS.items():
    annotated = {n for n, p in inspect.signature(fn).parameters.items() if "constexpr" in str(p.annotation)}
    marked = {p.name for p in kernel(name).params if p.is_constexpr}
    assert annotated and marked == annotated, (name, annotated, marked)
print("ok")
"""
    proc = run_child(code, interpret=False)
    assert proc.returncode == 0 and "ok" in proc.stdout, f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-6000:]}"


@pytest.mark.gpu
@pytest.mark.skipif(not (HAS_TRITON and torch.cuda.is_available()), reason="needs triton and CUDA")
def test_verify_triton_cuda():
    from cde.isd.verify import verify_triton

    for name, args in verify_cases().items():
        cuda_args = tuple(a.cuda() for a in args)
        got = tuple(x.cpu() for x in verify_triton(*cuda_args, block=16))
        check_case_semantics(name, args, got)
        assert_same_decisions(name, got, verify_reference(*args), args)


def test_counter_streams_never_collide():
    """counter_uniform starts from step ^ (0x9E3779B9 + stream): no (step, stream) pair of ours may
    hash like another (the first stream choice did, and the chi-square test caught it)."""
    streams = (0, STREAM_SAMPLE, STREAM_ACCEPT, STREAM_RESID, STREAM_PROPOSAL)
    firsts = {(step ^ (0x9E3779B9 + s)) for s in streams for step in range(1 << 16)}
    assert len(firsts) == len(streams) << 16
    assert all(0x9E3779B9 + s < 1 << 32 for s in streams)


# =========================================================================================
# Greedy: token-identical to AR
# =========================================================================================

def mixed_prompts(seed: int, vocab: int, avoid: set[int]) -> list[list[int]]:
    rng = random.Random(seed)
    ids = [i for i in range(vocab) if i not in avoid]
    return [[rng.choice(ids) for _ in range(n)] for n in (1, 2, 5, 11, 23, 40)]


def greedy_models(seed: int) -> dict[str, Qwen3Model]:
    return {"tiny-random": Qwen3Model(preset("tiny")).init_random(seed).double().eval(),
            "lag4": lag_model(seed, lag=4, vocab=64, beta=1.0)}


@pytest.mark.parametrize("kind", ["tiny-random", "lag4"])
def test_greedy_isd_matches_greedy_ar(kind, seed):
    model = greedy_models(seed)[kind]
    cfg = model.cfg
    prompts = mixed_prompts(seed, cfg.vocab_size, {cfg.mask_token_id, *cfg.eos_token_ids})
    ar = generate_ar_batch(model, prompts, max_new=24)
    for n in (2, 3, 4, 8):
        isd = generate_isd_batch(model, prompts, max_new=24, stride=n)
        for prompt, a, b in zip(prompts, ar, isd):
            assert b.tokens == a.tokens and b.finish_reason == a.finish_reason, \
                f"seed={seed} {kind} N={n} prompt len {len(prompt)}: ISD {b.tokens} != AR {a.tokens}"
            assert b.stats.forwards <= a.stats.forwards, f"seed={seed} {kind} N={n}: ISD used more forwards"
            assert b.stats.generated == len(b.tokens)
        one = generate_isd(model, prompts[3], max_new=24, stride=n)
        assert one.tokens == isd[3].tokens, f"seed={seed} {kind} N={n}: batching changed a row"
        if kind == "lag4":
            acc = sum(g.stats.accepted for g in isd)
            prop = sum(g.stats.proposed for g in isd)
            full = sum(g.stats.full_accepts for g in isd)
            assert 0 < acc < prop, f"seed={seed} N={n}: accepted {acc} of {prop}: a path is not exercised"
            if n <= 4:
                assert full > 0, f"seed={seed} N={n}: no verify step accepted a whole window"
    assert generate_ar(model, prompts[2], 24).tokens == ar[2].tokens


def test_greedy_risd_equals_base_ar_and_ungated_does_not(seed):
    model = lag_model(seed, lag=4, vocab=64, beta=1.0)
    prompts = mixed_prompts(seed, 64, {63})
    base = generate_ar_batch(model, prompts, max_new=20)
    random_lora(model, seed + 1, scale=0.5)
    adapted = generate_ar_batch(model, prompts, max_new=20, use_lora=True)
    assert any(a.tokens != b.tokens for a, b in zip(adapted, base)), f"seed={seed}: the LoRA changes nothing"
    for n in (2, 4):
        gated = generate_isd_batch(model, prompts, max_new=20, stride=n, lora_gated=True)
        assert [g.tokens for g in gated] == [g.tokens for g in base], \
            f"seed={seed} N={n}: R-ISD (LoRA at masks only) differs from base greedy AR"
        ungated = generate_isd_batch(model, prompts, max_new=20, stride=n, lora_gated=False)
        assert [g.tokens for g in ungated] != [g.tokens for g in base], \
            f"seed={seed} N={n}: LoRA everywhere should leave the base distribution"
        # ... because then p is the adapted model's: ISD is still exact, for the wrong model.
        assert [g.tokens for g in ungated] == [g.tokens for g in adapted], f"seed={seed} N={n}"


def test_tokens_per_forward_follows_the_spec_formula(seed):
    """With each draft accepted independently with probability a, the step machine (cold after a
    rejection, bonus on a full window) gives (2 + a + ... + a^(N-2)) / (2 - a^(N-1)) tokens per
    decode forward in steady state (spec). The tokens themselves do not matter here."""
    a, n, rows, new = 0.6, 4, 48, 160

    def accept_with_a(p, q, d, t, ua, ur, g):
        ok = torch.cumprod((ua < a).long(), -1).sum(-1)
        return ok, torch.where(ok < d.shape[1], p.argmax(-1)[:, 0], -1)

    model = lag_model(seed, lag=2, vocab=16)
    gens = generate_isd_batch(model, [[1, 2, 3]] * rows, new, n, temperature=1.0,
                              seeds=range(seed, seed + rows), verify_fn=accept_with_a)
    decode_tokens = sum(g.stats.generated - 1 for g in gens)  # the prefill's token and forward aside
    decode_forwards = sum(g.stats.forwards - 1 for g in gens)
    expected = (2 + sum(a ** j for j in range(1, n - 1))) / (2 - a ** (n - 1))
    got = decode_tokens / decode_forwards
    assert abs(got - expected) < 0.04 * expected, f"seed={seed}: tokens/forward {got:.3f}, formula {expected:.3f}"


# =========================================================================================
# Sampled: the distribution of ISD output equals AR's
# =========================================================================================

SMALL_V = 6
NEW_TOKENS = 4
RUNS = 20_000
PROMPT = [1, 2, 0]
P_OK = 1e-5
P_BROKEN = 1e-12


def small_model() -> Qwen3Model:
    """V = 6 (the mask is id 5), sharpened head so distributions are far from uniform; fixed weights."""
    cfg = Qwen3Config(n_layers=2, hidden=32, n_heads=2, n_kv_heads=1, head_dim=16, intermediate=64,
                      vocab_size=SMALL_V, mask_token_id=SMALL_V - 1, bos_token_id=None, eos_token_ids=(),
                      max_positions=256)
    model = Qwen3Model(cfg).init_random(3).double().eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model


def exact_distribution(model: Qwen3Model, temperature: float, top_k: int = 0,
                       top_p: float = 1.0) -> dict[tuple[int, ...], float]:
    """P(first NEW_TOKENS tokens) under base-model AR sampling, by enumeration in float64."""
    joint: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(NEW_TOKENS):
        seqs = list(joint)
        batch = torch.tensor([PROMPT + list(s) for s in seqs])
        with torch.no_grad():
            logits = model(batch, lora_gate=torch.zeros(batch.shape))[:, -1].double()
        logits[:, model.cfg.mask_token_id] = float("-inf")   # never output: the decoders ban it
        keep = keep_mask(logits, temperature, top_k, top_p)
        probs = torch.softmax((logits / temperature).masked_fill(~keep, float("-inf")), -1)
        joint = {s + (t,): joint[s] * float(row[t]) for s, row in zip(seqs, probs) for t in range(SMALL_V)
                 if float(row[t]) > 0}
    return joint


def chi_square(counts: dict[tuple[int, ...], int], exact: dict[tuple[int, ...], float],
               n: int) -> tuple[float, int, float, float]:
    """`pooled_chi_square`, with a sample outside the exact support failing at once by name."""
    assert set(counts) <= set(exact), f"impossible sequences sampled: {sorted(set(counts) - set(exact))[:5]}"
    return pooled_chi_square(counts, exact, n)


def sample_counts(model: Qwen3Model, stride: int | None, temperature: float, seed: int, top_k: int = 0,
                  top_p: float = 1.0, **kwargs) -> tuple[dict[tuple[int, ...], int], float, int]:
    """RUNS seeded decodes of PROMPT (stride None: AR): (counts, acceptance, full windows)."""
    seeds = range(seed, seed + RUNS)
    if stride is None:
        gens = generate_ar_batch(model, [PROMPT] * RUNS, NEW_TOKENS, temperature, top_k, top_p, seeds)
    else:
        gens = generate_isd_batch(model, [PROMPT] * RUNS, NEW_TOKENS, stride, temperature, top_k, top_p, seeds,
                                  **kwargs)
    counts: dict[tuple[int, ...], int] = {}
    for g in gens:
        assert len(g.tokens) == NEW_TOKENS
        counts[tuple(g.tokens)] = counts.get(tuple(g.tokens), 0) + 1
    proposed = sum(g.stats.proposed for g in gens)
    acceptance = sum(g.stats.accepted for g in gens) / proposed if proposed else 0.0
    return counts, acceptance, sum(g.stats.full_accepts for g in gens)


def double_temperature(p, q, d, t, ua, ur, g):
    """The reported bug: the stored (already scaled) draft logits divided by T again."""
    return verify_torch(p, q / t[:, None, None], d, t, ua, ur, g)


def always_accept(p, q, d, t, ua, ur, g):
    return torch.full((p.shape[0],), p.shape[1]), torch.full((p.shape[0],), -1)


def correction_from_p(p, q, d, t, ua, ur, g):
    """Right acceptance, but the correction drawn from p instead of normalize(max(0, p - q))."""
    n_acc, corr = verify_torch(p, q, d, t, ua, ur, g)
    rows = (n_acc < p.shape[1]).nonzero().flatten()
    i = n_acc[rows]
    corr[rows] = draw(p[rows, i].double() / t[rows, None].double(), ur[rows, i])
    return n_acc, corr


# (stride, temperature, top_k, top_p, decoder kwargs)
CORRECT = {
    "ar": (None, 0.6, 0, 1.0, {}),
    "isd-N2": (2, 0.6, 0, 1.0, {}),
    "isd-N3": (3, 0.6, 0, 1.0, {}),
    "isd-N3-argmax-onehot-q": (3, 0.6, 0, 1.0, dict(proposal="argmax_onehot")),
    "isd-N3-T1.3-topk4-topp0.9": (3, 1.3, 4, 0.9, {}),
}
BROKEN = {
    "double-temperature": (3, 0.6, 0, 1.0, dict(verify_fn=double_temperature)),
    "always-accept": (2, 0.6, 0, 1.0, dict(verify_fn=always_accept)),
    "correction-from-p": (3, 0.6, 0, 1.0, dict(verify_fn=correction_from_p)),
    "argmax-drafts-soft-q": (3, 0.6, 0, 1.0, dict(proposal="argmax")),  # the released code's rule
}


@pytest.fixture(scope="module")
def small():
    return small_model()


@pytest.mark.parametrize("variant", sorted(CORRECT))
def test_sampled_isd_follows_ar_distribution(small, variant, seed):
    stride, temperature, top_k, top_p, kwargs = CORRECT[variant]
    exact = exact_distribution(small, temperature, top_k, top_p)
    counts, acceptance, full = sample_counts(small, stride, temperature, seed, top_k, top_p, **kwargs)
    stat, df, p, tv = chi_square(counts, exact, RUNS)
    msg = f"seed={seed} {variant}: chi2={stat:.1f} df={df} p={p:.3g} TV={tv:.4f} acceptance={acceptance:.3f}"
    print(msg)
    assert p > P_OK, msg
    if stride is not None:
        assert 0.05 < acceptance < 0.95 and full > 0, f"{msg}: accept/reject/bonus paths not all exercised"


@pytest.mark.parametrize("variant", sorted(BROKEN))
def test_broken_acceptance_rules_are_caught(small, variant, seed):
    stride, temperature, top_k, top_p, kwargs = BROKEN[variant]
    exact = exact_distribution(small, temperature, top_k, top_p)
    counts, acceptance, _ = sample_counts(small, stride, temperature, seed, top_k, top_p, **kwargs)
    stat, df, p, tv = chi_square(counts, exact, RUNS)
    msg = f"seed={seed} {variant}: chi2={stat:.1f} df={df} p={p:.3g} TV={tv:.4f} acceptance={acceptance:.3f}"
    print(msg)
    assert p < P_BROKEN, f"{msg}: the test statistic does not see a broken rule"


def test_risd_sampled_follows_base_ar_and_ungated_does_not(seed):
    model = random_lora(small_model(), seed=7, scale=0.5)
    exact = exact_distribution(model, 0.6)  # gate 0 everywhere: the base model
    for gated, ok in ((True, True), (False, False)):
        counts, acceptance, _ = sample_counts(model, 3, 0.6, seed, lora_gated=gated)
        stat, df, p, tv = chi_square(counts, exact, RUNS)
        msg = f"seed={seed} gated={gated}: chi2={stat:.1f} df={df} p={p:.3g} TV={tv:.4f} acceptance={acceptance:.3f}"
        print(msg)
        assert (p > P_OK) if ok else (p < P_BROKEN), msg
