"""The public gRPC API: cde.v1.Generation, a thin shell over gateway.pipeline.

Validation and translation are the pipeline's, so a REST request and the same gRPC request
produce the same SubmitRequest and the same BlockEvents. Failures abort with the GatewayError's
gRPC code (the scheduler's retry hint travels on as `retry-after-ms` trailing metadata), and the
client's deadline is passed on to the scheduler. A request message that does not parse is
INVALID_ARGUMENT (`cde.rpc.malformed.MalformedRequestInterceptor`, on every cde server), not
grpcio's default UNKNOWN.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from cde.rpc.v1 import common_pb2, generate_pb2, generate_pb2_grpc
from gateway.auth import ApiKeyAuth
from gateway.errors import GatewayError, clip_message, grpc_message
from gateway.logprobs import Scoring, chat_ask
from gateway.pipeline import Pipeline
from gateway.stream import GenerationStream


async def _attach_logprobs(block: generate_pb2.BlockEvent, scoring: Scoring) -> None:
    """The block's tokens scored after those of the blocks before it (one Score call per block)."""
    block.logprobs.extend(await scoring.output_scores(list(block.tokens)))


class GenerationService(generate_pb2_grpc.GenerationServicer):
    def __init__(self, pipeline: Pipeline, auth: ApiKeyAuth | None = None) -> None:
        self.pipeline = pipeline
        self.auth = auth or ApiKeyAuth(())

    def _authorize(self, context: grpc.aio.ServicerContext) -> None:
        if self.auth.enabled:
            md = dict(context.invocation_metadata() or ())
            self.auth.check(md.get("authorization"))

    async def _abort(self, context: grpc.aio.ServicerContext, e: GatewayError) -> None:
        self.pipeline.metrics.failed(e.http_status)
        await context.abort(e.code, clip_message(grpc_message(e.message, e.param)), trailing_metadata=e.trailing_metadata())

    async def _relay(self, stream: GenerationStream, context: grpc.aio.ServicerContext,
                     scoring: Scoring | None = None) -> AsyncIterator[generate_pb2.GenerateResponse]:
        try:
            async for ev in stream:
                if ev.WhichOneof("event") == "finished" and ev.finished.reason == common_pb2.FINISH_REASON_ERROR:
                    yield ev  # the Finished(ERROR) message says what went wrong; the stream itself ends OK
                    return
                if scoring is not None and ev.WhichOneof("event") == "block":
                    await _attach_logprobs(ev.block, scoring)
                yield ev
        except GatewayError as e:
            await self._abort(context, e)
        finally:
            stream.close()  # the client cancelled or we are done: cancel the scheduler call

    async def Generate(self, request: generate_pb2.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[generate_pb2.GenerateResponse]:
        try:
            self._authorize(context)
            prepared = await self.pipeline.prepare(request)
            ask = chat_ask(request.logprobs, request.top_logprobs, self.pipeline.model.causal)
            scoring = None
            if ask is not None and ask.in_band:   # block diffusion: the blocks bring them
                prepared.submit.top_logprobs = ask.top
            elif ask is not None:
                scoring = self.pipeline.scoring(ask, prepared)
            stream = self.pipeline.open(prepared, client_remaining=context.time_remaining())
        except GatewayError as e:
            await self._abort(context, e)
            return
        async for ev in self._relay(stream, context, scoring):
            yield ev

    async def Resume(self, request: common_pb2.ResumeRequest,
                     context: grpc.aio.ServicerContext) -> AsyncIterator[generate_pb2.GenerateResponse]:
        try:
            self._authorize(context)
            stream = self.pipeline.resume(request, client_remaining=context.time_remaining())
        except GatewayError as e:
            await self._abort(context, e)
            return
        async for ev in self._relay(stream, context):
            yield ev

    async def Cancel(self, request: common_pb2.CancelRequest,
                     context: grpc.aio.ServicerContext) -> common_pb2.CancelResponse:
        try:
            self._authorize(context)
            return await self.pipeline.cancel(request.request_id)
        except GatewayError as e:
            await self._abort(context, e)
            raise  # unreachable: abort raises

    async def AttributeInputs(self, request: common_pb2.InputAttributionRequest, context: grpc.aio.ServicerContext):
        try:
            self._authorize(context)
            async for ev in self.pipeline.attribute_inputs(request):
                yield ev
        except GatewayError as e:
            await self._abort(context, e)

    async def ListModels(self, request: generate_pb2.ListModelsRequest,
                         context: grpc.aio.ServicerContext) -> generate_pb2.ListModelsResponse:
        try:
            self._authorize(context)
        except GatewayError as e:
            await self._abort(context, e)
        return self.pipeline.list_models()

    async def SearchConcepts(self, request: common_pb2.SearchConceptsRequest,
                             context: grpc.aio.ServicerContext) -> common_pb2.SearchConceptsResponse:
        try:
            self._authorize(context)
            return await self.pipeline.search_concepts(request)
        except GatewayError as e:
            await self._abort(context, e)
            raise
