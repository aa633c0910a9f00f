"""Parity with Guide Labs' public `steerling` package (the oracle), on fresh random weights.

Each test builds the oracle's own model class from one of several tiny configs, gives it
random weights, loads the very same weights into ours, and compares outputs.
"""

from __future__ import annotations

import os
import random
from types import SimpleNamespace

import pytest
import torch

from cde.checkpoint import CheckpointError, save_checkpoint
from cde.steerling import attribution as attr
from cde.steerling import steering as st
from cde.steerling.config import STEERLING_8B, TINY
from cde.steerling.loading import load_model
from cde.steerling.model import KnownIntervention, SteeringInputs, SteerlingModel
from cde.steerling.reference_decoder import generate
from cde.steerling.sampling import SamplingParams, banned_ids, sampling_distribution
from cde.steerling.tokenizer import ByteTokenizer
from tests.numerics import rel_err
from tests.options import decode_options
from tests.oracle import assert_same_topk, build_oracle, oracle_configs
from tests.seeding import draw_seed

pytestmark = pytest.mark.parity
os.environ.setdefault("HF_HUB_OFFLINE", "1")

CONFIGS = {
    # GQA 4 query / 2 KV heads, concept scoring streamed in chunks smaller than the head
    "tiny-gqa": TINY,
    # multi-head attention, k larger than the discovered head (k clipped to C)
    "mha-wide-k": TINY.replace(n_layers=2, n_embd=64, n_head=4, n_kv_heads=4, n_known=40, n_discovered=100,
                               topk_known=32, topk_discovered=128, concept_chunk=4096),
    # multi-query attention, padded concept counts, very small chunks
    "mqa-padded": TINY.replace(n_layers=3, n_embd=96, n_head=6, n_kv_heads=1, n_known=70, n_discovered=50,
                               topk_known=5, topk_discovered=7, concept_chunk=16),
}
TOKENIZER_VOCAB = 264  # the byte tokenizer's ids; the rest of the 320 rows are padding


def pair(cfg, seed):
    oracle = build_oracle(cfg, seed)
    ours = SteerlingModel(cfg).eval()
    ours.load_state_dict(oracle.state_dict(), strict=True)
    return oracle, ours


def oracle_generator(oracle, cfg):
    from steerling.inference.causal_diffusion import SteerlingGenerator

    byte_tok = ByteTokenizer()
    tok = SimpleNamespace(mask_token_id=cfg.mask_id, eos_token_id=cfg.eos_id, pad_token_id=cfg.pad_id,
                          eot_id=cfg.eot_id, endofchunk_token_id=cfg.endofchunk_id,
                          encode=lambda text, add_special_tokens=False: byte_tok.encode(text),
                          decode=lambda ids, **_: byte_tok.decode(ids))
    model_cfg, _ = oracle_configs(cfg)
    gen = SteerlingGenerator(oracle, tok, model_cfg, is_interpretable=True, device="cpu")
    # Same banned set as ours: mask, pad, bos and the padding rows no tokenizer id maps to.
    gen._banned_ids = banned_ids(cfg, TOKENIZER_VOCAB)
    return gen


# ---------------------------------------------------------------------------------------
# Forward pass


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_forward_logits_and_concepts_match(name):
    cfg = CONFIGS[name]
    for _ in range(2):
        seed = draw_seed()
        oracle, ours = pair(cfg, seed)
        g = torch.Generator().manual_seed(seed)
        tokens = torch.randint(0, TOKENIZER_VOCAB, (2, 150), generator=g)
        tokens[:, 100:] = cfg.mask_id
        with torch.no_grad():
            ref_logits, ref = oracle(tokens, minimal_output=True)
            out = ours(tokens)
        n = tokens.numel()
        assert rel_err(out.logits, ref_logits.reshape(n, -1)) <= 1e-5, f"seed {seed}"
        # same concepts with the same logits; fp32 rounds differently in the last bit, so
        # concepts whose logits tie within 1e-5 may swap (seen once in ~50 runs)
        assert_same_topk(out.known_idx, out.known_logits, ref.known_topk_indices.reshape(n, -1),
                         ref.known_topk_logits.reshape(n, -1))
        assert_same_topk(out.disc_idx, out.disc_logits, ref.unknown_topk_indices.reshape(n, -1),
                         ref.unknown_topk_logits.reshape(n, -1))


