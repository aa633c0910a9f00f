"""What the Steerling engine's parity tests share: tiny float64 models, steering specs, and the
event-by-event comparison of an engine run with the reference decoder."""

from __future__ import annotations

import dataclasses

import torch

from cde.steerling.config import TINY
from cde.steerling.model import SteerlingModel
from cde.steerling.reference_decoder import generate
from cde.steerling.steering import SteeringSpec, prepare
from tests.oracle import assert_same_topk
from worker_svc.engine.steerling_engine import BlockEvent, FinishEvent, StepEvent

VOCAB = 264


def make_model(seed: int, cfg=TINY, dtype=torch.float64) -> SteerlingModel:
    return SteerlingModel(cfg).init_random(seed, std=0.05).to(dtype).eval()


def steer(model, ids, mode="amplify"):
    spec = SteeringSpec.amplify(ids, 10.0, 2, 24) if mode == "amplify" else SteeringSpec.suppress(ids[0], ids[1:], -8.0)
    return prepare(spec, model.known_head.embeddings(torch.tensor(spec.concept_ids)),
                   model.transformer.lm_head.weight, model.cfg.n_layers)


def by_position(rec):
    """A block's records sorted by position (unique within a block)."""
    order = torch.argsort(rec.positions)
    return dataclasses.replace(rec, **{f.name: getattr(rec, f.name)[order] for f in dataclasses.fields(rec)})


def check_against_reference(model, engine, submitted):
    """Every request's events must equal what the reference decoder produces alone."""
    for rid, (prompt, opts, st, handle) in submitted.items():
        events = list(engine.drain(handle))
        finish = [e for e in events if isinstance(e, FinishEvent)]
        assert len(finish) == 1, rid
        ref = generate(model, prompt, opts, st, tokenizer_vocab_size=VOCAB)
        assert finish[0].output_tokens == ref.output_tokens, rid
        assert finish[0].reason == ref.finish_reason, rid
        assert handle.seq == ref.sequence, rid
        steps = [e for e in events if isinstance(e, StepEvent)]
        # a step's positions in commit order, except that positions of exactly equal confidence
        # (e.g. two saturated at 1.0) may come in either order: compared as (position, token) sets
        assert [(s.step, sorted(zip(s.positions, s.tokens))) for s in steps] == \
            [(s.step, sorted(zip(s.positions, s.tokens))) for s in ref.steps], rid
        blocks = [e for e in events if isinstance(e, BlockEvent)]
        assert [(b.block, b.start, b.end, b.tokens) for b in blocks] == \
            [(b.block, b.start, b.end, b.tokens) for b in ref.blocks], rid
        for ours, theirs in zip(blocks, ref.blocks):
            a, b = by_position(ours.records), by_position(theirs.records)
            assert torch.equal(a.positions, b.positions) and torch.equal(a.tokens, b.tokens)
            assert torch.allclose(a.target_logits, b.target_logits, atol=1e-5)
            assert_same_topk(a.known_idx, a.known_logits, b.known_idx, b.known_logits)
            assert_same_topk(a.disc_idx, a.disc_logits, b.disc_idx, b.disc_logits)
