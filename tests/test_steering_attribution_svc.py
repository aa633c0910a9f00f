"""steering_svc and attribution_svc as real grpc.aio servers over the bundled tiny model.

The oracle is the in-process math (`cde.steerling.steering.prepare`,
`cde.steerling.attribution.token_attribution` / `chunk_spans` / `chunk_scores`) over the model
as `load_model` builds it; the records come from the reference decoder, steered by what the
steering service built, with end-of-chunk and stop tokens forced in so chunks span blocks.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
from contextlib import asynccontextmanager
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from attribution_svc import service as attribution_service
from attribution_svc.compute import TENSOR_NAMES, AttributionTables, StreamState, attribute_block
from cde.rpc import bytes_to_floats, channel_options, floats_to_bytes
from cde.rpc.v1 import attribution_pb2, attribution_pb2_grpc, common_pb2, steering_pb2, steering_pb2_grpc
from cde.steerling import attribution as attr
from cde.steerling.catalog import ConceptCatalog
from cde.steerling.config import SteerlingConfig
from cde.steerling.loading import load_model
from cde.steerling.reference_decoder import generate
from cde.steerling.steering import PreparedSteering, SteeringSpec, prepare, steering_direction
from steering_svc import service as steering_service
from gateway.resolve import resolved_steering
from steering_svc.backend import SteeringBackend
from tests.options import decode_options

MODEL_DIR = Path(__file__).resolve().parents[1] / "models" / "steerling-tiny"
N_LAYERS = SteerlingConfig.load(MODEL_DIR).n_layers
TIMEOUT = 10


@pytest.fixture(scope="module")
def model():
    return load_model(MODEL_DIR)


@pytest.fixture(scope="module")
def catalog(model):
    return ConceptCatalog.load(MODEL_DIR, model.cfg.n_known, model.cfg.n_discovered)


@asynccontextmanager
async def services():
    steer = await steering_service.build_server(MODEL_DIR, "127.0.0.1", 0)
    attrib = await attribution_service.build_server(MODEL_DIR, "127.0.0.1", 0)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{steer.port}", options=channel_options()) as sc, \
                grpc.aio.insecure_channel(f"127.0.0.1:{attrib.port}", options=channel_options()) as ac:
            yield steer, sc, ac
    finally:
        await steer.stop(None)
        await attrib.stop(None)


def run(coro_fn):
    return asyncio.run(coro_fn())


async def health_of(channel, service: str) -> int:
    got = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                          timeout=TIMEOUT)
    return got.status


def concept(ref, strength: float = 0.0) -> common_pb2.SteeringConcept:
    if isinstance(ref, int):
        return common_pb2.SteeringConcept(concept_id=ref, strength=strength)
    return common_pb2.SteeringConcept(name=ref, strength=strength)


def build_request(request: common_pb2.SteeringRequest) -> steering_pb2.BuildSteeringRequest:
    """As the gateway sends it: every steering default filled in (gateway.resolve)."""
    return steering_pb2.BuildSteeringRequest(steering=resolved_steering(request, N_LAYERS))


def to_prepared(msg: common_pb2.PreparedSteering) -> PreparedSteering:
    schedule = {common_pb2.STEERING_SCHEDULE_FIXED: "fixed", common_pb2.STEERING_SCHEDULE_HARD_CUTOFF: "hard_cutoff"}
    mask = torch.from_numpy(bytes_to_floats(msg.relu_mask_f32)) if msg.relu_mask_f32 else None
    return PreparedSteering(torch.from_numpy(bytes_to_floats(msg.direction_f32)), msg.base_alpha, msg.inject_layer,
                            schedule[msg.schedule], msg.cutoff_tokens, mask)


# ---- units --------------------------------------------------------------------------------

def test_unit_weights_leave_the_unweighted_direction_bit_identical():
    emb = torch.randn(5, 64, generator=torch.Generator().manual_seed(0))
    plain = steering_direction(emb)
    assert torch.equal(plain, steering_direction(emb, torch.ones(5)))
    w = torch.tensor([2.0, 1.0, 0.5, 1.0, 3.0])
    manual = (emb * w[:, None]).sum(0)
    assert torch.allclose(steering_direction(emb, w), manual / manual.norm(), atol=1e-7)


def test_unit_services_hold_only_the_head_tensors(model):
    tables = AttributionTables.open(MODEL_DIR)
    assert set(tables.tensors) == set(TENSOR_NAMES)
    assert not any(".blocks." in n or "predictor" in n for n in tables.tensors)
    held = [v for v in vars(tables).values() if isinstance(v, torch.Tensor)]
    assert held == []  # every tensor it has is in .tensors
    known, disc, lm = attr.model_lookups(model)
    ids = torch.arange(model.cfg.n_known).reshape(6, 8)
    assert torch.equal(tables.known_embed(ids), known(ids))
    dids = torch.arange(model.cfg.n_discovered).reshape(6, 16)
    assert torch.equal(tables.disc_embed(dids), disc(dids))
    toks = torch.arange(model.cfg.vocab_size)
    assert torch.equal(tables.lm_rows(toks), lm(toks))

    backend = SteeringBackend(MODEL_DIR)
    tensors = {k for k, v in vars(backend).items() if isinstance(v, torch.Tensor)}
    assert tensors == {"known_embedding", "lm_weight", "disc_coef", "disc_basis"}
    assert backend.tensor_names() == ("known_head.concept_embedding.weight", "transformer.tok_emb.weight",
                                      "unknown_head.embedding_coef.weight", "unknown_head.embedding_basis.weight")
    assert backend.model_name == "steerling-tiny"


# ---- steering service ---------------------------------------------------------------------

@pytest.mark.contract
def test_steering_health_search_and_lookup():
    async def main():
        async with services() as (_, sc, ac):
            for ch, name in ((sc, "cde.v1.Steering"), (ac, "cde.v1.Attribution")):
                for svc in ("", name):
                    assert await health_of(ch, svc) == health_pb2.HealthCheckResponse.SERVING
            stub = steering_pb2_grpc.SteeringStub(sc)
            hits = (await stub.SearchConcepts(common_pb2.SearchConceptsRequest(query="oce"), timeout=TIMEOUT)).concepts
            assert hits[0].name == "ocean" and hits[0].id == 0 and hits[0].head == "known"
            assert hits[0].HasField("group_id") and hits[0].group_id == 0 and hits[0].steerable
            limited = await stub.SearchConcepts(common_pb2.SearchConceptsRequest(query="o", limit=3))
            assert len(limited.concepts) == 3
            every = await stub.SearchConcepts(common_pb2.SearchConceptsRequest(query="discovered", limit=200))
            assert len(every.concepts) == 96 and all(c.head == "discovered" for c in every.concepts)
            assert not (await stub.SearchConcepts(common_pb2.SearchConceptsRequest(
                query="discovered", known_only=True))).concepts

            by_name = await stub.GetConcept(steering_pb2.GetConceptRequest(name="  OCEAN "))
            by_id = await stub.GetConcept(steering_pb2.GetConceptRequest(concept_id=0, model="steerling-tiny"))
            assert by_name == by_id and by_name.name == "ocean" and by_name.group_name.startswith("group 0")
            disc = await stub.GetConcept(steering_pb2.GetConceptRequest(concept_id=50))
            assert disc.head == "discovered" and not disc.steerable and not disc.HasField("group_id")

            bad = [(stub.SearchConcepts, common_pb2.SearchConceptsRequest(query=""), "INVALID_ARGUMENT", "empty"),
                   (stub.SearchConcepts, common_pb2.SearchConceptsRequest(query="   "), "INVALID_ARGUMENT", "empty"),
                   (stub.SearchConcepts, common_pb2.SearchConceptsRequest(query="x" * 201), "INVALID_ARGUMENT", "201"),
                   (stub.SearchConcepts, common_pb2.SearchConceptsRequest(query="a", model="gpt"), "NOT_FOUND", "gpt"),
                   (stub.GetConcept, steering_pb2.GetConceptRequest(name="seaweed"), "NOT_FOUND", "seaweed"),
                   (stub.GetConcept, steering_pb2.GetConceptRequest(concept_id=999), "NOT_FOUND", "999"),
                   (stub.GetConcept, steering_pb2.GetConceptRequest(), "INVALID_ARGUMENT", "concept_id or a name")]
            for call, req, code, text in bad:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await call(req, timeout=TIMEOUT)
                assert err.value.code() == getattr(grpc.StatusCode, code), (req, err.value.details())
                assert text in err.value.details()
    run(main)


@pytest.mark.contract
def test_build_steering_equals_in_process_prepare(model, catalog):
    cfg = model.cfg
    lm = model.transformer.lm_head.weight

    @torch.no_grad()
    def expected(spec: SteeringSpec, weights=None):
        return prepare(spec, model.known_head.embeddings(torch.tensor(spec.concept_ids)), lm, cfg.n_layers,
                       weights=None if weights is None else torch.tensor(weights))

    music = catalog.by_name("music").concept_id
    cases = [
        # amplify, defaults: the preset's layer 8 of 32 scaled to the tiny model's 4 layers: 1
        (common_pb2.SteeringRequest(concepts=[concept("ocean")]), SteeringSpec.amplify([0], 8.0, 1, 32), None),
        # one concept's strength scales the magnitude only (the direction is the unweighted one)
        (common_pb2.SteeringRequest(concepts=[concept("ocean", 0.5)]),
         dataclasses.replace(SteeringSpec.amplify([0], 8.0, 1, 32), strength=0.5), None),
        # several: the largest strength is the magnitude, the others relative to it weigh the
        # direction; overrides of the preset
        (common_pb2.SteeringRequest(concepts=[concept("Ocean", 2.0), concept(2, 0.5), concept("song")],
                                    target=5.5, inject_layer=2, cutoff_tokens=10,
                                    schedule=common_pb2.STEERING_SCHEDULE_FIXED),
         SteeringSpec((0, 2, 7), 5.5, True, 2, "fixed", 10, strength=2.0), [1.0, 0.5 / 2.0, 1.0 / 2.0]),
        # suppress: the focal concept, its group neighbours, raw alpha -7, layer n_layers // 2, relu mask
        (common_pb2.SteeringRequest(concepts=[concept("music")], mode=common_pb2.STEERING_MODE_SUPPRESS),
         SteeringSpec.suppress(music, catalog.group_neighbours(music)), None),
        # suppress with more concepts (one of them also a neighbour) and a schedule override
        (common_pb2.SteeringRequest(concepts=[concept("music", 3.0), concept("rhythm", 2.0), concept("ocean")],
                                    mode=common_pb2.STEERING_MODE_SUPPRESS, target=-3.0, inject_layer=1,
                                    schedule=common_pb2.STEERING_SCHEDULE_HARD_CUTOFF, cutoff_tokens=16),
         SteeringSpec((music, 6, 0, 5, 7), -3.0, False, 1, "hard_cutoff", 16, {music: 20.0}, strength=3.0),
         [1.0, 2.0 / 3.0, 1.0 / 3.0, 1.0, 1.0]),  # the neighbours weigh as the focal concept
    ]

    async def main():
        async with services() as (steer, sc, _):
            stub = steering_pb2_grpc.SteeringStub(sc)
            for request, spec, weights in cases:
                got = await stub.BuildSteering(build_request(request), timeout=TIMEOUT)
                want = expected(spec, weights)
                assert got.direction_f32 == floats_to_bytes(want.direction)
                # the proto field is float32: exactly the float32 rounding of the fp64 alpha
                assert got.base_alpha == float(np.float32(want.base_alpha))
                assert math.isclose(got.base_alpha, want.base_alpha, rel_tol=1e-6)
                assert got.inject_layer == want.inject_layer and got.cutoff_tokens == want.cutoff_tokens
                assert got.schedule == {"fixed": common_pb2.STEERING_SCHEDULE_FIXED,
                                        "hard_cutoff": common_pb2.STEERING_SCHEDULE_HARD_CUTOFF}[want.schedule]
                assert list(got.concept_ids) == list(spec.concept_ids) and got.model == "steerling-tiny"
                if want.relu_mask is None:
                    assert got.relu_mask_f32 == b""
                else:
                    mask = bytes_to_floats(got.relu_mask_f32, expected_len=cfg.vocab_size)
                    assert np.allclose(mask, want.relu_mask.numpy(), atol=1e-6)
                    assert got.relu_mask_f32 == floats_to_bytes(want.relu_mask)  # same math, same bits
            # same request again: served from the LRU, same answer
            assert len(steer.servicer.cache) == len(cases)
            again = await stub.BuildSteering(build_request(cases[0][0]))
            assert again.direction_f32 == floats_to_bytes(expected(cases[0][1]).direction)
            assert len(steer.servicer.cache) == len(cases)
    run(main)


BAD_STEERING = [
    ("unknown name", dict(concepts=[concept("seaweed")]), "NOT_FOUND", "seaweed"),
    ("unknown id", dict(concepts=[concept(999)]), "NOT_FOUND", "999"),
    ("discovered id", dict(concepts=[concept(50)]), "INVALID_ARGUMENT", "discovered"),
    ("discovered name", dict(concepts=[concept("discovered #0")]), "INVALID_ARGUMENT", "discovered"),
    ("no concepts", dict(), "INVALID_ARGUMENT", "at least one"),
    ("17 concepts", dict(concepts=[concept(i) for i in range(17)]), "INVALID_ARGUMENT", "at most 16"),
    ("no reference", dict(concepts=[common_pb2.SteeringConcept(strength=1.0)]), "INVALID_ARGUMENT", "name"),
    ("twice", dict(concepts=[concept("ocean"), concept(0)]), "INVALID_ARGUMENT", "twice"),
    ("strength 99", dict(concepts=[concept("ocean", 99.0)]), "INVALID_ARGUMENT", "strength"),
    ("negative strength", dict(concepts=[concept("ocean", -1.0)]), "INVALID_ARGUMENT", "strength"),
    ("nan strength", dict(concepts=[concept("ocean", float("nan"))]), "INVALID_ARGUMENT", "strength"),
    ("target 51", dict(concepts=[concept("ocean")], target=51.0), "INVALID_ARGUMENT", "target"),
    ("target -inf", dict(concepts=[concept("ocean")], target=float("-inf")), "INVALID_ARGUMENT", "target"),
    ("layer 0", dict(concepts=[concept("ocean")], inject_layer=0), "INVALID_ARGUMENT", "inject_layer"),
    ("layer 5 of 4", dict(concepts=[concept("ocean")], inject_layer=5), "INVALID_ARGUMENT", "inject_layer"),
    ("cutoff 0", dict(concepts=[concept("ocean")], cutoff_tokens=0), "INVALID_ARGUMENT", "steering.cutoff"),
    ("cutoff 4097", dict(concepts=[concept("ocean")], cutoff_tokens=4097), "INVALID_ARGUMENT", "steering.cutoff"),
    ("unknown mode", dict(concepts=[concept("ocean")], mode=7), "INVALID_ARGUMENT", "mode"),
    ("unknown schedule", dict(concepts=[concept("ocean")], schedule=9), "INVALID_ARGUMENT", "schedule"),
]


# (what, field cleared from a resolved request, text): steering_svc picks no default
UNRESOLVED_STEERING = [
    ("no target", "target", "steering.target"),
    ("no inject_layer", "inject_layer", "steering.inject_layer"),
    ("no cutoff", "cutoff_tokens", "steering.cutoff"),
    ("default schedule", "schedule", "steering.schedule"),
]


@pytest.mark.contract
def test_build_steering_refuses_bad_input():
    async def main():
        async with services() as (steer, sc, _):
            stub = steering_pb2_grpc.SteeringStub(sc)
            requests = [(what, build_request(common_pb2.SteeringRequest(**fields)), code, text)
                        for what, fields, code, text in BAD_STEERING]
            for what, field, text in UNRESOLVED_STEERING:
                req = build_request(common_pb2.SteeringRequest(concepts=[concept("ocean")]))
                req.steering.ClearField(field)
                requests.append((what, req, "INVALID_ARGUMENT", text))
            unset_strength = build_request(common_pb2.SteeringRequest(concepts=[concept("ocean")]))
            unset_strength.steering.concepts[0].strength = 0.0
            requests.append(("strength 0", unset_strength, "INVALID_ARGUMENT", "steering.concepts[0].strength"))
            for what, req, code, text in requests:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.BuildSteering(req, timeout=TIMEOUT)
                assert err.value.code() == getattr(grpc.StatusCode, code), (what, err.value.details())
                assert text in err.value.details(), (what, err.value.details())
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.BuildSteering(steering_pb2.BuildSteeringRequest(
                    model="steerling-8b", steering=common_pb2.SteeringRequest(concepts=[concept(0)])))
            assert err.value.code() == grpc.StatusCode.NOT_FOUND and "steerling-8b" in err.value.details()
            assert len(steer.servicer.cache) == 0
            assert await health_of(sc, "cde.v1.Steering") == health_pb2.HealthCheckResponse.SERVING
    run(main)


# ---- attribution service ------------------------------------------------------------------

PROMPT = list(b"Tell me about the sea.")       # 22 tokens: the first block is [22, 64)
FORCED_EOC = (30, 40, 41, 100)                 # chunks [22,30) [31,40) (empty) [42,100) spans two blocks
FORCED_EOT = 150                               # the last chunk [101,150) spans two blocks and ends at the stop


def forced_choice(cfg, forced: dict[int, int]):
    """Greedy choice, never a structural token on its own, the given tokens at the given positions."""
    def choose(positions, rows, _u):
        rows = rows.clone()
        rows[:, [cfg.endofchunk_id, cfg.eot_id]] = float("-inf")
        picked = rows.argmax(-1)
        for i, p in enumerate(positions.tolist()):
            if p in forced:
                picked[i] = forced[p]
        return picked
    return choose


def records_message(r: attr.RawRecords) -> common_pb2.RawConceptRecords:
    return common_pb2.RawConceptRecords(
        positions=r.positions.tolist(), tokens=r.tokens.tolist(), target_logits=r.target_logits.tolist(),
        k_known=r.known_idx.shape[1], known_idx=r.known_idx.reshape(-1).tolist(),
        known_logits=r.known_logits.reshape(-1).tolist(), k_disc=r.disc_idx.shape[1],
        disc_idx=r.disc_idx.reshape(-1).tolist(), disc_logits=r.disc_logits.reshape(-1).tolist())


def block_requests(res, cfg, *, top_k: int, mode=common_pb2.ATTRIBUTION_ALL, cut_inclusive: bool = False):
    out = []
    for i, b in enumerate(res.blocks):
        ctx = list(b.tokens)
        if cfg.eot_id in ctx:  # "cut at the first stop token": both readings must work
            j = ctx.index(cfg.eot_id)
            ctx = ctx[:j + 1] if cut_inclusive else ctx[:j]
        out.append(attribution_pb2.AttributeRequest(
            request_id="r1", block_index=b.block, mode=mode, top_k=top_k, records=records_message(b.records),
            start=b.start, context_tokens=ctx, last=i == len(res.blocks) - 1))
    return out


def expected_chunks(res, ta, cfg, top_k):
    order = {int(p): i for i, p in enumerate(res.records.positions)}
    p0 = res.prompt_len
    out = []
    for s, e in attr.chunk_spans(res.sequence[p0:], cfg.endofchunk_id, [cfg.eot_id]):
        if e > s:
            rows = [order[p0 + p] for p in range(s, e) if p0 + p in order]
            out.append((p0 + s, p0 + e, *attr.chunk_scores(ta, rows, e - s, cfg.n_known, top=top_k)))
    return out


@pytest.fixture(scope="module")
def steered_run(model):
    """A steered generation with forced end-of-chunk and stop tokens (steering built by the service)."""
    cfg = model.cfg

    async def build():
        async with services() as (_, sc, _ac):
            return await steering_pb2_grpc.SteeringStub(sc).BuildSteering(build_request(
                common_pb2.SteeringRequest(concepts=[concept("ocean")], inject_layer=1)), timeout=TIMEOUT)
    prepared = to_prepared(run(build))
    forced = {p: cfg.endofchunk_id for p in FORCED_EOC} | {FORCED_EOT: cfg.eot_id}
    res = generate(model, PROMPT, decode_options(170 - len(PROMPT), seed=3), prepared,
                   tokenizer_vocab_size=264, choose=forced_choice(cfg, forced))
    assert res.finish_reason == "stop" and [b.start for b in res.blocks] == [22, 64, 128]
    return res


@pytest.mark.contract
@pytest.mark.parametrize("cut_inclusive", [False, True])
def test_attribute_stream_equals_in_process_attribution(model, catalog, steered_run, cut_inclusive):
    cfg, res, top_k = model.cfg, steered_run, 64
    ta = attr.token_attribution(res.records, *attr.model_lookups(model))
    row_of = {int(p): i for i, p in enumerate(res.records.positions)}
    requests = block_requests(res, cfg, top_k=top_k, cut_inclusive=cut_inclusive)

    async def main():
        async with services() as (_, _sc, ac):
            async def gen():
                for r in requests:
                    yield r
            return [r async for r in attribution_pb2_grpc.AttributionStub(ac).Attribute(gen(), timeout=TIMEOUT)]
    responses = run(main)
    assert [r.block_index for r in responses] == [b.block for b in res.blocks]

    tokens = [t for r in responses for t in r.token_attributions]
    # position order within each block; commit_order is the record's index in its block
    assert [t.position for t in tokens] == sorted(res.records.positions.tolist())
    for r in responses:
        block_rows = [row_of[t.position] for t in r.token_attributions]
        assert sorted(t.commit_order for t in r.token_attributions) == list(range(len(block_rows)))
        assert [min(block_rows) + t.commit_order for t in r.token_attributions] == block_rows
    k_all = cfg.topk_known + cfg.topk_discovered
    for t in tokens:
        i = row_of[t.position]
        assert t.token == int(res.records.tokens[i]) and t.target_logit == float(res.records.target_logits[i])
        assert len(t.top) == k_all  # top_k 64 >= 8 + 16: every concept of the token
        assert abs(sum(c.score for c in t.top) + t.residual - t.target_logit) < 1e-4
        assert abs(t.residual - float(ta.residual[i])) < 1e-5
        want = {int(c): float(v) for c, v in zip(ta.known_idx[i], ta.known_contrib[i])}
        want |= {int(c) + cfg.n_known: float(v) for c, v in zip(ta.disc_idx[i], ta.disc_contrib[i])}
        got = {c.concept_id: c.score for c in t.top}
        assert got.keys() == want.keys() and all(abs(got[c] - want[c]) < 1e-5 for c in want)
        scores = [abs(c.score) for c in t.top]
        assert scores == sorted(scores, reverse=True)
        for c in t.top:
            assert c.label == catalog.label(c.concept_id)
            assert c.head == ("known" if c.concept_id < cfg.n_known else "discovered")

    chunks = [(r.block_index, c) for r in responses for c in r.chunk_attributions]
    want = expected_chunks(res, ta, cfg, top_k)
    assert [(c.start, c.end) for _, c in chunks] == [(s, e) for s, e, _, _ in want] \
        == [(22, 30), (31, 40), (42, 100), (101, 150)]
    assert [b for b, _ in chunks] == [0, 0, 1, 2]  # each emitted by the block that closes it
    for (_, got), (_, _, scores, eps_pct) in zip(chunks, want):
        assert abs(got.residual_pct - eps_pct) < 1e-4
        assert [c.concept_id for c in got.top] == [s.concept_id for s in scores]
        assert np.allclose([c.score for c in got.top], [s.score for s in scores], atol=1e-6)
        assert [c.label for c in got.top] == [catalog.label(s.concept_id) for s in scores]


def random_block_requests(cfg, seed: int, top_k: int, n_blocks: int = 3) -> list[attribution_pb2.AttributeRequest]:
    """Fresh random records (distinct concepts per token, logits both signs) for consecutive
    blocks from position 10, every position committed, end-of-chunk tokens at random places."""
    g = torch.Generator().manual_seed(seed)
    kk, kd = min(cfg.topk_known, cfg.n_known), min(cfg.topk_discovered, cfg.n_discovered)
    out, start = [], 10
    for b in range(n_blocks):
        end = (start // 64 + 1) * 64
        n = end - start
        tokens = torch.randint(0, 256, (n,), generator=g)
        tokens[torch.rand(n, generator=g) < 0.05] = cfg.endofchunk_id
        rec = attr.RawRecords(
            torch.arange(start, end), tokens, torch.randn(n, generator=g) * 4,
            torch.stack([torch.randperm(cfg.n_known, generator=g)[:kk] for _ in range(n)]),
            torch.randn(n, kk, generator=g) * 3,
            torch.stack([torch.randperm(cfg.n_discovered, generator=g)[:kd] for _ in range(n)]),
            torch.randn(n, kd, generator=g) * 3)
        out.append(attribution_pb2.AttributeRequest(
            request_id="rnd", block_index=start // 64, mode=common_pb2.ATTRIBUTION_ALL, top_k=top_k,
            records=records_message(rec), start=start, context_tokens=tokens.tolist(), last=b == n_blocks - 1))
        start = end
    return out


@pytest.mark.contract
def test_listed_terms_plus_other_plus_residual_equal_the_logit_on_random_records(model):
    """For every top_k (0 = the default 8): sum(top) + other.known + other.discovered + residual ==
    target_logit to float32 rounding, and `other` is exactly the record's unlisted terms per head
    (checked against the in-process float64 math). Chunks: listed + other == all of the chunk."""
    cfg = model.cfg
    seed = np.random.SeedSequence().entropy % (1 << 31)
    lm = model.transformer.lm_head.weight.detach().double()
    for top_k in (0, 1, 3, 64):
        requests = random_block_requests(cfg, seed + top_k, top_k)

        async def main():
            async with services() as (_, _sc, ac):
                async def gen():
                    for r in requests:
                        yield r
                return [r async for r in attribution_pb2_grpc.AttributionStub(ac).Attribute(gen(), timeout=TIMEOUT)]
        responses = run(main)
        listed_max = top_k or 8
        tokens = [t for r in responses for t in r.token_attributions]
        assert len(tokens) == sum(len(r.records.positions) for r in requests), f"seed={seed}"
        recs = {p: (r.records, i) for r in requests for i, p in enumerate(r.records.positions)}
        for t in tokens:
            msg, i = recs[t.position]
            kk, kd = msg.k_known, msg.k_disc
            w_y = lm[t.token]
            known = {int(c): float(torch.sigmoid(torch.tensor(v, dtype=torch.float64))
                                   * (model.known_head.embeddings(torch.tensor([c])).detach().double()[0] @ w_y))
                     for c, v in zip(msg.known_idx[i * kk:(i + 1) * kk], msg.known_logits[i * kk:(i + 1) * kk])}
            disc = {int(c) + cfg.n_known: float(torch.sigmoid(torch.tensor(v, dtype=torch.float64))
                                                * (model.unknown_head.embeddings(torch.tensor([c])).detach().double()[0] @ w_y))
                    for c, v in zip(msg.disc_idx[i * kd:(i + 1) * kd], msg.disc_logits[i * kd:(i + 1) * kd])}
            tag = f"seed={seed} top_k={top_k} position={t.position}"
            assert len(t.top) == min(listed_max, kk + kd), tag
            total = sum(c.score for c in t.top) + t.other.known + t.other.discovered + t.residual
            scale = sum(abs(c.score) for c in t.top) + abs(t.other.known) + abs(t.other.discovered) + abs(t.residual)
            assert abs(total - t.target_logit) <= 1e-5 * max(1.0, scale), f"{tag}: {total} != {t.target_logit}"
            listed = {c.concept_id for c in t.top}
            want_known = sum(v for c, v in known.items() if c not in listed)
            want_disc = sum(v for c, v in disc.items() if c not in listed)
            assert abs(t.other.known - want_known) <= 1e-4 and abs(t.other.discovered - want_disc) <= 1e-4, tag
            assert abs(t.residual - (t.target_logit - sum(known.values()) - sum(disc.values()))) <= 1e-4, tag
            everything = known | disc
            unlisted = sorted(abs(v) for c, v in everything.items() if c not in listed)
            assert not unlisted or min(abs(c.score) for c in t.top) >= unlisted[-1] - 1e-5, f"{tag}: not the top"
        chunks = [c for r in responses for c in r.chunk_attributions]
        assert chunks, f"seed={seed}: no chunk closed"
        ta = attr.token_attribution(attr.RawRecords.cat([
            attr.RawRecords(torch.tensor(list(r.records.positions)), torch.tensor(list(r.records.tokens)),
                            torch.tensor(list(r.records.target_logits)),
                            torch.tensor(list(r.records.known_idx)).view(-1, r.records.k_known),
                            torch.tensor(list(r.records.known_logits)).view(-1, r.records.k_known),
                            torch.tensor(list(r.records.disc_idx)).view(-1, r.records.k_disc),
                            torch.tensor(list(r.records.disc_logits)).view(-1, r.records.k_disc))
            for r in requests]), *attr.model_lookups(model))
        for c in chunks:
            rows = list(range(c.start - 10, c.end - 10))
            every, _ = attr.chunk_scores(ta, rows, c.end - c.start, cfg.n_known)
            got = sum(s.score for s in c.top) + c.other.known + c.other.discovered
            assert abs(got - sum(s.score for s in every)) <= 1e-5, f"seed={seed} top_k={top_k} chunk {c.start}"
            assert len(c.top) == min(listed_max, len(every)), f"seed={seed} top_k={top_k} chunk {c.start}"


def test_unit_chunks_close_at_the_generation_end_and_modes_select_output(model, catalog, steered_run):
    """Without a stop token the open chunk closes at last=True; a context cut short closes it too;
    TOKENS/CHUNKS/NONE pick what is sent, while the chunk state advances in every mode."""
    cfg, res = model.cfg, steered_run
    tables = AttributionTables.open(MODEL_DIR)
    first_two = block_requests(res, cfg, top_k=5)[:2]
    first_two[1].last = True  # pretend the generation ended after block 1 (no stop token seen)
    state = StreamState()
    out = [attribute_block(tables, catalog, state, r) for r in first_two]
    assert [(c.start, c.end) for r in out for c in r.chunk_attributions] == [(22, 30), (31, 40), (42, 100), (101, 128)]
    assert all(len(c.top) == 5 for r in out for c in r.chunk_attributions)
    assert state.chunk_start is None and state.terms is None  # reset after the last block

    # the stop block marked not-last, context cut before the stop (as the scheduler does): the
    # short context ends the generation, the last chunk closes at the stop, the state resets
    reqs = block_requests(res, cfg, top_k=5)
    reqs[2].last = False
    state = StreamState()
    out = [attribute_block(tables, catalog, state, r) for r in reqs]
    assert [(c.start, c.end) for c in out[2].chunk_attributions] == [(101, 150)]
    assert state.chunk_start is None and state.next_start is None

    reqs = block_requests(res, cfg, top_k=5)
    modes = [common_pb2.ATTRIBUTION_TOKENS, common_pb2.ATTRIBUTION_NONE, common_pb2.ATTRIBUTION_CHUNKS]
    for r, m in zip(reqs, modes):
        r.mode = m
    state = StreamState()
    out = [attribute_block(tables, catalog, state, r) for r in reqs]
    assert [len(r.token_attributions) > 0 for r in out] == [True, False, False]
    assert [[(c.start, c.end) for c in r.chunk_attributions] for r in out] == [[], [], [(101, 150)]]


def _bad_stream_cases(res, cfg):
    good = block_requests(res, cfg, top_k=8)

    def edit(fn, index=0):
        reqs = [attribution_pb2.AttributeRequest() for _ in good[:index + 1]]
        for r, g in zip(reqs, good):
            r.CopyFrom(g)
        fn(reqs[index])
        return reqs

    def rec(r):
        return r.records
    return {
        "short known_idx": edit(lambda r: rec(r).known_idx.pop()),
        "k_known above the model's": edit(lambda r: setattr(rec(r), "k_known", 9)),
        "known index out of range": edit(lambda r: rec(r).known_idx.__setitem__(0, cfg.n_known)),
        "discovered index out of range": edit(lambda r: rec(r).disc_idx.__setitem__(3, cfg.n_discovered)),
        "token out of vocabulary": edit(lambda r: rec(r).tokens.__setitem__(0, cfg.vocab_size)),
        "missing target logit": edit(lambda r: rec(r).target_logits.pop()),
        "non-finite logit": edit(lambda r: rec(r).known_logits.__setitem__(1, float("nan"))),
        "position before start": edit(lambda r: rec(r).positions.__setitem__(0, r.start - 1)),
        "position past the block": edit(lambda r: rec(r).positions.__setitem__(0, 64)),
        "repeated position": edit(lambda r: rec(r).positions.__setitem__(1, rec(r).positions[0])),
        "token differs from context": edit(lambda r: r.context_tokens.__setitem__(
            rec(r).positions[0] - r.start, (rec(r).tokens[0] + 1) % 256)),
        "context past the block": edit(lambda r: r.context_tokens.extend([1] * 50)),
        "unknown mode": edit(lambda r: setattr(r, "mode", 9)),
        "gap between blocks": edit(lambda r: setattr(r, "start", r.start + 64) or r.ClearField("context_tokens")
                                   or r.records.Clear(), index=1),
    }


@pytest.mark.contract
def test_malformed_records_are_invalid_argument_and_the_server_stays_serving(model, steered_run):
    cases = _bad_stream_cases(steered_run, model.cfg)
    good = block_requests(steered_run, model.cfg, top_k=8)

    async def main():
        async with services() as (_, _sc, ac):
            stub = attribution_pb2_grpc.AttributionStub(ac)
            for what, reqs in cases.items():
                got = []
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    async for resp in stub.Attribute(iter(reqs), timeout=TIMEOUT):
                        got.append(resp)
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (what, err.value.details())
                assert len(got) == len(reqs) - 1, what  # earlier good blocks were answered
                assert f"block {reqs[-1].block_index}" in err.value.details()
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in stub.Attribute(iter([attribution_pb2.AttributeRequest(model="other")])):
                    pass
            assert err.value.code() == grpc.StatusCode.NOT_FOUND
            assert await health_of(ac, "cde.v1.Attribution") == health_pb2.HealthCheckResponse.SERVING
            ok = [r async for r in stub.Attribute(iter(good), timeout=TIMEOUT)]
            assert len(ok) == len(good) and sum(len(r.chunk_attributions) for r in ok) == 4
    run(main)


@pytest.mark.contract
@pytest.mark.parametrize("which", ["steering", "attribution"])
def test_not_serving_and_unavailable_until_loaded(monkeypatch, which):
    """The server answers health NOT_SERVING (and UNAVAILABLE to calls) while the model loads."""
    import socket
    import threading

    release = threading.Event()
    module = steering_service if which == "steering" else attribution_service
    attr_name = "SteeringBackend" if which == "steering" else "Loaded"
    real = getattr(module, attr_name)
    if which == "steering":
        def slow(model_dir):
            release.wait(TIMEOUT)
            return real(model_dir)
        monkeypatch.setattr(module, attr_name, slow)
    else:
        class Slow:
            @staticmethod
            def load(model_dir):
                release.wait(TIMEOUT)
                return real.load(model_dir)
        monkeypatch.setattr(module, attr_name, Slow)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    service = "cde.v1.Steering" if which == "steering" else "cde.v1.Attribution"

    async def main():
        task = asyncio.create_task(module.build_server(MODEL_DIR, "127.0.0.1", port))
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=channel_options()) as ch:
            await ch.channel_ready()
            assert await health_of(ch, service) == health_pb2.HealthCheckResponse.NOT_SERVING
            with pytest.raises(grpc.aio.AioRpcError) as err:
                if which == "steering":
                    await steering_pb2_grpc.SteeringStub(ch).GetConcept(steering_pb2.GetConceptRequest(concept_id=0))
                else:
                    async for _ in attribution_pb2_grpc.AttributionStub(ch).Attribute(
                            iter([attribution_pb2.AttributeRequest()])):
                        pass
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            release.set()
            running = await task
            try:
                assert await health_of(ch, service) == health_pb2.HealthCheckResponse.SERVING
            finally:
                await running.stop(None)
    run(main)


@pytest.mark.fault
@pytest.mark.contract
def test_a_stream_reopened_while_the_stored_blocks_cannot_be_read_still_sees_them(model):
    """The scheduler's AttributionSession against a real replica: its stream breaks after block 0,
    and the first read of the stored blocks for the replay fails (Redis failing over). The next
    attempt must replay block 0, so the chunk that spans blocks 0 and 1 is scored as one: every
    attribution equals an undisturbed session's. (A stream kept from the failed reopen started
    its chunk at block 1: the chaos test's "attributions differ".)"""
    import redis
    from scheduler_svc.attribution import AttributionPool, AttributionSession

    cfg = model.cfg
    seed = np.random.SeedSequence().entropy % (1 << 31)
    requests = random_block_requests(cfg, seed, top_k=4, n_blocks=3)
    blocks = [common_pb2.BlockCommitted(block_index=r.block_index, start=r.start, tokens=r.context_tokens,
                                        records=r.records, last=r.last) for r in requests]
    first = blocks[0].block_index

    async def session_run(disturb: bool) -> list[common_pb2.BlockCommitted]:
        attrib = await attribution_service.build_server(MODEL_DIR, "127.0.0.1", 0)
        pool = AttributionPool([f"127.0.0.1:{attrib.port}"])
        stored: list[common_pb2.BlockCommitted] = []
        failures = [disturb]

        async def history():
            if stored and failures and failures.pop():
                raise redis.exceptions.ConnectionError("Redis is failing over")
            return list(stored)
        session = AttributionSession(pool, "rs", "", common_pb2.ATTRIBUTION_ALL, 4, set(), history, first)
        try:
            for i, b in enumerate(blocks):
                b = common_pb2.BlockCommitted.FromString(b.SerializeToString())
                if disturb and i == 1:
                    session._drop()   # the stream broke after block 0
                    with pytest.raises(redis.exceptions.ConnectionError):
                        await session.attach(b, b.last)
                    assert not b.chunk_attributions and session._call is None, f"seed={seed}"
                await session.attach(b, b.last)
                stored.append(b)
            await session.close()
        finally:
            await pool.close()
            await attrib.stop(None)
        return stored

    want, got = run(lambda: session_run(False)), run(lambda: session_run(True))
    assert sum(len(b.chunk_attributions) for b in want) >= 2, f"seed={seed}"
    assert any(c.start < b.start for b in want for c in b.chunk_attributions), f"seed={seed}: no chunk spans blocks"
    for a, b in zip(want, got):
        assert list(b.chunk_attributions) == list(a.chunk_attributions), f"seed={seed} block {a.block_index}"
        assert list(b.token_attributions) == list(a.token_attributions), f"seed={seed} block {a.block_index}"