@pytest.mark.parametrize("name", ["tiny-gqa", "mqa-padded"])
def test_forward_with_steering_injection_matches(name, seed):
    cfg = CONFIGS[name]
    oracle, ours = pair(cfg, seed)
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, TOKENIZER_VOCAB, (1, 130), generator=g)
    tokens[0, 70:128] = cfg.mask_id
    direction = st.steering_direction(ours.known_head.embeddings(torch.tensor([1, 4, 9])))
    alpha, layer = 3.7, 2
    inj = (tokens == cfg.mask_id).float()[..., None] * direction
    with torch.no_grad():
        ref_logits, _ = oracle(tokens, minimal_output=True, position_injection=inj,
                               steering_inject_layer=layer, steering_inject_alpha=alpha)
        plain, _ = oracle(tokens, minimal_output=True)
        out = ours(tokens, steering=SteeringInputs(direction[None], torch.tensor([alpha]),
                                                   (tokens == cfg.mask_id).float(), torch.tensor([layer])))
    ref_logits = ref_logits.reshape(out.logits.shape)
    assert rel_err(out.logits, ref_logits) <= 1e-5
    assert rel_err(plain.reshape(out.logits.shape), ref_logits) > 1e-3  # the injection really acts


@pytest.mark.parametrize("name", ["tiny-gqa", "mha-wide-k"])
def test_forward_with_known_intervention_matches(name, seed):
    cfg = CONFIGS[name]
    oracle, ours = pair(cfg, seed)
    tokens = torch.randint(0, TOKENIZER_VOCAB, (2, 90), generator=torch.Generator().manual_seed(seed))
    known = {3: 0.95, 11: 0.0, 27: 0.5}
    with torch.no_grad():
        ref_logits, _ = oracle.intervene(tokens, known=known)
        ids = torch.tensor([list(known)] * 2)
        vals = torch.tensor([list(known.values())] * 2)
        out = ours(tokens, intervention=KnownIntervention(ids, vals))
        plain = ours(tokens)
    ref_logits = ref_logits.reshape(out.logits.shape)
    assert rel_err(out.logits, ref_logits) <= 1e-5
    assert rel_err(plain.logits, ref_logits) > 1e-4


def test_8b_preset_parameter_count():
    with torch.device("meta"):
        model = SteerlingModel(STEERLING_8B)
    assert model.num_parameters() == 8_392_069_120
    assert STEERLING_8B.vocab_size == 100_352
    assert model.known_head.concept_predictor.weight.shape == (33_744, 4096)
    assert model.unknown_head.predictor_up.weight.shape == (101_200, 256)


# ---------------------------------------------------------------------------------------
# Checkpoints


def test_sharded_checkpoint_from_oracle_state_dict_loads(tmp_path, seed):
    cfg = CONFIGS["tiny-gqa"]
    oracle, _ = pair(cfg, seed)
    cfg.save(tmp_path)
    files = save_checkpoint(oracle.state_dict(), tmp_path, max_shard_bytes=200_000)
    assert len(files) >= 4 and files[-1].name == "model.safetensors.index.json"
    ours = load_model(tmp_path)
    tokens = torch.randint(0, TOKENIZER_VOCAB, (1, 100))
    with torch.no_grad():
        ref_logits, _ = oracle(tokens, minimal_output=True)
        out = ours(tokens)
    assert rel_err(out.logits, ref_logits.reshape(out.logits.shape)) <= 1e-5
    assert ours.transformer.lm_head.weight is ours.transformer.tok_emb.weight


