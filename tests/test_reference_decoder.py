"""The reference decoder's own contract (beyond oracle parity): aligned blocks, stops,
threshold mode, seeded determinism, raw records, and the sampler's randomness."""

from __future__ import annotations

import math

import pytest
import torch

from cde.steerling.concept_heads import streaming_topk
from cde.steerling.config import TINY
from cde.steerling.model import SteerlingModel
from cde.steerling.reference_decoder import generate
from cde.steerling.sampling import SamplingParams, counter_uniform, draw, most_confident, sampling_distribution
from tests.options import decode_options

VOCAB = 264


@pytest.fixture(scope="module")
def model():
    return SteerlingModel(TINY).init_random(7, std=0.05).eval()


def greedy():
    return SamplingParams(use_entropy_sampling=False, temperature=0.0)


@pytest.mark.parametrize("prompt_len", [1, 63, 64, 65, 130])
def test_blocks_are_aligned_and_prompt_is_fixed(model, prompt_len):
    prompt = torch.randint(0, 256, (prompt_len,), generator=torch.Generator().manual_seed(prompt_len)).tolist()
    res = generate(model, prompt, decode_options(70, sampling=SamplingParams(), seed=5), tokenizer_vocab_size=VOCAB)
    assert res.sequence[:prompt_len] == prompt
    first = res.blocks[0]
    assert first.block == prompt_len // 64 and first.start == prompt_len
    assert first.end == min((prompt_len // 64 + 1) * 64, prompt_len + 70)
    for b in res.blocks[1:]:
        assert b.start % 64 == 0 and b.end - b.start <= 64
    # every step commits positions inside its own block, each generated position once
    committed = [p for s in res.steps for p in s.positions]
    assert len(committed) == len(set(committed))
    for s in res.steps:
        assert all(p // 64 == s.block for p in s.positions)
    if res.finish_reason == "length":
        assert sorted(committed) == list(range(prompt_len, prompt_len + 70))
    assert len(res.records) == len(committed)


def test_seeded_sampling_is_reproducible_and_seed_dependent(model):
    prompt = list(range(40, 100))
    a = generate(model, prompt, decode_options(64, seed=11), tokenizer_vocab_size=VOCAB)
    b = generate(model, prompt, decode_options(64, seed=11), tokenizer_vocab_size=VOCAB)
    c = generate(model, prompt, decode_options(64, seed=12), tokenizer_vocab_size=VOCAB)
    assert a.sequence == b.sequence
    assert a.sequence != c.sequence


def test_threshold_mode_commits_several_per_step(model):
    prompt = list(range(64))
    res = generate(model, prompt, decode_options(64, sampling=greedy(), tokens_per_step=16, confidence_threshold=0.0102),
                   tokenizer_vocab_size=VOCAB)
    sizes = [len(s.positions) for s in res.steps]
    assert all(n >= 1 for n in sizes) and max(sizes) > 1 and len(res.steps) < 64
    strict = generate(model, prompt, decode_options(64, sampling=greedy(), tokens_per_step=16, confidence_threshold=1.0),
                      tokenizer_vocab_size=VOCAB)
    assert all(len(s.positions) == 1 for s in strict.steps)


def test_eot_stops_generation_and_cuts_output(model):
    # Make <|eot_id|> overwhelmingly likely by boosting its LM-head row.
    m = SteerlingModel(TINY).eval()
    m.load_state_dict(model.state_dict())
    with torch.no_grad():
        m.transformer.lm_head.weight[TINY.eot_id] *= 40
    res = generate(m, list(range(64)), decode_options(128, sampling=greedy()), tokenizer_vocab_size=VOCAB)
    assert res.finish_reason == "stop"
    assert TINY.eot_id not in res.output_tokens
    eot_pos = res.sequence.index(TINY.eot_id)
    assert all(t == TINY.eos_id for t in res.sequence[eot_pos + 1:])
    assert len(res.blocks) == 1


def test_stop_ids_end_after_the_block(model):
    base = generate(model, list(range(64)), decode_options(128, sampling=greedy()), tokenizer_vocab_size=VOCAB)
    stop = base.sequence[64 + 5]
    res = generate(model, list(range(64)), decode_options(128, sampling=greedy(), stop_ids=(stop,)),
                   tokenizer_vocab_size=VOCAB)
    assert res.finish_reason == "stop" and len(res.blocks) == 1
    assert stop not in res.output_tokens
    assert res.output_tokens == base.output_tokens[:len(res.output_tokens)]


def test_never_emits_banned_or_padding_ids(model):
    res = generate(model, list(range(10)), decode_options(150, sampling=SamplingParams(top_p=1.0), seed=3),
                   tokenizer_vocab_size=VOCAB)
    gen = [t for s in res.steps for t in s.tokens]
    assert len(gen) > 0 and all(t < VOCAB for t in gen)
    assert TINY.mask_id not in gen and TINY.pad_id not in gen


def test_records_hold_the_raw_logit_of_the_committed_token(model):
    model = SteerlingModel(TINY.replace(eot_id=None)).eval()   # no <|eot_id|>: the last step is the 64th
    model.load_state_dict(SteerlingModel(TINY).init_random(7, std=0.05).state_dict())
    res = generate(model, list(range(64)), decode_options(64, seed=1), tokenizer_vocab_size=VOCAB)
    rec = res.records
    # recompute the forward that committed the last token and compare its raw logit
    last = res.steps[-1]
    seq = torch.tensor(res.sequence[:128])
    seq[last.positions[0]] = TINY.mask_id
    with torch.no_grad():
        out = model(seq[None])
    assert float(out.logits[last.positions[0], last.tokens[0]]) == pytest.approx(float(rec.target_logits[-1]), abs=1e-5)
    assert torch.equal(out.known_idx[last.positions[0]], rec.known_idx[-1])


def test_invalid_options_are_rejected(model):
    with pytest.raises(ValueError):
        decode_options(0)
    with pytest.raises(ValueError):
        decode_options(10, tokens_per_step=0)
    with pytest.raises(ValueError):
        generate(model, [], decode_options(4))
    with pytest.raises(ValueError, match="context"):
        generate(model, [1] * 1000, decode_options(100))


# ---------------------------------------------------------------------------------------
# Sampler pieces


def test_counter_uniform_is_a_pure_function_and_uniform():
    seed = torch.full((20000,), 123456789012, dtype=torch.long)
    pos = torch.arange(20000)
    step = torch.full((20000,), 3)
    u1 = counter_uniform(seed, pos, step)
    u2 = counter_uniform(seed.flip(0), pos.flip(0), step).flip(0)
    assert torch.equal(u1, u2)
    assert float(u1.min()) > 0 and float(u1.max()) < 1
    hist = torch.histc(u1.float(), bins=10, min=0, max=1)
    chi2 = float(((hist - 2000) ** 2 / 2000).sum())
    assert chi2 < 30  # 9 dof, p ~ 0.0004
    assert not torch.equal(u1, counter_uniform(seed, pos, step + 1))
    assert not torch.equal(u1, counter_uniform(seed + (1 << 32), pos, step))


def test_inverse_cdf_draw_follows_the_filtered_distribution():
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(0)) * 2
    params = [SamplingParams(use_entropy_sampling=False, temperature=0.8, top_p=0.9)]
    filtered, ids = sampling_distribution(logits, params)
    n = 40000
    u = counter_uniform(torch.full((n,), 9), torch.arange(n), torch.zeros(n, dtype=torch.long))
    tokens = draw(filtered.expand(n, -1), ids.expand(n, -1), u)
    expected = torch.zeros(50).scatter_(0, ids[0], filtered[0])
    observed = torch.bincount(tokens, minlength=50).float() / n
    assert float(observed[expected == 0].sum()) == 0.0   # nothing outside top-p
    support = expected > 0
    assert torch.allclose(observed[support], expected[support], atol=4 * math.sqrt(0.25 / n) + 1e-3)


def test_streaming_topk_equals_dense_topk():
    g = torch.Generator().manual_seed(1)
    h, w = torch.randn(37, 24, generator=g) * 0.5, torch.randn(203, 24, generator=g) * 0.5
    dense = (h @ w.t()).clamp(-15, 15)
    for chunk in (7, 64, 1000):
        for by_sigmoid in (False, True):
            idx, lg = streaming_topk(h, w, 11, chunk, by_sigmoid)
            ref_v, ref_i = dense.topk(11)
            assert torch.equal(idx, ref_i)
            assert torch.allclose(lg, ref_v, atol=1e-5)


def test_streaming_topk_never_picks_padding_rows():
    """The last pass multiplies the padding rows too (aligned GEMM width) and must drop them:
    padding scored far above every concept would otherwise fill the top-k."""
    g = torch.Generator().manual_seed(2)
    h, w = torch.randn(37, 24, generator=g) * 0.5, torch.randn(203, 24, generator=g) * 0.5
    padded = torch.cat([w, 50 * h[:1].repeat(13, 1)])          # 13 padding rows aligned with h[0]
    dense = (h @ w.t()).clamp(-15, 15)
    for chunk in (7, 64, 200, 1000):
        for by_sigmoid in (False, True):
            idx, lg = streaming_topk(h, padded, 11, chunk, by_sigmoid, n_valid=203)
            assert int(idx.max()) < 203
            ref_v, ref_i = dense.topk(11)
            assert torch.equal(idx, ref_i)
            assert torch.allclose(lg, ref_v, atol=1e-5)


def test_counter_uniform_streams_and_steps_do_not_collide():
    step = torch.arange(64)
    pos = torch.zeros(64, dtype=torch.long)
    seed = torch.full((64,), 5)
    draws = {s: counter_uniform(seed, pos, step, stream=s) for s in range(8)}
    flat = torch.cat(list(draws.values()))
    assert flat.unique().numel() == flat.numel()


def test_most_confident_breaks_ties_by_position(seed):
    """Saturated confidences tie exactly; the reference and the batched engine must commit the
    same position, so ties go to the lower index (topk leaves them unordered)."""
    g = torch.Generator().manual_seed(seed)
    conf = torch.rand(4, 64, generator=g, dtype=torch.float64)
    tied = torch.randperm(64, generator=g)[:9]
    conf[:, tied] = 1.0
    values, idx = most_confident(conf, 5)
    assert torch.equal(values, torch.ones(4, 5, dtype=torch.float64)), seed
    assert idx.tolist() == [sorted(tied.tolist())[:5]] * 4, seed
    order = most_confident(conf[0], 64)[1].tolist()
    assert sorted(order) == list(range(64)) and order[:9] == sorted(tied.tolist()), seed
