"""A request's committed blocks: each one attributed, stored in Redis exactly once, then
published to the request's streams.

Redis numbers a request's blocks from 0 (`RequestStore.append_block`: an index CAS, so a
retried, duplicated or zombie append stores nothing); the wire uses absolute indices
(scheduler_svc/spec.py). A stored block is the final BlockCommitted proto, attributions
included, so a replay is identical, and its ``next_step`` says where the worker's step
counter stood for a resume.
"""

from __future__ import annotations

from cde.rpc.v1 import common_pb2, scheduler_pb2
from scheduler_svc.attribution import attribution_session
from scheduler_svc.fanout import Fanout
from scheduler_svc.run_context import RunContext, with_redis_retries
from scheduler_svc.spec import first_block, stored_after


class BlockLog:
    def __init__(self, ctx: RunContext, request: scheduler_pb2.SubmitRequest, fanout: Fanout):
        self.ctx = ctx
        self.request = request
        self.rid = request.request_id
        self.fanout = fanout
        self.first_block = first_block(request)   # absolute index of the request's block 0
        self.next_block = 0                       # next block Redis expects
        self.attribution = attribution_session(ctx.attribution, request, self._stored_for_attribution,
                                               self.first_block)

    @property
    def wants_records(self) -> bool:
        """Whether the worker must send concept records (they feed attributions only)."""
        return self.attribution is not None

    async def stored(self) -> list[common_pb2.BlockCommitted]:
        return [common_pb2.BlockCommitted.FromString(p) for _, p in await self.ctx.store.blocks(self.rid)]

    async def _stored_for_attribution(self) -> list[common_pb2.BlockCommitted]:
        return await with_redis_retries(self.ctx, self.rid, self.stored, "reading the stored blocks to attribute")

    async def resume_at(self, next_block: int) -> list[common_pb2.BlockCommitted]:
        """The stored blocks a new attempt continues after (0 .. next_block - 1; a request with
        none skips the read), published again for a subscriber an interrupted attempt left behind."""
        blocks = await self.stored() if next_block else []
        self.next_block = next_block
        for b in blocks:
            self.fanout.publish_block(b)
        return blocks

    async def commit(self, block: common_pb2.BlockCommitted, last: bool, attempt: int) -> bool:
        """Attribute, store exactly once, publish. False when the request is no longer ours."""
        stored_index = block.block_index - self.first_block
        if stored_index < self.next_block:
            return True   # already stored by an earlier attempt
        if self.attribution is not None:
            await self.attribution.attach(block, last)
        payload = block.SerializeToString()
        result = await with_redis_retries(
            self.ctx, self.rid,
            lambda: self.ctx.store.append_block(self.rid, stored_index, payload, len(block.tokens), attempt),
            f"storing block {block.block_index}")
        if result == "stored":
            self.next_block = stored_index + 1
            self.fanout.publish_block(block)
            return True
        if result == "duplicate":
            if stored_index >= self.next_block:   # our own write, retried after its reply was lost
                self.next_block = stored_index + 1
                self.fanout.publish_block(block)
            return True
        if result == "not_running":
            return False
        raise RuntimeError(f"block {block.block_index} is out of order (Redis expects "
                           f"{self.first_block + self.next_block})")

    async def publish_stored(self) -> None:
        """Publish the stored blocks no subscriber has had yet (a commit that was interrupted)."""
        for _, payload in await self.ctx.store.blocks(self.rid, stored_after(self.request, self.fanout.published_upto)):
            self.fanout.publish_block(common_pb2.BlockCommitted.FromString(payload))

    async def close(self) -> None:
        if self.attribution is not None:
            await self.attribution.close()
