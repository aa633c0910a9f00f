"""Browsing the concept catalog: GET /v1/concepts (listing, filters, pages, search) and
GET /v1/concepts/{id} with the concept's top tokens.

A real steering_svc (grpc.aio on loopback) and a real gateway (uvicorn + grpc.aio) run in a
background event loop; requests go over real sockets. The catalog is checked against
`ConceptCatalog` as loaded from the model directory, and the top tokens against the public
`steerling` package's `SteerlingGenerator.concept_top_tokens` on the same weights.
"""

from __future__ import annotations

import asyncio
import random
import threading
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
import torch

from cde import limits
from cde.checkpoint import save_checkpoint
from cde.redis_util import free_port
from cde.rpc.v1 import steering_pb2
from cde.steerling.catalog import ConceptCatalog
from cde.steerling.config import TINY
from cde.steerling.loading import load_model
from cde.steerling.tokenizer import ByteTokenizer
from gateway.detok import token_text
from gateway.server import GatewayHandle, GatewaySettings, serve
from steering_svc import service as steering_service
from steering_svc.backend import SteeringBackend
from tests.oracle import build_oracle, oracle_configs

pytestmark = pytest.mark.contract

ROOT = Path(__file__).resolve().parents[1]
MODEL_DIR = ROOT / "models" / "steerling-tiny"
CAUSAL_DIR = ROOT / "models" / "idlm-tiny"


