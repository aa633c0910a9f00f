"""One attempt of a request on the worker it was claimed on: Submit from the last stored block,
relay steps, commit each block, record the worker's ending, and say whether the request is
done or must be placed again (the worker was lost, or refused it for now).
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time

import grpc

from cde import trace
from cde.rpc.v1 import common_pb2, scheduler_pb2, worker_pb2
from scheduler_svc.block_log import BlockLog
from scheduler_svc.endings import Endings
from scheduler_svc.fanout import Fanout
from scheduler_svc.run_context import Deadline, DeadlinePassed, RunContext
from scheduler_svc.state import Claimed
from scheduler_svc.workers import Reservation, WorkerHandle

log = logging.getLogger("scheduler_svc.run")

# The worker refused the request itself: retrying elsewhere cannot help.
REQUEST_FAULTS = frozenset({grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION,
                            grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.NOT_FOUND,
                            grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNIMPLEMENTED,
                            grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED})


class Outcome(enum.Enum):
    DONE = 1      # the request reached an end (published)
    REPLACE = 2   # place it again (worker lost, or a transient refusal)


class WorkerStream:
    def __init__(self, ctx: RunContext, request: scheduler_pb2.SubmitRequest, deadline: Deadline, started: float,
                 fanout: Fanout, blocks: BlockLog, endings: Endings, avoid: set[str]):
        self.ctx = ctx
        self.request = request
        self.rid = request.request_id
        self.deadline = deadline
        self.started = started          # when the run began (RelayTiming, trace)
        self.fanout = fanout
        self.blocks = blocks
        self.endings = endings
        self.avoid = avoid              # the placement's: workers that failed this request (tried last)
        self.worker: WorkerHandle | None = None        # streaming from it now
        self.last_worker: WorkerHandle | None = None   # streamed from last (a cancel tells it)
        self._call = None
        self._lost_worker: str | None = None
        self._placed = False   # sent to a worker once (RelayTiming counts the first time)

    async def run(self, reservation: Reservation, claimed: Claimed) -> Outcome:
        """Stream from the reserved worker; the reservation ends with the stream."""
        worker = reservation.worker
        self.worker = self.last_worker = worker
        try:
            return await self._stream(worker, claimed)
        finally:
            self.ctx.pool.release(reservation)
            self.worker = None

    def worker_lost(self, worker_id: str) -> None:
        """The pool declared our worker dead: abandon its stream (the run places the request again)."""
        if self.worker is not None and self.worker.worker_id == worker_id and self._call is not None:
            self._lost_worker = worker_id
            self._call.cancel()

    def _submit(self, blocks: list[common_pb2.BlockCommitted]) -> worker_pb2.WorkerSubmit:
        """The worker's request, resuming after ``blocks`` (their tokens and step counter)."""
        # The attribution service must know which block is the generation's last: the worker
        # marks it (`last`), so blocks are attributed and published as soon as they arrive.
        r = self.request
        submit = worker_pb2.WorkerSubmit(
            request_id=self.rid, prompt_tokens=r.prompt_tokens,
            committed_tokens=[t for b in blocks for t in b.tokens],
            next_step=blocks[-1].next_step if blocks else 0, options=r.options, stream_steps=r.stream_steps,
            no_records=not self.blocks.wants_records, grammar=r.grammar)
        if r.HasField("top_logprobs"):
            submit.top_logprobs = r.top_logprobs
        if r.HasField("steering"):
            submit.steering.CopyFrom(r.steering)
        return submit

    async def _stream(self, worker: WorkerHandle, st: Claimed) -> Outcome:
        blocks = await self.blocks.resume_at(st.next_block)
        call = worker.stub.Submit(self._submit(blocks), timeout=self.deadline.left())
        issued_at = time.monotonic()
        timing = self.ctx.timing
        if not self._placed:
            self._placed = True
            timing.placed += 1
            timing.submit_to_worker_s += issued_at - self.started
        self._call, self._lost_worker = call, None
        try:
            while True:
                ev = await call.read()
                if ev is grpc.aio.EOF:
                    break
                kind = ev.WhichOneof("event")
                if kind == "step":
                    if self.request.stream_steps:
                        self.fanout.publish(scheduler_pb2.SchedulerEvent(step=ev.step), step=True)
                elif kind == "block":
                    read_at, first = time.monotonic(), self.fanout.published_upto < 0
                    if not await self.blocks.commit(ev.block, ev.block.last, st.attempt):
                        return Outcome.DONE if await self.endings.ownership_lost() else Outcome.REPLACE
                    if first and self.fanout.published_upto >= 0:
                        timing.first_blocks += 1
                        timing.first_block_relay_s += time.monotonic() - read_at
                        if trace.enabled():
                            trace.record("scheduler", self.rid, sch_submit=trace.wall(self.started),
                                         sch_worker_submit=trace.wall(issued_at), sch_first_read=trace.wall(read_at),
                                         sch_first_published=time.time())
                elif kind == "finished":
                    ended = await self.endings.worker_finished(ev.finished, st.attempt, worker)
                    return Outcome.DONE if ended else Outcome.REPLACE
            return await self._worker_failed(worker, "stream ended without Finished")
        except grpc.aio.AioRpcError as e:
            code = e.code()
            if code in REQUEST_FAULTS:
                await self.endings.give_up(code, e.details() or code.name)
                return Outcome.DONE
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise DeadlinePassed() from None
            if code == grpc.StatusCode.ALREADY_EXISTS:   # its previous attempt is still winding down there
                self.avoid.add(worker.worker_id)
                return Outcome.REPLACE
            return await self._worker_failed(worker, f"{code.name}: {e.details()}")
        except asyncio.CancelledError:
            if self._lost_worker == worker.worker_id and not asyncio.current_task().cancelling():
                return Outcome.REPLACE   # declared dead by the pool, which requeued the request
            raise
        finally:
            self._call = None
            if not call.done():
                call.cancel()

    async def _worker_failed(self, worker: WorkerHandle, why: str) -> Outcome:
        log.warning("request %s: stream from worker %s failed: %s", self.rid, worker.worker_id, why)
        if await self.ctx.pool.probe(worker):
            self.avoid.add(worker.worker_id)
        else:
            await self.ctx.pool.declare_dead(worker.worker_id, why)
        return Outcome.REPLACE
