"""The steering service's model-side state and rules, free of gRPC plumbing.

`SteeringBackend` holds the concept catalog and four checkpoint tensors, all memory-mapped
views (`CheckpointReader.get` is zero-copy on CPU): the known concepts' embeddings (a request
touches only its own rows), the tied token embedding = LM head (alpha normalization, the
suppress relu mask and a concept's top tokens need all of it) and the discovered head's two
factors (rank r, for discovered concepts' top tokens). The transformer is never loaded, so the
service starts in seconds and stays small even for Steerling-8B.

Steering requests arrive resolved (the gateway fills every default: gateway.resolve.
resolved_steering), so an unset target, inject_layer or cutoff, a strength of 0 or the DEFAULT
schedule is refused rather than defaulted. Bounds are cde.limits' check functions, the ones the
gateway applies. Every public method takes and returns cde.v1 messages and raises
`RequestError` with the gRPC status the caller must answer; the servicer only translates.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import torch

from cde import limits as L
from cde.checkpoint import CheckpointError, CheckpointReader
from cde.rpc import floats_to_bytes
from cde.rpc.v1 import common_pb2, steering_pb2
from cde.steerling.catalog import HEADS, Concept, ConceptCatalog, NameNotFound
from cde.steerling.config import SteerlingConfig
from cde.steerling.loading import embedding_name
from cde.steerling.steering import SteeringSpec, prepare

KNOWN_EMBEDDING = "known_head.concept_embedding.weight"
TOKEN_EMBEDDING = "transformer.tok_emb.weight"  # tied with the LM head
DISC_COEF = "unknown_head.embedding_coef.weight"    # discovered embedding = basis(coef[j])
DISC_BASIS = "unknown_head.embedding_basis.weight"
TOP_TOKEN_ROWS = 16384   # LM-head rows scored at once: bounds the fp32 temporary (8B: 256 MiB)

_SCHEDULES = {"fixed": common_pb2.STEERING_SCHEDULE_FIXED, "hard_cutoff": common_pb2.STEERING_SCHEDULE_HARD_CUTOFF}
_SCHEDULE_NAMES = {value: name for name, value in _SCHEDULES.items()}


class RequestError(Exception):
    """A request the service refuses, with the gRPC status code that says why and, where one
    field is at fault, its path in the public request (`steering.concepts[0].id`), which the
    servicer sends as the `cde-param` trailer."""

    def __init__(self, code: grpc.StatusCode, message: str, field: str | None = None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.field = field


PARAM_TRAILER = "cde-param"


def _invalid(message: str, field: str | None = None) -> RequestError:
    return RequestError(grpc.StatusCode.INVALID_ARGUMENT, message, field)


def _not_found(message: str) -> RequestError:
    return RequestError(grpc.StatusCode.NOT_FOUND, message)


@contextlib.contextmanager
def _limit_errors_as_invalid() -> Iterator[None]:
    """A cde.limits check that fails inside becomes INVALID_ARGUMENT naming the field."""
    try:
        yield
    except L.LimitError as e:
        raise _invalid(e.message, e.path) from None


def concept_message(c: Concept) -> common_pb2.Concept:
    msg = common_pb2.Concept(id=c.concept_id, name=c.name, head=c.head, description=c.description,
                             group_name=c.group_name, steerable=c.steerable)
    if c.group_id is not None:
        msg.group_id = c.group_id
    return msg


class SteeringBackend:
    """Catalog + memory-mapped steering tensors of one model directory."""

    def __init__(self, model_dir: str | Path):
        model_dir = Path(model_dir).resolve()
        self.model_name = model_dir.name
        self.cfg = SteerlingConfig.load(model_dir)
        self.catalog = ConceptCatalog.load(model_dir, self.cfg.n_known, self.cfg.n_discovered)
        self._reader = CheckpointReader(model_dir)
        self.known_embedding = self._reader.get(KNOWN_EMBEDDING)  # (n_known_padded, D) mmap view
        self.lm_weight = self._reader.get(embedding_name(self._reader))  # (V, D) mmap view, either spelling
        self.disc_coef = self._reader.get(DISC_COEF)              # (n_discovered_padded, r) mmap view
        self.disc_basis = self._reader.get(DISC_BASIS)            # (D, r) mmap view
        d, r = self.cfg.n_embd, self.cfg.factorize_rank
        for name, t, shape in ((KNOWN_EMBEDDING, self.known_embedding, (self.cfg.n_known_padded, d)),
                               (TOKEN_EMBEDDING, self.lm_weight, (self.cfg.vocab_size, d)),
                               (DISC_COEF, self.disc_coef, (self.cfg.n_discovered_padded, r)),
                               (DISC_BASIS, self.disc_basis, (d, r))):
            if tuple(t.shape) != shape:
                raise CheckpointError(f"{name}: expected shape {shape} from config.json, got {tuple(t.shape)}")
        # Building reads the whole LM head (and, for a bf16 checkpoint, makes an fp32 temporary of
        # it): one build at a time bounds that memory; the LRU cache in front makes repeats free.
        self._build_lock = threading.Lock()

    # ---- model selection ----------------------------------------------------------------
    def check_model(self, model: str) -> None:
        if model and model != self.model_name:
            raise _not_found(f"unknown model {model!r}; this service serves {self.model_name!r}")

    # ---- catalog ------------------------------------------------------------------------
    def search(self, request: common_pb2.SearchConceptsRequest) -> common_pb2.SearchConceptsResponse:
        self.check_model(request.model)
        with _limit_errors_as_invalid():
            L.check_search(request.query, request.limit)
        hits = self.catalog.search(request.query.strip(), request.limit or L.DEFAULT_SEARCH_LIMIT, request.known_only)
        return common_pb2.SearchConceptsResponse(concepts=[concept_message(c) for c in hits])

    def list_concepts(self, request: steering_pb2.ListConceptsRequest) -> steering_pb2.ListConceptsResponse:
        self.check_model(request.model)
        with _limit_errors_as_invalid():
            L.check_list_limit(request.limit)
        if request.head and request.head not in HEADS:
            raise _invalid(f"head {request.head!r} is not one of {', '.join(HEADS)}")
        concepts, more = self.catalog.page(
            request.limit or L.DEFAULT_LIST_LIMIT, request.after if request.HasField("after") else None, request.head or None,
            request.group_id if request.HasField("group_id") else None,
            request.steerable if request.HasField("steerable") else None)
        return steering_pb2.ListConceptsResponse(concepts=[concept_message(c) for c in concepts], has_more=more)

    def describe(self, request: steering_pb2.DescribeConceptRequest) -> steering_pb2.ConceptDetail:
        """The concept and its top tokens; reads the whole LM head (callers keep it off the event loop)."""
        self.check_model(request.model)
        k = request.top_tokens if request.HasField("top_tokens") else L.DEFAULT_TOP_TOKENS
        with _limit_errors_as_invalid():
            L.check_top_tokens(k)
        c = self._lookup("concept_id", request.concept_id, "")
        out = steering_pb2.ConceptDetail(concept=concept_message(c))
        if k:
            ids, scores = self.top_tokens(c.concept_id, k)
            out.top_tokens.extend(steering_pb2.ConceptTopToken(token_id=i, score=v) for i, v in zip(ids, scores))
        return out

    def concept_embedding(self, concept_id: int) -> torch.Tensor:
        """(D,) fp32 embedding of a known (dense row) or discovered (basis . coef row) concept."""
        if concept_id < self.cfg.n_known:
            return self.known_embedding[concept_id].float()
        j = concept_id - self.cfg.n_known
        return torch.nn.functional.linear(self.disc_coef[j].float(), self.disc_basis.float())

    def top_tokens(self, concept_id: int, k: int) -> tuple[list[int], list[float]]:
        """The k vocabulary rows with the largest LM-head alignment to the unit concept embedding,
        as the public package's `SteerlingGenerator.concept_top_tokens` computes it (every row of
        the head, padding rows included), scored in slices so no (V, D) fp32 copy is made."""
        emb = self.concept_embedding(concept_id)
        emb = emb / (emb.norm() + 1e-12)
        with self._build_lock:  # one full-head pass at a time, like build()
            scores = torch.cat([self.lm_weight[i:i + TOP_TOKEN_ROWS].float() @ emb
                                for i in range(0, self.lm_weight.shape[0], TOP_TOKEN_ROWS)])
        values, indices = scores.topk(min(k, scores.numel()))
        return indices.tolist(), values.tolist()

    def _lookup(self, which: str | None, concept_id: int, name: str) -> Concept:
        if which == "concept_id":
            c = self.catalog.get(concept_id)
            if c is None:
                raise _not_found(f"no concept with id {concept_id} in {self.model_name} "
                                 f"(ids 0..{self.cfg.n_known + self.cfg.n_discovered - 1})")
            return c
        if which == "name":
            # exact name, else a unique base name ("music" -> "music (Empath)"); discovered names
            # resolve too, so that steering by one is INVALID_ARGUMENT ("only known concepts can
            # steer") rather than a misleading NOT_FOUND
            try:
                return self.catalog.find_name(name)
            except NameNotFound as e:
                raise _not_found(f"{e.message} (in {self.model_name})") from None
        raise _invalid("a concept needs a concept_id or a name")

    def get_concept(self, request: steering_pb2.GetConceptRequest) -> common_pb2.Concept:
        self.check_model(request.model)
        return concept_message(self._lookup(request.WhichOneof("ref"), request.concept_id, request.name))

    # ---- steering -----------------------------------------------------------------------
    def resolve(self, steering: common_pb2.SteeringRequest) -> tuple[list[int], list[float]]:
        """Known-concept ids and their strengths, in request order; raises RequestError."""
        with _limit_errors_as_invalid():
            L.check_concept_count(len(steering.concepts))
        ids: list[int] = []
        strengths: list[float] = []
        for i, sc in enumerate(steering.concepts):
            ref = sc.WhichOneof("ref")
            with _limit_errors_as_invalid():
                L.check_concept(i, sc.name if ref == "name" else sc.concept_id if ref else None, None)
            field = f"steering.concepts[{i}].{'name' if ref == 'name' else 'id'}"
            try:
                c = self._lookup(ref, sc.concept_id, sc.name)
            except RequestError as e:
                e.field = e.field or field
                raise
            asked = repr(sc.name) if ref == "name" else f"id {sc.concept_id}"
            if c.head != "known":
                raise _invalid(f"concept {asked} is a discovered concept; only known concepts can steer", field)
            if not c.steerable:
                raise _invalid(f"concept {asked} ({c.name}) is not steerable", field)
            if c.concept_id in ids:
                raise _invalid(f"concept {asked} ({c.name}) is given twice", field)
            with _limit_errors_as_invalid():
                L.check_strength(i, sc.strength)
            ids.append(c.concept_id)
            strengths.append(sc.strength)
        return ids, strengths

    def spec(self, steering: common_pb2.SteeringRequest) -> tuple[SteeringSpec, list[float]]:
        """The SteeringSpec a resolved request means, with one relative direction weight per
        spec concept.

        The largest strength becomes the spec's `strength` (the magnitude: alpha times it), the
        strengths over it weight the direction (cde.steerling.steering's module docstring)."""
        ids, strengths = self.resolve(steering)
        scale = max(strengths)
        weights = [w / scale for w in strengths]
        for name, present in (("target", steering.HasField("target")),
                              ("inject_layer", steering.HasField("inject_layer")),
                              ("cutoff", steering.HasField("cutoff_tokens"))):
            if not present:
                raise _invalid(f"steering.{name} is required (the gateway resolves every steering default)",
                               f"steering.{name}")
        with _limit_errors_as_invalid():
            L.check_steering_settings(steering.target, steering.inject_layer, steering.cutoff_tokens,
                                      self.cfg.n_layers)
        schedule = _SCHEDULE_NAMES.get(steering.schedule)
        if schedule is None:
            raise _invalid(f"steering.schedule {steering.schedule} is not fixed or hard_cutoff (the gateway "
                           "resolves the default)", "steering.schedule")
        if steering.mode == common_pb2.STEERING_MODE_AMPLIFY:
            spec = SteeringSpec.amplify(ids, steering.target, steering.inject_layer, steering.cutoff_tokens)
        elif steering.mode == common_pb2.STEERING_MODE_SUPPRESS:
            focal, given = ids[0], dict(zip(ids, weights))
            group = list(dict.fromkeys(ids[1:] + self.catalog.group_neighbours(focal)))
            spec = SteeringSpec.suppress(focal, group, steering.target, steering.inject_layer)
            spec = dataclasses.replace(spec, cutoff_tokens=steering.cutoff_tokens)
            weights = [given.get(c, given[focal]) for c in spec.concept_ids]  # neighbours weigh as the focal concept
        else:
            raise _invalid(f"unknown steering mode {steering.mode}", "steering.mode")
        return dataclasses.replace(spec, strength=scale, schedule=schedule), weights

    def build(self, request) -> common_pb2.PreparedSteering:
        """BuildSteeringRequest -> PreparedSteering (fp32 vectors as little-endian bytes)."""
        self.check_model(request.model)
        spec, weights = self.spec(request.steering)
        rows = self.known_embedding[torch.tensor(spec.concept_ids, dtype=torch.long)]  # copies only these rows
        w = None if all(x == 1.0 for x in weights) else torch.tensor(weights, dtype=torch.float32)
        with self._build_lock:
            prepared = prepare(spec, rows, self.lm_weight, self.cfg.n_layers, dtype=torch.float32, weights=w)
        return common_pb2.PreparedSteering(
            direction_f32=floats_to_bytes(prepared.direction), base_alpha=prepared.base_alpha,
            inject_layer=prepared.inject_layer, schedule=_SCHEDULES[prepared.schedule],
            cutoff_tokens=prepared.cutoff_tokens,
            relu_mask_f32=floats_to_bytes(prepared.relu_mask) if prepared.relu_mask is not None else b"",
            concept_ids=list(spec.concept_ids), model=self.model_name)

    def tensor_names(self) -> tuple[str, ...]:
        """The checkpoint tensors this backend holds (tests check the transformer stays unloaded)."""
        return (KNOWN_EMBEDDING, TOKEN_EMBEDDING, DISC_COEF, DISC_BASIS)