@pytest.mark.fault
@pytest.mark.contract
def test_a_block_attributed_again_gets_the_same_attributions(model):
    """A block asked for twice (its store failed during a Redis failover, or a new attempt made it
    again): the second answer equals the first. The stream's chunk state is past the block (after
    the last block it was reset), so answering on the same stream scored the chunk from the block's
    own start: the chaos test's "attributions differ" (block 1's chunk from 64, not 44)."""
    from scheduler_svc.attribution import AttributionPool, AttributionSession

    cfg = model.cfg
    seed = np.random.SeedSequence().entropy % (1 << 31)
    for n_blocks in (2, 3):
        requests = random_block_requests(cfg, seed, top_k=4, n_blocks=n_blocks)
        blocks = [common_pb2.BlockCommitted(block_index=r.block_index, start=r.start, tokens=r.context_tokens,
                                            records=r.records, last=r.last) for r in requests]

        async def again(index: int):
            attrib = await attribution_service.build_server(MODEL_DIR, "127.0.0.1", 0)
            pool = AttributionPool([f"127.0.0.1:{attrib.port}"])
            stored: list[common_pb2.BlockCommitted] = []

            async def history():
                return list(stored)
            session = AttributionSession(pool, "ra", "", common_pb2.ATTRIBUTION_ALL, 4, set(), history,
                                         blocks[0].block_index)
            try:
                first = []
                for b in blocks[: index + 1]:
                    b = common_pb2.BlockCommitted.FromString(b.SerializeToString())
                    await session.attach(b, b.last)
                    first.append(b)
                stored.extend(first[:index])   # the block itself was not stored
                repeat = common_pb2.BlockCommitted.FromString(blocks[index].SerializeToString())
                await session.attach(repeat, repeat.last)
                await session.close()
            finally:
                await pool.close()
                await attrib.stop(None)
            return first[index], repeat

        for index in range(1, n_blocks):
            want, got = run(lambda: again(index))
            tag = f"seed={seed} {n_blocks} blocks, block {index} twice"
            assert want.chunk_attributions or index < n_blocks - 1, tag
            assert list(got.chunk_attributions) == list(want.chunk_attributions), tag
            assert list(got.token_attributions) == list(want.token_attributions), tag