def test_mismatched_or_corrupt_checkpoint_names_the_tensor(tmp_path, seed):
    cfg = CONFIGS["tiny-gqa"]
    oracle, _ = pair(cfg, seed)
    state = dict(oracle.state_dict())
    name = "transformer.blocks.1.attn.c_attn.weight"
    state[name] = state[name][:, :-1].contiguous()
    cfg.save(tmp_path / "bad")
    save_checkpoint(state, tmp_path / "bad")
    with pytest.raises(CheckpointError, match=r"blocks\.1\.attn\.c_attn\.weight.*\(256, 128\).*\(256, 127\)"):
        load_model(tmp_path / "bad")

    state = dict(oracle.state_dict())
    del state["known_head.concept_embedding.weight"]
    cfg.save(tmp_path / "missing")
    save_checkpoint(state, tmp_path / "missing")
    with pytest.raises(CheckpointError, match="known_head.concept_embedding.weight"):
        load_model(tmp_path / "missing")

    cfg.save(tmp_path / "trunc")
    (path,) = save_checkpoint(oracle.state_dict(), tmp_path / "trunc")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_model(tmp_path / "trunc")


# ---------------------------------------------------------------------------------------
# Steering functions


def test_steering_functions_match_oracle(seed):
    from steerling.configs.steering import SteeringConfig
    from steerling.inference.causal_diffusion import SteerlingGenerator

    cfg = CONFIGS["tiny-gqa"]
    oracle, ours = pair(cfg, seed)
    gen = oracle_generator(oracle, cfg)
    lm = ours.transformer.lm_head.weight
    cases = [
        (SteeringConfig.injection([2, 7], mai_lm_target=8.0, inject_layer=2, cutoff_tokens=20),
         st.SteeringSpec.amplify([2, 7], 8.0, 2, 20)),
        (SteeringConfig.injection(5), st.SteeringSpec.amplify(5)),
        (SteeringConfig.injection_relu(9, group_concept_ids=[8, 10, 9], mai_lm_target=-6.0),
         st.SteeringSpec.suppress(9, [8, 10, 9], -6.0)),
    ]
    for ref_cfg, spec in cases:
        ref_dir, ref_alpha, ref_layer = gen._prepare_steering(ref_cfg)
        prepared = st.prepare(spec, ours.known_head.embeddings(torch.tensor(spec.concept_ids)), lm, cfg.n_layers)
        assert torch.allclose(prepared.direction, ref_dir, rtol=0, atol=1e-7)
        assert prepared.base_alpha == pytest.approx(ref_alpha, rel=1e-6)
        assert prepared.inject_layer == ref_layer
        assert prepared.schedule == ref_cfg.inject_alpha_schedule
        if ref_cfg.relu_logit_mask:
            assert torch.allclose(prepared.relu_mask, gen._build_relu_mask(ref_cfg.relu_logit_mask), atol=1e-6)
        else:
            assert prepared.relu_mask is None
    tokens = torch.randint(0, TOKENIZER_VOCAB, (2, 70))
    tokens[:, 40:] = cfg.mask_id
    tokens[1, 50] = 5
    direction = prepared.direction
    ref_inj = gen._position_injection(tokens, direction)
    assert torch.equal(st.position_gate(tokens, cfg.mask_id)[..., None] * direction, ref_inj)
    for schedule in ("fixed", "hard_cutoff"):
        for max_new in (64, 128):
            for remaining in range(0, max_new + 1, 7):
                for cutoff in (1, 20, 32, 100):
                    ref = SteerlingGenerator._resolve_alpha(schedule, 2.5, remaining, max_new, cutoff)
                    assert st.resolve_alpha(schedule, 2.5, max_new - remaining, cutoff) == ref


# ---------------------------------------------------------------------------------------
# Generation


def greedy() -> SamplingParams:
    return SamplingParams(use_entropy_sampling=False, temperature=0.0)


