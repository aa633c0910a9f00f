"""The bundled tiny checkpoint: what the local stack and the demos run."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import torch

from cde.steerling import attribution as attr
from cde.steerling.catalog import ConceptCatalog
from cde.steerling.config import TINY, SteerlingConfig
from cde.steerling.loading import load_model
from cde.steerling.make_tiny import make_tiny
from cde.steerling.reference_decoder import generate
from cde.steerling.steering import SteeringSpec, prepare
from cde.steerling.tokenizer import load_tokenizer
from tests.options import decode_options

TINY_DIR = Path(__file__).resolve().parents[1] / "models" / "steerling-tiny"


def test_committed_checkpoint_is_what_make_tiny_writes(tmp_path):
    make_tiny(tmp_path)
    for name in ("config.json", "model.safetensors"):
        assert (tmp_path / name).read_bytes() == (TINY_DIR / name).read_bytes(), name
    assert SteerlingConfig.load(TINY_DIR) == TINY


def test_chat_generation_with_steering_and_attribution_end_to_end():
    cfg = SteerlingConfig.load(TINY_DIR)
    model = load_model(TINY_DIR)
    tok = load_tokenizer(cfg.tokenizer, TINY_DIR)
    catalog = ConceptCatalog.load(TINY_DIR, cfg.n_known, cfg.n_discovered)
    ocean = catalog.by_name("ocean")
    assert ocean is not None and catalog.search("oce")[0] == ocean
    prompt = tok.apply_chat_template([{"role": "user", "content": "Tell me about <|mask|> the sea."}])
    assert cfg.mask_id not in prompt
    spec = SteeringSpec.amplify([ocean.concept_id], inject_layer=2)
    steering = prepare(spec, model.known_head.embeddings(torch.tensor(spec.concept_ids)),
                       model.transformer.lm_head.weight, cfg.n_layers)
    res = generate(model, prompt, decode_options(96, seed=4), steering, tokenizer_vocab_size=tok.vocab_size)
    text = tok.decode(res.output_tokens)
    assert isinstance(text, str)
    ta = attr.token_attribution(res.records, *attr.model_lookups(model))
    total = ta.known_contrib.sum(-1) + ta.disc_contrib.sum(-1) + ta.residual
    assert torch.allclose(total, ta.target_logits, atol=1e-4)
    generated = [t for b in res.blocks for t in b.tokens]
    spans = attr.chunk_spans(generated, cfg.endofchunk_id, sorted(tok.stop_ids))
    assert spans
    order = {int(p): i for i, p in enumerate(res.records.positions)}
    first = res.blocks[0].start
    s, e = spans[0]
    rows = [order[first + p] for p in range(s, e) if first + p in order]
    scores, _ = attr.chunk_scores(ta, rows, e - s, cfg.n_known, top=5)
    assert len(scores) == 5 and all(catalog.label(x.concept_id) for x in scores)


def test_catalog_reads_concept_labels_parquet(tmp_path):
    pd.DataFrame({
        "concept_id": [0, 1, 2, 48],
        "concept_name": ["Ocean", "Music", "Joy", "blue-ish things"],
        "concept_description": ["the sea", "songs", "happiness", "discovered"],
        "head": ["known", "known", "known", "unknown"],
        "public_group_id": [10, 10, 11, None],
        "group_name": ["nature", "nature", "feelings", None],
        "is_steerable": [True, True, False, False],
        "is_tone": [False] * 4, "is_alignment": [False] * 4, "is_demographic": [False] * 4,
    }).to_parquet(tmp_path / "concept_labels.parquet")
    cat = ConceptCatalog.load(tmp_path, n_known=48, n_discovered=96)
    assert cat.label(0) == "Known: Ocean" and cat.label(48) == "Discovered: blue-ish things"
    assert cat.label(7) == "Known: #7" and cat.label(60) == "Discovered: #60"
    assert cat.group_neighbours(0) == [1]
    assert not cat.get(2).steerable
    assert [c.concept_id for c in cat.search("ocean")] == [0]
    assert [c.concept_id for c in cat.search("songs")] == [1]          # description match
    assert [c.concept_id for c in cat.search("blue", known_only=True)] == []
