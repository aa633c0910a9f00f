"""How a request's run ends: the terminal transition in Redis, then the `End` its streams get.

Each transition (finish, fail, cancel) saves the request's Finished message in the same
script, so a later Resume replays the same ending. A transition Redis refuses means the
request is no longer this run's: it ended elsewhere (that ending is published) or was
requeued under the run (the run places it again).
"""

from __future__ import annotations

import logging

import grpc
import redis.exceptions

from cde.rpc.finish import FINISH_REASON_BY_NAME, FINISH_REASON_TEXT
from cde.rpc.v1 import common_pb2
from scheduler_svc.block_log import BlockLog
from scheduler_svc.fanout import End, Fanout
from scheduler_svc.run_context import RunContext, with_redis_retries
from scheduler_svc.state import CANCELLED, FAILED, FINISHED, RequestState
from scheduler_svc.workers import WorkerHandle

log = logging.getLogger("scheduler_svc.run")


def stored_finished(st: RequestState, saved: bytes | None) -> common_pb2.Finished:
    """The request's Finished message: as saved, else rebuilt from its status."""
    if saved:
        return common_pb2.Finished.FromString(saved)
    if st.status == FAILED:
        return common_pb2.Finished(reason=common_pb2.FINISH_REASON_ERROR, message=st.error or "")
    if st.status == CANCELLED:
        return common_pb2.Finished(reason=common_pb2.FINISH_REASON_CANCELLED)
    return common_pb2.Finished(reason=FINISH_REASON_BY_NAME.get(st.finish_reason or "",
                                                                common_pb2.FINISH_REASON_UNSPECIFIED))


class Endings:
    def __init__(self, ctx: RunContext, request_id: str, blocks: BlockLog, fanout: Fanout):
        self.ctx = ctx
        self.rid = request_id
        self.blocks = blocks
        self.fanout = fanout

    async def worker_finished(self, fin: common_pb2.Finished, attempt: int, worker: WorkerHandle) -> bool:
        """The worker's Finished, recorded and published. False when the request is no longer
        ours but still live (it must be placed again)."""
        store = self.ctx.store
        if fin.reason == common_pb2.FINISH_REASON_CANCELLED:   # cancelled at the worker directly
            await self.cancelled(fin.message or "cancelled by the worker", worker)
            return True
        ending = fin.SerializeToString()
        if fin.reason == common_pb2.FINISH_REASON_ERROR:
            error = fin.message or "worker error"
            ok = await with_redis_retries(self.ctx, self.rid, lambda: store.fail(self.rid, error, attempt, ending),
                                          "fail")
        else:
            reason = FINISH_REASON_TEXT.get(fin.reason, "stop")   # stop or length; unspecified reads as stop
            ok = await with_redis_retries(self.ctx, self.rid, lambda: store.finish(self.rid, reason, attempt, ending),
                                          "finish")
        if not ok:
            return await self.ownership_lost()
        self.fanout.end(End(finished=fin))
        return True

    async def ownership_lost(self) -> bool:
        """Redis refused our write: True when the request ended (that ending is published),
        False when it was requeued under us."""
        st = await self.ctx.store.get(self.rid)
        if st is None or st.terminal:
            await self.from_store(st)
            return True
        return False

    async def from_store(self, st: RequestState | None) -> None:
        """Publish the ending Redis holds for the request (``st``: its state, None if gone)."""
        if st is None:   # a run exists only for a request it created: its state was lost, not the client's fault
            self.fanout.end(End(code=grpc.StatusCode.UNAVAILABLE,
                                message=f"request {self.rid!r} lost its state in Redis (restarted without "
                                        "persistence or flushed); send it again"))
            return
        await self.blocks.publish_stored()
        self.fanout.end(End(finished=stored_finished(st, await self.ctx.store.ending(self.rid))))

    async def cancelled(self, reason: str, worker: WorkerHandle | None) -> None:
        """Cancel the request in Redis and on ``worker`` (the last it streamed from), unless it
        finished or failed first: then that ending is published."""
        store = self.ctx.store
        fin = common_pb2.Finished(reason=common_pb2.FINISH_REASON_CANCELLED, message=reason)
        if not await with_redis_retries(self.ctx, self.rid, lambda: store.cancel(self.rid, fin.SerializeToString()),
                                        "cancel"):
            st = await store.get(self.rid)
            if st is not None and st.status in (FINISHED, FAILED):
                await self.from_store(st)
                return
        if worker is not None and not worker.dead:   # the closed stream cancels too; this frees pages sooner
            try:
                await worker.stub.Cancel(common_pb2.CancelRequest(request_id=self.rid), timeout=1.0)
            except grpc.aio.AioRpcError:
                pass
        log.info("request %s cancelled: %s", self.rid, reason)
        await self.blocks.publish_stored()
        self.fanout.end(End(finished=fin))

    async def give_up(self, code: grpc.StatusCode, message: str) -> None:
        """End the request with an error status for live subscribers (Finished ERROR on replay)."""
        store = self.ctx.store
        log.warning("request %s failed: %s %s", self.rid, code.name, message)
        try:
            # still queued: cancelled is its only way out of the queue
            ending = common_pb2.Finished(reason=common_pb2.FINISH_REASON_ERROR, message=message).SerializeToString()
            if not await store.fail(self.rid, message, ending=ending):
                await store.cancel(self.rid, ending)
        except redis.exceptions.RedisError as e:
            log.error("request %s: could not record the failure: %s", self.rid, e)
        self.fanout.end(End(code=code, message=message))