class Services:
    """steering_svc + a Steerling gateway + a causal-model gateway on one background loop."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.steering = self.run(steering_service.build_server(MODEL_DIR, "127.0.0.1", 0))
        nobody = f"127.0.0.1:{free_port()}"   # the catalog never needs the scheduler
        self.gateway: GatewayHandle = self.run(serve(GatewaySettings(
            model_dir=str(MODEL_DIR), http_port=0, grpc_port=-1, scheduler=nobody,
            steering=f"127.0.0.1:{self.steering.port}", log_level="warning")))
        self.causal: GatewayHandle = self.run(serve(GatewaySettings(
            model_dir=str(CAUSAL_DIR), http_port=0, grpc_port=-1, scheduler=nobody, log_level="warning")))

    def run(self, coro: Any, timeout: float = 60) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        async def stop() -> None:
            await self.gateway.stop(0.5)
            await self.causal.stop(0.5)
            await self.steering.stop(None)
        self.run(stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()


@pytest.fixture(scope="module")
def services() -> Iterator[Services]:
    s = Services()
    try:
        yield s
    finally:
        s.close()


@pytest.fixture
def client(services: Services) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=services.gateway.base_url, timeout=30) as c:
        yield c


@pytest.fixture(scope="module")
def catalog() -> ConceptCatalog:
    model = load_model(MODEL_DIR)
    return ConceptCatalog.load(MODEL_DIR, model.cfg.n_known, model.cfg.n_discovered)


def as_json(c) -> dict[str, Any]:
    return {"id": c.concept_id, "object": "concept", "name": c.name, "head": c.head, "description": c.description,
            "group_id": c.group_id, "group_name": c.group_name, "steerable": c.steerable}


def walk(client: httpx.Client, **params: Any) -> tuple[list[dict[str, Any]], int]:
    """Every page of a listing, following next_after; (items, pages)."""
    items: list[dict[str, Any]] = []
    pages, after = 0, None
    while True:
        q = dict(params) if after is None else {**params, "after": after}
        r = client.get("/v1/concepts", params=q)
        assert r.status_code == 200, r.text
        page = r.json()
        assert page["object"] == "list" and set(page) == {"object", "data", "has_more", "next_after"}
        pages += 1
        items += page["data"]
        if not page["has_more"]:
            assert page["next_after"] is None
            return items, pages
        assert page["next_after"] == page["data"][-1]["id"]
        after = page["next_after"]


def every(catalog: ConceptCatalog) -> list:
    """The catalog in id order (the tiny model's ids are 0..143)."""
    out = [catalog.get(i) for i in range(1000) if catalog.get(i) is not None]
    assert len(out) == len(catalog)
    return out


def test_listing_pages_through_the_whole_catalog_once(client: httpx.Client, catalog: ConceptCatalog) -> None:
    want = [as_json(c) for c in every(catalog)]
    assert len(want) == 144
    for limit in (1, 7, 48, 144, limits.LIST_LIMIT_MAX):
        got, pages = walk(client, limit=limit)
        assert got == want, limit
        assert pages == -(-144 // limit), limit
    first = client.get("/v1/concepts").json()   # default page size
    assert first["data"] == want[:limits.DEFAULT_LIST_LIMIT] and first["has_more"]
    assert first["next_after"] == limits.DEFAULT_LIST_LIMIT - 1
    # after the last id: an empty last page; after a gap-free middle id: the rest
    assert client.get("/v1/concepts", params={"after": 143}).json() == {
        "object": "list", "data": [], "has_more": False, "next_after": None}
    assert client.get("/v1/concepts", params={"after": 100, "limit": 500}).json()["data"] == want[101:]


@pytest.mark.parametrize("filters", [
    {"head": "known"}, {"head": "discovered"}, {"steerable": "true"}, {"steerable": "false"},
    {"group": 3}, {"group": 11}, {"group": 12}, {"head": "known", "steerable": "false"},
    {"head": "discovered", "steerable": "false", "group": 0}, {"known_only": "true"}])
def test_filters_select_exactly_the_matching_concepts(client: httpx.Client, catalog: ConceptCatalog,
                                                      filters: dict[str, Any]) -> None:
    def keep(c) -> bool:
        head = "known" if filters.get("known_only") else filters.get("head")
        return ((head is None or c.head == head)
                and ("steerable" not in filters or c.steerable == (filters["steerable"] == "true"))
                and ("group" not in filters or c.group_id == filters["group"]))
    want = [as_json(c) for c in every(catalog) if keep(c)]
    got, _ = walk(client, limit=5, **filters)
    assert got == want, filters


def test_listing_agrees_with_random_filtered_pages(client: httpx.Client, catalog: ConceptCatalog, seed: int) -> None:
    rng = random.Random(seed)
    concepts = every(catalog)
    for _ in range(25):
        after = rng.choice([None, rng.randrange(-1, 150)])
        limit = rng.randrange(1, 30)
        head = rng.choice([None, "known", "discovered"])
        params: dict[str, Any] = {"limit": limit}
        if after is not None and after >= 0:
            params["after"] = after
        if head:
            params["head"] = head
        page = client.get("/v1/concepts", params=params).json()
        match = [c for c in concepts if (head is None or c.head == head)
                 and ("after" not in params or c.concept_id > params["after"])]
        assert page["data"] == [as_json(c) for c in match[:limit]], (seed, params)
        assert page["has_more"] == (len(match) > limit), (seed, params)


@pytest.mark.parametrize("params, param", [
    ({"limit": 0}, "limit"), ({"limit": limits.LIST_LIMIT_MAX + 1}, "limit"), ({"limit": "many"}, "limit"),
    ({"after": -1}, "after"), ({"after": "x"}, "after"), ({"after": 2**32}, "after"),
    ({"head": "unknown"}, "head"), ({"group": -1}, "group"), ({"group": "water"}, "group"),
    ({"steerable": "maybe"}, "steerable"),
    ({"q": "o", "limit": limits.SEARCH_LIMIT_MAX + 1}, "limit"), ({"q": "o", "after": 3}, "after"),
    ({"q": "o", "group": 0}, "group"), ({"q": "o", "steerable": "true"}, "steerable"),
    ({"q": "o", "head": "discovered"}, "head"), ({"q": ""}, "q"),
    ({"q": "x" * (limits.SEARCH_QUERY_MAX_CHARS + 1)}, "q")])
def test_bad_listing_parameters_are_400_naming_the_field(client: httpx.Client, params: dict, param: str) -> None:
    r = client.get("/v1/concepts", params=params)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error", err


def test_search_still_works(client: httpx.Client) -> None:
    data = client.get("/v1/concepts", params={"q": "oce"}).json()
    assert set(data) == {"object", "data"} and data["data"][0]["name"] == "ocean"
    assert len(client.get("/v1/concepts", params={"q": "discovered", "limit": 200}).json()["data"]) == 96
    assert client.get("/v1/concepts", params={"q": "discovered", "head": "known"}).json()["data"] == []
    assert len(client.get("/v1/concepts", params={"q": "o", "limit": 3}).json()["data"]) == 3
    q = "o" * limits.SEARCH_QUERY_MAX_CHARS
    assert client.get("/v1/concepts", params={"q": q}).json()["data"] == []


# ---- one concept + top tokens -----------------------------------------------------------------
def public_generator(model_dir: Path):
    """The public package's SteerlingGenerator over the checkpoint in `model_dir`; its tokenizer
    decodes an id to the id's own spelling so token ids can be compared."""
    from steerling.inference.causal_diffusion import SteerlingGenerator
    from steerling.models.interpretable.interpretable_causal_diffusion import InterpretableCausalDiffusionLM

    ours = load_model(model_dir)
    model_cfg, concept_cfg = oracle_configs(ours.cfg)
    oracle = InterpretableCausalDiffusionLM(model_cfg, concept_cfg, ours.cfg.vocab_size).eval()
    oracle.load_state_dict(ours.state_dict(), strict=True)
    tok = SimpleNamespace(mask_token_id=ours.cfg.mask_id, eos_token_id=ours.cfg.eos_id, pad_token_id=ours.cfg.pad_id,
                          eot_id=ours.cfg.eot_id, endofchunk_token_id=ours.cfg.endofchunk_id,
                          decode=lambda ids, **_: str(int(ids[0])))
    return SteerlingGenerator(oracle, tok, model_cfg, is_interpretable=True, device="cpu"), oracle


def assert_same_ranking(got: list[tuple[int, float]], want: list[tuple[int, float]], atol: float = 1e-5) -> None:
    """Same ids and scores, best first; ids whose scores tie within atol may swap."""
    assert len(got) == len(want)
    for (gi, gs), (wi, ws) in zip(got, want):
        assert abs(gs - ws) <= atol, (got, want)
        if gi != wi:
            assert any(i == gi and abs(s - ws) <= atol for i, s in want), (got, want)


@pytest.mark.parity
def test_top_tokens_equal_the_public_concept_top_tokens(client: httpx.Client, catalog: ConceptCatalog) -> None:
    gen, _ = public_generator(MODEL_DIR)
    tok = ByteTokenizer()
    for cid in (0, 1, 17, 47):
        for k in (1, limits.DEFAULT_TOP_TOKENS, limits.TOP_TOKENS_MAX):
            r = client.get(f"/v1/concepts/{cid}", params={"top_tokens": k})
            assert r.status_code == 200, r.text
            body = r.json()
            top = body.pop("top_tokens")
            assert body == as_json(catalog.get(cid))
            want = [(int(t), s) for t, s in gen.concept_top_tokens(cid, k=k)]
            assert_same_ranking([(t["token_id"], t["score"]) for t in top], want)
            assert [t["text"] for t in top] == [token_text(tok, t["token_id"]) for t in top]
    default = client.get("/v1/concepts/0").json()["top_tokens"]
    assert len(default) == limits.DEFAULT_TOP_TOKENS
    assert client.get("/v1/concepts/0", params={"top_tokens": 0}).json()["top_tokens"] == []
    disc = client.get("/v1/concepts/100").json()
    assert disc["head"] == "discovered" and not disc["steerable"] and len(disc["top_tokens"]) == 15


@pytest.mark.parity
def test_top_tokens_on_fresh_random_weights(tmp_path: Path, seed: int) -> None:
    """A fresh oracle's weights (both heads): known concepts against concept_top_tokens itself,
    discovered ones against the same projection of the oracle's own factorized embedding."""
    cfg = TINY.replace(n_layers=2, n_known=40, n_discovered=70, pad_multiple=16)
    oracle = build_oracle(cfg, seed)
    cfg.save(tmp_path)
    save_checkpoint(oracle.state_dict(), tmp_path)
    gen, oracle = public_generator(tmp_path)
    backend = SteeringBackend(tmp_path)
    for cid in (0, 13, 39):
        ids, scores = backend.top_tokens(cid, 20)
        assert_same_ranking(list(zip(ids, scores)), [(int(t), s) for t, s in gen.concept_top_tokens(cid, k=20)])
    with torch.no_grad():
        for j in (0, 33, 69):
            emb = oracle.unknown_head._get_embedding(torch.tensor([j])).float()[0]
            emb = emb / (emb.norm() + 1e-12)
            values, idx = (oracle.transformer.lm_head.weight.float() @ emb).topk(20)
            ids, scores = backend.top_tokens(cfg.n_known + j, 20)
            assert_same_ranking(list(zip(ids, scores)), list(zip(idx.tolist(), values.tolist()))), seed


@pytest.mark.parametrize("path, status, param", [
    ("/v1/concepts/144", 404, "concept_id"), ("/v1/concepts/4000000", 404, "concept_id"),
    ("/v1/concepts/ocean", 400, "concept_id"), ("/v1/concepts/-1", 400, "concept_id"),
    ("/v1/concepts/0?top_tokens=101", 400, "top_tokens"), ("/v1/concepts/0?top_tokens=-1", 400, "top_tokens"),
    ("/v1/concepts/0?top_tokens=all", 400, "top_tokens")])
def test_bad_concept_requests(client: httpx.Client, path: str, status: int, param: str) -> None:
    r = client.get(path)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param, r.text


def test_steering_service_list_and_describe_bounds(services: Services) -> None:
    """The gRPC face refuses what the gateway would, with the bound in the message."""
    import grpc

    from cde.rpc import channel_options
    from cde.rpc.v1 import steering_pb2_grpc

    async def main() -> None:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{services.steering.port}", options=channel_options()) as ch:
            stub = steering_pb2_grpc.SteeringStub(ch)
            ok = await stub.ListConcepts(steering_pb2.ListConceptsRequest(limit=limits.LIST_LIMIT_MAX))
            assert len(ok.concepts) == 144 and not ok.has_more
            ok = await stub.DescribeConcept(steering_pb2.DescribeConceptRequest(
                concept_id=3, top_tokens=limits.TOP_TOKENS_MAX))
            assert len(ok.top_tokens) == limits.TOP_TOKENS_MAX and ok.concept.name == "mountain"
            bad = [(stub.ListConcepts(steering_pb2.ListConceptsRequest(limit=limits.LIST_LIMIT_MAX + 1)), "limit"),
                   (stub.ListConcepts(steering_pb2.ListConceptsRequest(head="unknown")), "head"),
                   (stub.ListConcepts(steering_pb2.ListConceptsRequest(model="other")), "other"),
                   (stub.DescribeConcept(steering_pb2.DescribeConceptRequest(
                       concept_id=0, top_tokens=limits.TOP_TOKENS_MAX + 1)), "top_tokens"),
                   (stub.DescribeConcept(steering_pb2.DescribeConceptRequest(concept_id=144)), "144")]
            for call, text in bad:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await call
                assert err.value.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND)
                assert text in err.value.details(), err.value.details()
    services.run(main())


def test_causal_model_keeps_refusing_the_catalog(services: Services) -> None:
    with httpx.Client(base_url=services.causal.base_url, timeout=30) as c:
        for path, params in (("/v1/concepts", {}), ("/v1/concepts", {"q": "sea"}), ("/v1/concepts/0", {})):
            r = c.get(path, params=params)
            assert r.status_code == 400, r.text
            assert r.json()["error"]["param"] == "model" and "causal" in r.json()["error"]["message"]


# ---- names, search ranking and discovered entries (ConceptCatalog alone) ------------------------
SMALL_DIR = ROOT / "models" / "steerling-small"


def test_discovered_ids_resolve_with_or_without_the_bundle_file() -> None:
    from cde.steerling.catalog import DISCOVERED_FILE

    described = ConceptCatalog.load(SMALL_DIR, 1741, 2048)
    generic = ConceptCatalog.from_parquet(SMALL_DIR / "concept_labels.parquet", 1741, 2048)  # no descriptions
    assert len(described) == len(generic) == 1741 + 2048
    for cid in range(1741, 1741 + 2048):
        d, g = described.get(cid), generic.get(cid)
        assert d.head == g.head == "discovered" and not d.steerable and not g.steerable
        assert d.name.startswith(f"Discovered #{cid}: ") and g.name == f"Discovered #{cid}"
        assert g.label == f"Discovered: #{cid}" and d.label == "Discovered: " + d.name[len("Discovered "):]
    assert described.get(3789) is None and (SMALL_DIR / DISCOVERED_FILE).exists()
    page, more = generic.page(10, after=1745, head="discovered")
    assert [c.concept_id for c in page] == list(range(1746, 1756)) and more


def test_names_resolve_exact_then_unique_base_name() -> None:
    from cde.steerling.catalog import NameNotFound

    cat = ConceptCatalog.load(SMALL_DIR, 1741, 2048)
    assert cat.find_name("SEA").concept_id == 0
    assert cat.find_name("seafood").name == cat.by_name("Seafood (WordNet)").name == "seafood (WordNet)"
    assert cat.find_name("Discovered #2000").concept_id == 2000
    assert cat.find_name("music").name == "music (Empath)"   # the one steerable known "music"
    with pytest.raises(NameNotFound) as err:
        cat.find_name("plant")
    assert err.value.ambiguous and err.value.candidates == ["plant (WordNet)", "plant (Empath)"]
    with pytest.raises(NameNotFound) as err:
        cat.find_name("oceann")
    assert not err.value.ambiguous and "ocean (Empath)" in err.value.candidates and len(err.value.candidates) <= 5
    assert cat.by_name("plant") is None and cat.by_name("no such thing") is None


def test_search_ranks_names_above_substrings_inside_words() -> None:
    cat = ConceptCatalog.load(SMALL_DIR, 1741, 2048)
    sea = [c.name for c in cat.search("sea", 20)]
    assert sea[0] == "sea" and "disease (Roget 655)" not in sea[:5], sea
    known = [c.name for c in cat.search("sea", 20, known_only=True)]
    assert known[:4] == ["sea", "seagull", "seashell", "seafood (WordNet)"], known   # exact, then word prefixes
    assert known.index("disease (Roget 655)") > 3
    music = [c.name for c in cat.search("Music", 5, known_only=True)]
    assert music[:2] == ["music (Empath)", "music (Roget 415)"], music              # base names first
