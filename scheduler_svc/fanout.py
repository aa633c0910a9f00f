"""The streams attached to one request's run, and what each of them is sent.

A Submit or Resume stream subscribes to the run and gets, on its queue, step events (if it
asked for them), every block once in index order, and last an `End`. The stream reads the
stored blocks from Redis first and then its queue, skipping indices it already has: a block
is stored before it is published, so nothing falls between the two.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import grpc

from cde.rpc.v1 import common_pb2, scheduler_pb2


@dataclass
class End:
    """The last item a subscriber gets: a Finished event, or a status to abort with."""
    finished: common_pb2.Finished | None = None
    code: grpc.StatusCode | None = None
    message: str = ""
    final: bool = True   # the request ended; False: a Redis outage interrupted it (recoverable)


class Subscriber:
    def __init__(self, steps: bool, attach_id: str = ""):
        self.queue: asyncio.Queue = asyncio.Queue()
        self.steps = steps
        self.attach_id = attach_id   # the stream's `cde-attach-id` (what a Detach names); "" = none


class Fanout:
    """Delivery to a run's subscribers."""

    def __init__(self) -> None:
        self.subscribers: set[Subscriber] = set()
        self.published_upto = -1   # highest absolute block index published
        self.ended = False         # the End went out

    def publish(self, event: scheduler_pb2.SchedulerEvent, step: bool = False) -> None:
        for sub in self.subscribers:
            if sub.steps or not step:
                sub.queue.put_nowait(event)

    def publish_block(self, block: common_pb2.BlockCommitted) -> None:
        """Publish ``block`` unless it (or a later one) went out already."""
        if block.block_index > self.published_upto:
            self.published_upto = block.block_index
            self.publish(scheduler_pb2.SchedulerEvent(block=block))

    def end(self, end: End) -> None:
        self.ended = True
        for sub in self.subscribers:
            sub.queue.put_nowait(end)
