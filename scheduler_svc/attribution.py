"""Client side of attribution_svc: one Attribute stream per request, round-robin over replicas,
whose answers are added to each block before it is stored.

The service keeps a request's still-open chunk for the life of its stream, so a stream
that breaks is reopened on the next replica and first fed the request's earlier blocks
again (their answers are dropped): chunks may span blocks and must see all of them.
If no replica answers, the block goes out without attributions rather than stalling
generation (logged); the raw records are still stored with it.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Awaitable, Callable, Sequence

import grpc

from cde.rpc.internal_auth import internal_channel
from cde.rpc.v1 import attribution_pb2, attribution_pb2_grpc, common_pb2, scheduler_pb2

log = logging.getLogger("scheduler_svc.attribution")

CALL_TIMEOUT_S = 30.0


class AttributionPool:
    """Channels to the attribution replicas, handed out round-robin."""

    def __init__(self, addresses: Sequence[str]):
        self.addresses = [a for a in addresses if a]
        self._channels = [internal_channel(a) for a in self.addresses]
        self._stubs = [attribution_pb2_grpc.AttributionStub(c) for c in self._channels]
        self._next = itertools.count()

    def __len__(self) -> int:
        return len(self._stubs)

    def next_stub(self) -> attribution_pb2_grpc.AttributionStub:
        return self._stubs[next(self._next) % len(self._stubs)]

    async def close(self) -> None:
        for c in self._channels:
            await c.close()


def context_tokens(tokens: Sequence[int], stop_ids: set[int]) -> list[int]:
    """The block's tokens from its start, cut before the first stop token."""
    out: list[int] = []
    for t in tokens:
        if t in stop_ids:
            break
        out.append(t)
    return out


class AttributionSession:
    """One request's Attribute stream. ``history()`` returns the blocks already stored (to
    replay into a reopened stream)."""

    def __init__(self, pool: AttributionPool, request_id: str, model: str, mode: int, top_k: int,
                 stop_ids: set[int], history: Callable[[], Awaitable[list[common_pb2.BlockCommitted]]],
                 first_block: int = 0):
        self.pool = pool
        self.first_block = first_block   # absolute index of the request's block 0
        self.request_id = request_id
        self.model = model
        self.mode = mode
        self.top_k = top_k
        self.stop_ids = stop_ids
        self.history = history
        self._call = None
        self._streamed_upto = -1   # the last block the open stream was given (its chunk state follows it)

    def _request(self, block: common_pb2.BlockCommitted, last: bool) -> attribution_pb2.AttributeRequest:
        return attribution_pb2.AttributeRequest(
            request_id=self.request_id, model=self.model, block_index=block.block_index, mode=self.mode,
            top_k=self.top_k, records=block.records, start=block.start,
            context_tokens=context_tokens(block.tokens, self.stop_ids), last=last)

    async def _exchange(self, req: attribution_pb2.AttributeRequest) -> attribution_pb2.AttributeResponse:
        await self._call.write(req)
        resp = await asyncio.wait_for(self._call.read(), CALL_TIMEOUT_S)
        if resp is grpc.aio.EOF or resp.block_index != req.block_index:
            raise RuntimeError(f"attribution stream answered {resp!r} for block {req.block_index}")
        self._streamed_upto = req.block_index
        return resp

    async def _open(self, before: int) -> None:
        """A new stream that has seen every stored block before block ``before`` (the open chunk
        may span them). The stream is kept only once the replay is complete: a replay cut short
        (Redis failing over, the replica dying) must not leave a stream that lacks those blocks."""
        call = self.pool.next_stub().Attribute()
        try:
            old = [b for b in await self.history() if b.block_index < before]
            if [b.block_index for b in old] != list(range(self.first_block, before)):
                raise RuntimeError(f"stored blocks {[b.block_index for b in old]} do not lead up to block {before}")
            self._call = call
            for b in old:
                await self._exchange(self._request(b, False))
        except BaseException:
            self._call = None
            call.cancel()
            raise

    async def attach(self, block: common_pb2.BlockCommitted, last: bool) -> None:
        """Add the block's attributions to it (none when no replica answers)."""
        resp = await self.attribute(block, last)
        if resp is not None:
            block.token_attributions.extend(resp.token_attributions)
            block.chunk_attributions.extend(resp.chunk_attributions)

    async def attribute(self, block: common_pb2.BlockCommitted, last: bool) -> attribution_pb2.AttributeResponse | None:
        for attempt in range(len(self.pool) + 1):
            try:
                if self._call is not None and block.block_index <= self._streamed_upto:
                    # asked again (its store failed, or a new attempt regenerated it): the stream's
                    # chunk state is past it, so attribute it on a fresh stream replayed up to it
                    self._drop()
                if self._call is None:
                    await self._open(block.block_index)
                return await self._exchange(self._request(block, last))
            # InvalidStateError: the replica died and the stream ended before our write
            except (grpc.aio.AioRpcError, asyncio.TimeoutError, asyncio.InvalidStateError, RuntimeError) as e:
                log.warning("attribution for %s block %d failed (attempt %d): %s", self.request_id,
                            block.block_index, attempt + 1, e)
                self._drop()
            except BaseException:
                # Cancelled (the worker was declared lost) or a Redis error while replaying: the
                # stream may hold a message with no answer read, so it is not used again.
                self._drop()
                raise
        log.error("attribution unavailable: %s block %d goes out without attributions", self.request_id,
                  block.block_index)
        return None

    def _drop(self) -> None:
        self._streamed_upto = -1
        if self._call is not None:
            self._call.cancel()
            self._call = None

    async def close(self) -> None:
        if self._call is not None:
            try:
                await asyncio.wait_for(self._call.done_writing(), 1.0)
            except (grpc.aio.AioRpcError, asyncio.TimeoutError, Exception):
                pass
            self._drop()


def attribution_session(pool: AttributionPool | None, request: scheduler_pb2.SubmitRequest,
                        history: Callable[[], Awaitable[list[common_pb2.BlockCommitted]]],
                        first_block: int = 0) -> AttributionSession | None:
    """The request's Attribute stream; None when it asked for no attributions or no replica
    is configured."""
    if pool is None or request.attribution == common_pb2.ATTRIBUTION_NONE:
        return None
    return AttributionSession(pool, request.request_id, request.model, request.attribution,
                              request.attribution_top_k, set(request.options.stop_ids), history, first_block)
