"""The steering service's model-side state and rules, free of gRPC plumbing.

`SteeringBackend` holds the concept catalog and four checkpoint tensors, all memory-mapped
views (`CheckpointReader.get` is zero-copy on CPU): the known concepts' embeddings (a request
touches only its own rows), the tied token embedding = LM head (alpha normalization, the
suppress relu mask and a concept's top tokens need all of it) and the discovered head's two
factors (rank r, for discovered concepts' top tokens). The transformer is never loaded, so the
service starts in seconds and stays small even for Steerling-8B.

Every public method takes and returns cde.v1 messages and raises `RequestError` with the
gRPC status the caller must answer; the servicer only translates.
"""

from __future__ import annotations

import dataclasses
import math
import threading
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

# Bounds and defaults: cde.limits (the gateway checks the same ones first). Search limits above
# the maximum are clamped: a search answer is for people, not bulk export.

_SCHEDULES = {"fixed": common_pb2.STEERING_SCHEDULE_FIXED, "hard_cutoff": common_pb2.STEERING_SCHEDULE_HARD_CUTOFF}
_SCHEDULE_OVERRIDES = {common_pb2.STEERING_SCHEDULE_FIXED: "fixed",
                       common_pb2.STEERING_SCHEDULE_HARD_CUTOFF: "hard_cutoff"}


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
        query = request.query.strip()
        if not query:
            raise _invalid("query must not be empty")
        if len(request.query) > L.SEARCH_QUERY_MAX_CHARS:
            raise _invalid(f"query is {len(request.query)} characters; at most {L.SEARCH_QUERY_MAX_CHARS}")
        limit = min(request.limit or L.DEFAULT_SEARCH_LIMIT, L.SEARCH_LIMIT_MAX)
        hits = self.catalog.search(query, limit, request.known_only)
        return common_pb2.SearchConceptsResponse(concepts=[concept_message(c) for c in hits])

    def list_concepts(self, request: steering_pb2.ListConceptsRequest) -> steering_pb2.ListConceptsResponse:
        self.check_model(request.model)
        limit = request.limit or L.DEFAULT_LIST_LIMIT
        if limit > L.LIST_LIMIT_MAX:
            raise _invalid(f"limit {limit} is outside [1, {L.LIST_LIMIT_MAX}]")
        if request.head and request.head not in HEADS:
            raise _invalid(f"head {request.head!r} is not one of {', '.join(HEADS)}")
        concepts, more = self.catalog.page(
            limit, request.after if request.HasField("after") else None, request.head or None,
            request.group_id if request.HasField("group_id") else None,
            request.steerable if request.HasField("steerable") else None)
        return steering_pb2.ListConceptsResponse(concepts=[concept_message(c) for c in concepts], has_more=more)

    def describe(self, request: steering_pb2.DescribeConceptRequest) -> steering_pb2.ConceptDetail:
        """The concept and its top tokens; reads the whole LM head (callers keep it off the event loop)."""
        self.check_model(request.model)
        k = request.top_tokens if request.HasField("top_tokens") else L.DEFAULT_TOP_TOKENS
        if k > L.TOP_TOKENS_MAX:
            raise _invalid(f"top_tokens {k} is outside [0, {L.TOP_TOKENS_MAX}]")
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
        """Known-concept ids and their direction weights, in request order; raises RequestError."""
        if not steering.concepts:
            raise _invalid("steering needs at least one concept", "steering.concepts")
        if len(steering.concepts) > L.MAX_CONCEPTS:
            raise _invalid(f"{len(steering.concepts)} concepts; at most {L.MAX_CONCEPTS}", "steering.concepts")
        ids: list[int] = []
        weights: list[float] = []
        for i, sc in enumerate(steering.concepts):
            ref = sc.WhichOneof("ref")
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
            # 0 is the proto default: unset, i.e. the default strength
            if not math.isfinite(sc.strength) or not 0.0 <= sc.strength <= L.STRENGTH_MAX:
                raise _invalid(f"concept {asked}: strength {sc.strength} is outside (0, {L.STRENGTH_MAX:g}]",
                               f"steering.concepts[{i}].strength")
            ids.append(c.concept_id)
            weights.append(sc.strength or L.DEFAULT_STRENGTH)
        return ids, weights

    def spec(self, steering: common_pb2.SteeringRequest) -> tuple[SteeringSpec, list[float]]:
        """The SteeringSpec a request means, with one relative direction weight per spec concept.

        The largest strength becomes the spec's `strength` (the magnitude: alpha times it), the
        strengths over it weight the direction (cde.steerling.steering's module docstring)."""
        ids, strengths = self.resolve(steering)
        scale = max(strengths)
        weights = [w / scale for w in strengths]
        target = None
        if steering.HasField("target"):
            target = steering.target
            if not math.isfinite(target) or abs(target) > L.TARGET_ABS_MAX:
                raise _invalid(f"target {target} is outside [-{L.TARGET_ABS_MAX:g}, {L.TARGET_ABS_MAX:g}]",
                               "steering.target")
        amplify = steering.mode == common_pb2.STEERING_MODE_AMPLIFY
        layer = L.default_inject_layer(self.cfg.n_layers, amplify)
        if steering.HasField("inject_layer"):
            layer = steering.inject_layer
            lo, hi = L.inject_layer_bounds(self.cfg.n_layers)
            if not lo <= layer <= hi:
                raise _invalid(f"inject_layer {layer} is outside [{lo}, {hi}]", "steering.inject_layer")
        cutoff = L.DEFAULT_CUTOFF
        if steering.HasField("cutoff_tokens"):
            cutoff = steering.cutoff_tokens
            if not L.CUTOFF_MIN <= cutoff <= L.CUTOFF_MAX:
                raise _invalid(f"cutoff_tokens {cutoff} is outside [{L.CUTOFF_MIN}, {L.CUTOFF_MAX}]", "steering.cutoff")
        if steering.schedule != common_pb2.STEERING_SCHEDULE_DEFAULT and steering.schedule not in _SCHEDULE_OVERRIDES:
            raise _invalid(f"unknown steering schedule {steering.schedule}", "steering.schedule")

        if amplify:
            spec = SteeringSpec.amplify(ids, L.AMPLIFY_TARGET if target is None else target, layer, cutoff)
        elif steering.mode == common_pb2.STEERING_MODE_SUPPRESS:
            focal, given = ids[0], dict(zip(ids, weights))
            group = list(dict.fromkeys(ids[1:] + self.catalog.group_neighbours(focal)))
            spec = SteeringSpec.suppress(focal, group, L.SUPPRESS_TARGET if target is None else target, layer)
            spec = dataclasses.replace(spec, cutoff_tokens=cutoff)
            weights = [given.get(c, given[focal]) for c in spec.concept_ids]  # neighbours weigh as the focal concept
        else:
            raise _invalid(f"unknown steering mode {steering.mode}", "steering.mode")
        spec = dataclasses.replace(spec, strength=scale)
        if steering.schedule != common_pb2.STEERING_SCHEDULE_DEFAULT:
            spec = dataclasses.replace(spec, schedule=_SCHEDULE_OVERRIDES[steering.schedule])
        return spec, weights

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