@pytest.mark.parametrize("steer", ["none", "amplify", "suppress"])
def test_greedy_generation_matches_generate_full(steer, seed):
    from steerling.configs.generation import GenerationConfig
    from steerling.configs.steering import SteeringConfig

    cfg = CONFIGS["tiny-gqa"]
    oracle, ours = pair(cfg, seed)
    gen = oracle_generator(oracle, cfg)
    prompt = torch.randint(0, 256, (1, 64), generator=torch.Generator().manual_seed(seed))
    ref_steer, prepared = None, None
    if steer == "amplify":
        ref_steer = SteeringConfig.injection([3, 6], mai_lm_target=12.0, inject_layer=2, cutoff_tokens=40)
        spec = st.SteeringSpec.amplify([3, 6], 12.0, 2, 40)
    elif steer == "suppress":
        ref_steer = SteeringConfig.injection_relu(4, group_concept_ids=[5, 6], mai_lm_target=-9.0)
        spec = st.SteeringSpec.suppress(4, [5, 6], -9.0)
    if ref_steer is not None:
        prepared = st.prepare(spec, ours.known_head.embeddings(torch.tensor(spec.concept_ids)),
                              ours.transformer.lm_head.weight, cfg.n_layers)
    ref = gen.generate_full(prompt, GenerationConfig(max_new_tokens=128, steps=128, use_entropy_sampling=False,
                                                     temperature=0.0), steering=ref_steer)
    res = generate(ours, prompt[0].tolist(), decode_options(128, sampling=greedy()), prepared,
                   tokenizer_vocab_size=TOKENIZER_VOCAB)
    assert res.sequence == ref.tokens.tolist(), f"seed {seed}"
    if steer != "none":
        unsteered = generate(ours, prompt[0].tolist(), decode_options(128, sampling=greedy()),
                             tokenizer_vocab_size=TOKENIZER_VOCAB)
        assert unsteered.sequence != res.sequence  # steering changed the text


def test_greedy_generation_k_tokens_per_step_matches(seed):
    from steerling.configs.generation import GenerationConfig

    cfg = CONFIGS["mqa-padded"]
    oracle, ours = pair(cfg, seed)
    gen = oracle_generator(oracle, cfg)
    prompt = torch.randint(0, 256, (1, 128), generator=torch.Generator().manual_seed(seed))
    ref = gen.generate_full(prompt, GenerationConfig(max_new_tokens=128, steps=32, use_entropy_sampling=False,
                                                     temperature=0.0))
    res = generate(ours, prompt[0].tolist(), decode_options(128, sampling=greedy(), tokens_per_step=4),
                   tokenizer_vocab_size=TOKENIZER_VOCAB)
    assert res.sequence == ref.tokens.tolist(), f"seed {seed}"
    assert all(len(s.positions) == 4 for s in res.steps[:-1])
    assert len(res.steps) == 32 or res.finish_reason == "stop"   # an early <|eot_id|> ends it sooner


@pytest.mark.parametrize("mode", ["entropy", "temperature"])
def test_sampling_distribution_matches_oracle_at_every_position(mode, monkeypatch, seed):
    """Replay the oracle's seeded run: at each step our confidence picks the same position and
    the probability vector we would draw from equals the one the oracle drew from."""
    import steerling.inference.causal_diffusion as ref_mod
    from steerling.configs.generation import GenerationConfig

    cfg = CONFIGS["tiny-gqa"]
    oracle, ours = pair(cfg, seed)
    gen = oracle_generator(oracle, cfg)
    prompt = torch.randint(0, 256, (1, 64), generator=torch.Generator().manual_seed(seed))
    entropy = mode == "entropy"
    ref_cfg = GenerationConfig(max_new_tokens=64, steps=64, seed=seed, use_entropy_sampling=entropy,
                               temperature=0.9, top_p=0.8)
    draws: list[tuple[torch.Tensor, int]] = []   # (vocab-order distribution, token) per draw

    real_top_p = ref_mod._sample_top_p

    def spy_top_p(probs, top_p, generator=None):
        captured = {}
        real_multinomial = torch.multinomial

        def spy_multinomial(p, n, generator=None):
            captured["filtered"] = p.clone()
            return real_multinomial(p, n, generator=generator)

        monkeypatch.setattr(torch, "multinomial", spy_multinomial)
        try:
            token = real_top_p(probs, top_p, generator)
        finally:
            monkeypatch.setattr(torch, "multinomial", real_multinomial)
        _, sorted_idx = torch.sort(probs, descending=True)
        dist = torch.zeros_like(probs)
        dist[sorted_idx] = captured["filtered"]
        draws.append((dist, int(token)))
        return token

    monkeypatch.setattr(ref_mod, "_sample_top_p", spy_top_p)
    ref = gen.generate_full(prompt, ref_cfg)
    assert 0 < len(draws) <= 64   # fewer when <|eot_id|> is drawn

    params = SamplingParams(use_entropy_sampling=entropy, temperature=0.9, top_p=0.8)
    step = {"i": 0}

    def replay(positions, adjusted, _u):
        filtered, ids = sampling_distribution(adjusted, [params] * len(positions))
        ours_dist = torch.zeros_like(filtered).scatter_(1, ids, filtered)[0]
        ref_dist, token = draws[step["i"]]
        assert torch.allclose(ours_dist, ref_dist, atol=2e-6, rtol=0), f"step {step['i']} seed {seed}"
        step["i"] += 1
        return torch.tensor([token])

    res = generate(ours, prompt[0].tolist(), decode_options(64, sampling=params, seed=seed), choose=replay,
                   tokenizer_vocab_size=TOKENIZER_VOCAB)
    assert step["i"] == len(draws)
    assert res.sequence == ref.tokens.tolist()  # same positions chosen by confidence every step


