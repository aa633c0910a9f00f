"""The gateway's generation path, shared by REST and the public gRPC API.

`Pipeline` is a `RequestResolver` (gateway/resolve.py: a public request -> the scheduler's
SubmitRequest) that also opens the scheduler streams (`open`, `resume`: gateway/stream.py's
`GenerationStream`), tells the scheduler when a client left (`detach`) and forwards the unary
calls (cancel, the concept catalog). Both front ends call the same methods, so the two APIs
validate alike and stream the same blocks by construction.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
import uuid

import grpc

from cde import limits as L
from cde.rpc.v1 import common_pb2, generate_pb2, scheduler_pb2, steering_pb2
from gateway.backends import Backends
from gateway.detok import BlockDetokenizer
from gateway.errors import from_rpc_error, invalid
from gateway.logprobs import LogprobsAsk, Scoring
from gateway.metrics import GatewayMetrics, RequestTimer
from gateway.resolve import Limits, ModelCard, Prepared, RequestResolver, limit_errors_as_invalid
from gateway.stream import GenerationStream, Reattach, attach_metadata

log = logging.getLogger("gateway.pipeline")


# a REST field of InputAttributionRequest opening a refusal or one of its clauses
_INPUT_ATTRIBUTION_FIELD = re.compile(r"(?:^|: )(request_id|positions|chunk\.start|chunk\.end|n_steps): ")


class Pipeline(RequestResolver):
    def __init__(self, model: ModelCard, backends: Backends, limits: Limits, metrics: GatewayMetrics) -> None:
        super().__init__(model, backends, limits)
        self.metrics = metrics
        # Stopping (SIGTERM): streams cut now did not lose their client by its own doing, so they
        # send no Detach; the scheduler's grace leaves their clients time to Resume elsewhere.
        self.closing = False
        self._detaching: set[asyncio.Task] = set()

    # ---- streams ----------------------------------------------------------------------------
    def open(self, prepared: Prepared, timer: RequestTimer | None = None,
             client_remaining: float | None = None) -> GenerationStream:
        timeout = self._timeout(client_remaining)
        attach_id = uuid.uuid4().hex
        call = self.backends.scheduler.Submit(prepared.submit, timeout=timeout, metadata=attach_metadata(attach_id))
        opened_at = time.perf_counter()
        self.metrics.prompt_tokens.labels(self.model.id).inc(prepared.prompt_tokens)
        return GenerationStream(call, BlockDetokenizer(self.model.tokenizer, prepared.submit.options.stop_ids),
                                timer or self.metrics.request(), prepared.seed, prepared.prompt_tokens,
                                isd=self.model.causal, request_id=prepared.submit.request_id,
                                reattach=self._reattach(timeout, prepared.submit, attach_id), opened_at=opened_at,
                                attach_id=attach_id, on_detach=self.detach)

    def resume(self, req: common_pb2.ResumeRequest, client_remaining: float | None = None) -> GenerationStream:
        if not req.request_id:
            raise invalid("request_id is required", "request_id")
        # Replay from the first block and only prime the detokenizer with the blocks the client
        # already has: a character split across the resume point then decodes as it did in the
        # original stream (a fresh decoder would print U+FFFD for its tail bytes).
        timeout = self._timeout(client_remaining)
        attach_id = uuid.uuid4().hex
        call = self.backends.scheduler.Resume(common_pb2.ResumeRequest(request_id=req.request_id), timeout=timeout,
                                              metadata=attach_metadata(attach_id))
        return GenerationStream(call, BlockDetokenizer(self.model.tokenizer), self.metrics.request(), 0, 0,
                                skip_through=req.after_block if req.HasField("after_block") else None,
                                isd=self.model.causal, request_id=req.request_id,
                                reattach=self._reattach(timeout, None, attach_id),
                                attach_id=attach_id, on_detach=self.detach)

    def detach(self, request_id: str, attach_id: str) -> None:
        """Tell the scheduler (in the background) that the client of stream ``attach_id`` left."""
        if self.closing or not request_id:
            return
        task = asyncio.get_running_loop().create_task(self._send_detach(request_id, attach_id))
        self._detaching.add(task)
        task.add_done_callback(self._detaching.discard)

    async def flush_detaches(self, timeout: float) -> None:
        """Wait (bounded) for the Detaches in flight, before the channels close."""
        if self._detaching:
            await asyncio.wait(set(self._detaching), timeout=timeout)

    def _timeout(self, client_remaining: float | None) -> float | None:
        t = self.limits.request_timeout_s
        if client_remaining is not None:
            t = client_remaining if t is None else min(t, client_remaining)
        return t

    def _reattach(self, timeout: float | None, submit: scheduler_pb2.SubmitRequest | None,
                  attach_id: str) -> Reattach:
        return Reattach(self.backends.scheduler, self.backends.scheduler_channel, submit,
                        None if timeout is None else time.monotonic() + timeout, self.limits.reattach_s,
                        attach_id)

    async def _send_detach(self, request_id: str, attach_id: str) -> None:
        try:
            await self.backends.scheduler.Detach(scheduler_pb2.DetachRequest(request_id=request_id, attach_id=attach_id),
                                                 timeout=self.limits.backend_timeout_s)
        except grpc.aio.AioRpcError as e:   # the scheduler's detach grace cancels it later instead
            log.warning("request %s: Detach failed (%s: %s)", request_id, e.code().name, e.details())

    # ---- input attribution -------------------------------------------------------------------
    def _check_input_attribution(self, req: common_pb2.InputAttributionRequest) -> None:
        """What the gateway can check before the scheduler: 400 naming the field."""
        if self.model.causal:
            raise invalid(f"model '{self.model.id}' is a causal LM: input attribution explains block-diffusion "
                          "generations", "request_id")
        if not req.request_id:
            raise invalid("request_id is required", "request_id")
        if req.n_steps > L.IG_STEPS_MAX:
            raise invalid(f"n_steps must be in [1, {L.IG_STEPS_MAX}] (0 or unset: {L.DEFAULT_IG_STEPS})", "n_steps")
        if len(req.positions) > L.INPUT_TARGETS_MAX:
            raise invalid(f"at most {L.INPUT_TARGETS_MAX} positions per call; got {len(req.positions)}", "positions")
        if not req.positions and req.chunk_end <= req.chunk_start:
            raise invalid("give positions, or a chunk with end > start", "positions")

    async def attribute_inputs(self, req: common_pb2.InputAttributionRequest):
        """The scheduler's stream of input-attribution events (progress, targets, summary)."""
        self._check_input_attribution(req)
        call = self.backends.scheduler.AttributeInputs(req, timeout=self.limits.request_timeout_s)
        try:
            async for ev in call:
                yield ev
        except grpc.aio.AioRpcError as e:
            err = from_rpc_error(e, "scheduler")
            # the attribution tier names the field its refusal is about ("request '..': positions: ...")
            field = _INPUT_ATTRIBUTION_FIELD.search(err.message)
            if err.code == grpc.StatusCode.INVALID_ARGUMENT and field:
                err.param = field.group(1)
            raise err from None
        finally:
            call.cancel()

    # ---- unary ------------------------------------------------------------------------------
    async def cancel(self, request_id: str) -> common_pb2.CancelResponse:
        if not request_id:
            raise invalid("request_id is required", "request_id")
        try:
            return await self.backends.scheduler.Cancel(common_pb2.CancelRequest(request_id=request_id),
                                                        timeout=self.limits.backend_timeout_s)
        except grpc.aio.AioRpcError as e:
            raise from_rpc_error(e, "scheduler") from None

    async def search_concepts(self, req: common_pb2.SearchConceptsRequest) -> common_pb2.SearchConceptsResponse:
        self._check_catalog(req.model)
        with limit_errors_as_invalid():
            L.check_search(req.query, req.limit)
        fwd = common_pb2.SearchConceptsRequest(query=req.query.strip(), limit=req.limit or L.DEFAULT_SEARCH_LIMIT,
                                               known_only=req.known_only, model=self.model.id)
        try:
            return await self.backends.steering.SearchConcepts(fwd, timeout=self.limits.backend_timeout_s)
        except grpc.aio.AioRpcError as e:
            raise from_rpc_error(e, "steering service") from None

    async def list_concepts(self, req: steering_pb2.ListConceptsRequest) -> steering_pb2.ListConceptsResponse:
        """One page of the catalog (bounds checked here, before they go into uint32 fields upstream)."""
        self._check_catalog(req.model)
        with limit_errors_as_invalid():
            L.check_list_limit(req.limit)
        fwd = steering_pb2.ListConceptsRequest()
        fwd.CopyFrom(req)
        fwd.model, fwd.limit = self.model.id, req.limit or L.DEFAULT_LIST_LIMIT
        try:
            return await self.backends.steering.ListConcepts(fwd, timeout=self.limits.backend_timeout_s)
        except grpc.aio.AioRpcError as e:
            raise from_rpc_error(e, "steering service") from None

    async def describe_concept(self, concept_id: int, top_tokens: int) -> steering_pb2.ConceptDetail:
        """A concept and its `top_tokens` most promoted vocabulary tokens; 404 for an unknown id."""
        self._check_catalog()
        with limit_errors_as_invalid():
            L.check_top_tokens(top_tokens)
        try:
            return await self.backends.steering.DescribeConcept(steering_pb2.DescribeConceptRequest(
                concept_id=concept_id, model=self.model.id, top_tokens=top_tokens),
                timeout=self.limits.backend_timeout_s)
        except grpc.aio.AioRpcError as e:
            err = from_rpc_error(e, "steering service")
            if err.code == grpc.StatusCode.NOT_FOUND:
                err.param, err.err_code = "concept_id", "concept_not_found"
            raise err from None

    def scoring(self, ask: LogprobsAsk, prepared: Prepared) -> Scoring:
        """The Score calls that answer a prepared request's logprobs (through the scheduler)."""
        return Scoring(self.backends.scheduler, self.model.id, ask, list(prepared.submit.prompt_tokens), prepared.seed,
                       self.limits.request_timeout_s or self.limits.backend_timeout_s)

    def list_models(self) -> generate_pb2.ListModelsResponse:
        return generate_pb2.ListModelsResponse(models=[self.model.info()])

    def _check_catalog(self, model: str = "") -> None:
        self.check_model(model)
        if self.model.causal:
            raise invalid(f"model '{self.model.id}' is a causal LM without concepts", "model")
