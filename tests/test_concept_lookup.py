"""Every concept id an attribution can return resolves, and names resolve by base name, through a
real steering_svc (grpc.aio on loopback) on the trained steerling-small bundle.

steerling-small ships `discovered_concepts.parquet` (train/describe_discovered.py): its discovered
concepts are gettable by id, listed with head=discovered (paged) and described with their top
tokens; a bundle without the file still resolves every discovered id to a generic entry.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pyarrow.parquet as pq
import pytest

from cde.rpc import channel_options
from cde.rpc.v1 import common_pb2, steering_pb2, steering_pb2_grpc
from cde.steerling.catalog import DISCOVERED_FILE
from cde.steerling.config import SteerlingConfig
from gateway.resolve import resolved_steering
from steering_svc import service as steering_service

pytestmark = pytest.mark.contract

ROOT = Path(__file__).resolve().parents[1]
SMALL = ROOT / "models" / "steerling-small"


class Steering:
    """A real steering server on its own event loop thread, and a blocking client stub."""

    def __init__(self, model_dir: Path) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server = self.run(steering_service.build_server(model_dir, "127.0.0.1", 0))
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.server.port}", options=channel_options())
        self.stub = steering_pb2_grpc.SteeringStub(self.channel)

    def run(self, coro: Any, timeout: float = 60) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.channel.close()
        self.run(self.server.stop(None))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()


@pytest.fixture(scope="module")
def small() -> Iterator[Steering]:
    s = Steering(SMALL)
    try:
        yield s
    finally:
        s.close()


@pytest.fixture(scope="module")
def cfg() -> SteerlingConfig:
    return SteerlingConfig.load(SMALL)


def code_of(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value.code(), err.value.details()


def steer(*concepts: common_pb2.SteeringConcept) -> steering_pb2.BuildSteeringRequest:
    """An amplify request as the gateway sends it: every default filled in."""
    request = common_pb2.SteeringRequest(concepts=list(concepts), mode=common_pb2.STEERING_MODE_AMPLIFY)
    return steering_pb2.BuildSteeringRequest(steering=resolved_steering(request, SteerlingConfig.load(SMALL).n_layers))


def test_every_discovered_id_resolves_lists_and_describes(small: Steering, cfg: SteerlingConfig) -> None:
    shipped = {r["concept_id"]: r for r in pq.read_table(SMALL / DISCOVERED_FILE).to_pylist()}
    ids = range(cfg.n_known, cfg.n_known + cfg.n_discovered)
    assert set(shipped) == set(ids)
    assert (SMALL / DISCOVERED_FILE).stat().st_size < 2_000_000
    for cid in ids:
        c = small.stub.GetConcept(steering_pb2.GetConceptRequest(concept_id=cid))
        assert c.id == cid and c.head == "discovered" and not c.steerable, c
        assert c.name == shipped[cid]["concept_name"] and c.name.startswith(f"Discovered #{cid}: "), c.name
        assert "Top tokens through the LM head" in c.description
    # head=discovered, a page at a time, is exactly these ids in order
    listed, after = [], None
    while True:
        req = steering_pb2.ListConceptsRequest(head="discovered", limit=300)
        if after is not None:
            req.after = after
        page = small.stub.ListConcepts(req)
        listed += [c.id for c in page.concepts]
        assert all(c.head == "discovered" and c.name.startswith("Discovered #") for c in page.concepts)
        if not page.has_more:
            break
        after = page.concepts[-1].id
    assert listed == list(ids)
    # describe: the top tokens through the LM head, the same ones the bundle's file names
    for cid in (cfg.n_known, 2253, cfg.n_known + cfg.n_discovered - 1):
        d = small.stub.DescribeConcept(steering_pb2.DescribeConceptRequest(concept_id=cid, top_tokens=10))
        assert d.concept.id == cid and len(d.top_tokens) == 10
        assert [t.token_id for t in d.top_tokens] == shipped[cid]["top_token_ids"]
        assert [t.score for t in d.top_tokens] == pytest.approx(shipped[cid]["top_token_scores"], abs=1e-4)
    # ids past the discovered head are still NOT_FOUND
    code, msg = code_of(lambda: small.stub.GetConcept(steering_pb2.GetConceptRequest(
        concept_id=cfg.n_known + cfg.n_discovered)))
    assert code == grpc.StatusCode.NOT_FOUND and "0..3788" in msg, msg


def test_discovered_concepts_never_steer(small: Steering) -> None:
    name = small.stub.GetConcept(steering_pb2.GetConceptRequest(concept_id=2253)).name
    for ref in (common_pb2.SteeringConcept(concept_id=2253), common_pb2.SteeringConcept(name=name),
                common_pb2.SteeringConcept(name="discovered #2253")):
        code, msg = code_of(lambda ref=ref: small.stub.BuildSteering(steer(ref)))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "only known concepts can steer" in msg, msg


def test_names_resolve_by_exact_then_unique_base_name(small: Steering) -> None:
    def get(name: str) -> common_pb2.Concept:
        return small.stub.GetConcept(steering_pb2.GetConceptRequest(name=name))

    assert get("sea").id == 0                                  # exact
    assert get("Music (Empath)").name == "music (Empath)"      # exact, any case
    assert get("seafood").name == "seafood (WordNet)"          # unique base name
    assert get("  SEAFOOD ").name == "seafood (WordNet)"
    assert get("discovered #2253").id == 2253                   # a discovered concept's base name
    # "music" is "music (Empath)" and the unsteerable "music (Roget 415)": the one steerable
    # known concept wins; "plant" is two steerable concepts: NOT_FOUND naming both
    for name in ("music", "ocean"):
        assert get(name).name == f"{name} (Empath)"
    code, msg = code_of(lambda: get("plant"))
    assert code == grpc.StatusCode.NOT_FOUND and "ambiguous" in msg, msg
    assert "'plant (WordNet)'" in msg and "'plant (Empath)'" in msg, msg
    code, msg = code_of(lambda: get("musc"))
    assert code == grpc.StatusCode.NOT_FOUND and "closest names" in msg and "'music (Empath)'" in msg, msg
    # steering takes the same names: a base name steers, an ambiguous one is NOT_FOUND with candidates
    prepared = small.stub.BuildSteering(steer(common_pb2.SteeringConcept(name="seafood")))
    assert list(prepared.concept_ids) == [get("seafood (WordNet)").id]
    prepared = small.stub.BuildSteering(steer(common_pb2.SteeringConcept(name="Music (Empath)")))
    assert list(prepared.concept_ids) == [get("music (Empath)").id]
    prepared = small.stub.BuildSteering(steer(common_pb2.SteeringConcept(name="music")))
    assert list(prepared.concept_ids) == [get("music (Empath)").id]
    code, msg = code_of(lambda: small.stub.BuildSteering(steer(common_pb2.SteeringConcept(name="plant"))))
    assert code == grpc.StatusCode.NOT_FOUND and "'plant (Empath)'" in msg, msg


def test_search_ranks_exact_and_base_names_first(small: Steering) -> None:
    def names(q: str, **kw: Any) -> list[str]:
        resp = small.stub.SearchConcepts(common_pb2.SearchConceptsRequest(query=q, limit=20, **kw))
        return [c.name for c in resp.concepts]

    sea = names("sea")
    assert sea[0] == "sea" and "disease (Roget 655)" not in sea[:5], sea
    assert sea.index("seafood (WordNet)") < sea.index("disease (Roget 655)") if "disease (Roget 655)" in sea else True
    music = names("music", known_only=True)
    assert set(music[:2]) == {"music (Empath)", "music (Roget 415)"}, music   # base-name matches first
    assert music[2:4] == ["musical composition (WordNet)", "musical (Empath)"], music  # then word prefixes


def test_a_bundle_without_descriptions_still_resolves_every_discovered_id(tmp_path: Path, cfg: SteerlingConfig) -> None:
    for f in SMALL.iterdir():
        if f.name != DISCOVERED_FILE:
            (tmp_path / f.name).symlink_to(f)
    bare = Steering(tmp_path)
    try:
        for cid in (cfg.n_known, 2253, cfg.n_known + cfg.n_discovered - 1):
            c = bare.stub.GetConcept(steering_pb2.GetConceptRequest(concept_id=cid))
            assert (c.name, c.head, c.steerable) == (f"Discovered #{cid}", "discovered", False), c
            d = bare.stub.DescribeConcept(steering_pb2.DescribeConceptRequest(concept_id=cid, top_tokens=5))
            assert len(d.top_tokens) == 5
        page = bare.stub.ListConcepts(steering_pb2.ListConceptsRequest(head="discovered", limit=500))
        assert [c.id for c in page.concepts] == list(range(cfg.n_known, cfg.n_known + 500)) and page.has_more
        code, msg = code_of(lambda: bare.stub.BuildSteering(steer(common_pb2.SteeringConcept(concept_id=2253))))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "only known concepts can steer" in msg, msg
    finally:
        bare.close()