# ---------------------------------------------------------------------------------------
# Attribution


def test_attribution_matches_faithful_concept_attributor(monkeypatch, seed):
    from steerling.attribution.concept_attribution import ConceptLabels, FaithfulConceptAttributor, chunk_attribution
    from steerling.configs.generation import GenerationConfig

    monkeypatch.setenv("STEERLING_CONCEPTS_PATH", "/nonexistent/concept_labels.parquet")
    cfg = CONFIGS["tiny-gqa"]
    oracle, ours = pair(cfg, seed)
    gen = oracle_generator(oracle, cfg)
    rng = random.Random(seed)
    prompt_text = "".join(rng.choice("abcdefgh ") for _ in range(64))
    attributor = FaithfulConceptAttributor(gen)
    ref_out, _ = attributor.attribute(prompt_text, GenerationConfig(
        max_new_tokens=128, steps=128, use_entropy_sampling=False, temperature=0.0))
    ref = attributor.last_attribution

    res = generate(ours, ByteTokenizer().encode(prompt_text), decode_options(128, sampling=greedy()),
                   tokenizer_vocab_size=TOKENIZER_VOCAB)
    assert res.sequence == ref_out.tokens.tolist()
    records = res.records
    ta = attr.token_attribution(records, *attr.model_lookups(ours))
    pos = records.positions
    assert torch.equal(ta.known_idx, ref.known_indices[0, pos])
    assert torch.equal(ta.disc_idx, ref.unk_indices[0, pos])
    assert torch.allclose(ta.target_logits, ref.target_logits[0, pos], atol=1e-5)
    assert torch.allclose(ta.known_contrib, ref.known_contributions[0, pos], atol=1e-5)
    assert torch.allclose(ta.disc_contrib, ref.unk_contributions[0, pos], atol=1e-5)
    assert torch.allclose(ta.residual, ref.epsilon_contribution[0, pos], atol=1e-4)
    total = ta.known_contrib.sum(-1) + ta.disc_contrib.sum(-1) + ta.residual
    assert (total - ta.target_logits).abs().max() <= 1e-4

    # chunk scores over a chunk of the generated region equal chunk_attribution's
    order = {int(p): i for i, p in enumerate(pos)}
    start, end = res.prompt_len + 10, res.prompt_len + 75
    rows = [order[p] for p in range(start, end) if p in order]
    scores, eps_pct = attr.chunk_scores(ta, rows, end - start, cfg.n_known)
    ref_entries, ref_eps = chunk_attribution(ref, start, end, concept_labels=ConceptLabels(
        "/nonexistent/concept_labels.parquet"), num_known_concepts=cfg.n_known)
    assert len(scores) == len(ref_entries)
    for ours_s, ref_e in zip(scores, ref_entries):
        prefix = "Known" if ours_s.head == "known" else "Discovered"
        assert ref_e["label"] == f"{prefix}: #{ours_s.concept_id}"
        assert ours_s.score == pytest.approx(ref_e["contribution"], abs=1e-6)
    assert eps_pct == pytest.approx(ref_eps, abs=1e-4)
