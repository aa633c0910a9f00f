"""The bundled trained steerling-small on the CPU: readable generations and its concept detection.

The detection figure is recomputed here on held-out stories (story seeds the trainer never
generates, labelled by train.labeler) and must reproduce the value measured when this bundle was
committed, within a stated tolerance; the H200 evaluation over held-out stories + prose is in
bench/results/eval-steerling-small-h200-*.json.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
BUNDLE = ROOT / "models" / "steerling-small"
# Measured on this slice (48 stories of seed 900007, 64-token chunks) with the committed bundle.
DETECTION_AUROC = 0.971
DETECTION_TOLERANCE = 0.02
N_STORIES = 48

pytestmark = pytest.mark.skipif(not (BUNDLE / "config.json").exists(), reason="models/steerling-small is not bundled")


@pytest.fixture(scope="module")
def model():
    from cde.steerling.loading import load_model

    return load_model(BUNDLE)


@pytest.fixture(scope="module")
def tokenizer(model):
    from cde.steerling.tokenizer import load_model_tokenizer

    return load_model_tokenizer(model.cfg, BUNDLE)


def test_bundle_fits_its_budget():
    size = sum(p.stat().st_size for p in BUNDLE.iterdir() if p.name.startswith("model"))
    assert size <= 28e6, f"steerling-small weights are {size / 1e6:.1f} MB (budget 28 MB)"


@pytest.mark.parametrize("seed", [3, 11])
def test_fixed_seed_generation_is_readable(model, tokenizer, seed):
    from cde.steerling.reference_decoder import generate
    from tests.options import decode_options

    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Tell me a story about a fox."}],
                                           add_generation_prompt=True)
    out = generate(model, prompt, decode_options(max_new_tokens=96, seed=seed, stop_ids=(model.cfg.eot_id,)))
    ids = out.output_tokens
    text = tokenizer.decode(ids)
    assert len(ids) >= 32, f"seed {seed}: only {len(ids)} tokens: {text!r}"
    assert model.cfg.mask_id not in ids, f"seed {seed}: a mask id in the output"
    distinct = len(set(ids)) / len(ids)
    assert distinct >= 0.35, f"seed {seed}: distinct-token ratio {distinct:.2f}: {text!r}"
    words = text.split()
    assert sum(w.strip('.,!?"').isalpha() for w in words) >= 0.8 * len(words), f"seed {seed}: {text!r}"


def _heldout_chunks(n_known: int) -> tuple[np.ndarray, np.ndarray]:
    from train import build_data
    from train.concepts import Lexicon
    from train.labeler import CHUNK, NO_LABEL, Labeler
    from train.steerling_data import HELDOUT_STORY_SEED
    from train.stories import generate_story
    from train.tokenizer_build import SPECIAL_IDS

    lab = Labeler(Lexicon.load(build_data.LEXICON), build_data.TOKENIZER)
    pieces = lab.label_texts([generate_story(HELDOUT_STORY_SEED + 7, i).text for i in range(N_STORIES)])
    eos = SPECIAL_IDS["<|endoftext|>"]
    ids = np.concatenate([np.append(p.ids, eos) for p in pieces])
    labels = np.concatenate([np.vstack([p.labels, np.full((1, p.labels.shape[1]), NO_LABEL, np.uint16)])
                             for p in pieces])
    valence = np.concatenate([np.append(p.valence, 0.0) for p in pieces])
    n = (len(ids) // 512) * 512
    chunk = lab.chunk_labels(labels[:n], valence[:n]).astype(np.int64)           # (n / 64, K)
    targets = np.zeros((len(chunk), n_known), np.int64)
    for row, cs in enumerate(chunk):
        for c in cs[cs != NO_LABEL]:
            targets[row, c] = 1
    assert n // CHUNK == len(targets)
    return ids[:n].reshape(-1, 512).astype(np.int64), targets


def test_concept_detection_reproduces_the_committed_figure(model):
    from train.eval_steerling import auroc, chunk_concept_scores

    tokens, targets = _heldout_chunks(model.cfg.n_known)
    scores = chunk_concept_scores(model, torch.from_numpy(tokens)).reshape(-1, model.cfg.n_known).numpy()
    per = [auroc(scores[:, c], targets[:, c]) for c in range(targets.shape[1])]
    valid = [a for a in per if a is not None]
    macro = float(np.mean(valid))
    assert len(valid) >= 100, f"only {len(valid)} concepts have both classes on the slice"
    assert abs(macro - DETECTION_AUROC) <= DETECTION_TOLERANCE, \
        f"macro AUROC {macro:.4f} on the held-out slice; committed {DETECTION_AUROC} +- {DETECTION_TOLERANCE}"


# Floors for the human-readable concepts' weight (the v2 bundle measures ~0.73 and 1.0 on the
# H200 evaluation; v1 measured 0.001 and 0.0): attributions must name known concepts.
KNOWN_SHARE_FLOOR = 0.3
KNOWN_IN_TOP8_FLOOR = 0.8


def test_known_concepts_carry_the_logit_of_generated_tokens(model, tokenizer):
    """Fixed-seed generations through the serving engine: the known head's share of the absolute
    logit mass of the committed tokens, and how many tokens list a known concept in their top 8."""
    from cde.steerling.sampling import SamplingParams
    from tests.options import decode_options
    from train.eval_steerling import logit_mass, run_engine

    prompts = ["Tell me a story about a fox.", "Write a story with a puffin in it.",
               "What happened at the harbor?", "Describe a quiet village."]
    reqs = [(f"d{i}", tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True),
             decode_options(64, sampling=SamplingParams(), seed=5 + i, stop_ids=()), None)
            for i, p in enumerate(prompts)]
    res = run_engine(model, reqs, tokenizer.vocab_size, max_slots=4)
    mass = logit_mass(model, res)
    assert mass["tokens"] >= 128, mass
    assert mass["known_logit_share"] >= KNOWN_SHARE_FLOOR, mass
    assert mass["known_in_top8_frac"] >= KNOWN_IN_TOP8_FLOOR, mass
