"""asyncio front of an engine (either decoder): a background thread runs steps; coroutines get
event streams.

The step loop runs in one thread (PyTorch releases the GIL inside kernels); each request's
events are handed to its asyncio queue with `call_soon_threadsafe`. Closing a stream early
(client gone, deadline) cancels the request, and the engine frees its pages at the next
step boundary.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator

from worker_svc.engine.events import Event, FinishEvent
from worker_svc.engine.job import Job
from worker_svc.engine.request_table import TrackedRequest
from worker_svc.engine.runtime import EngineRuntime, EngineStats


class AsyncEngine:
    def __init__(self, engine: EngineRuntime):
        self.engine = engine
        self._wake = threading.Condition()
        self._stop = False
        self._streams: dict[str, tuple[TrackedRequest, asyncio.Queue, asyncio.AbstractEventLoop]] = {}
        self._thread = threading.Thread(target=self._run, name="engine-steps", daemon=True)
        self.error: BaseException | None = None

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._wake:
            self._stop = True
            self._wake.notify_all()
        self._thread.join(timeout=10)

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def notify(self) -> None:
        """Wake the step thread (work was queued behind its back)."""
        with self._wake:
            self._wake.notify_all()

    def cancel(self, request_id: str) -> bool:
        ok = self.engine.cancel(request_id)
        with self._wake:
            self._wake.notify_all()
        return ok

    async def generate(self, job: Job) -> AsyncIterator[Event]:
        """Submit the job and stream its events, ending with its FinishEvent."""
        if self.error is not None:
            raise RuntimeError(f"engine failed: {self.error!r}")
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        req = self.engine.submit(job)
        self._streams[job.request_id] = (req, queue, loop)
        with self._wake:
            self._wake.notify_all()
        finished = False
        try:
            while True:
                event = await queue.get()
                if isinstance(event, BaseException):
                    raise RuntimeError(f"engine failed: {event!r}")
                yield event
                if isinstance(event, FinishEvent):
                    finished = True
                    return
        finally:
            self._streams.pop(job.request_id, None)
            if not finished:
                self.cancel(job.request_id)

    # ---- the step thread -----------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                with self._wake:
                    while not self._stop and not self.engine.has_work():
                        self._wake.wait(timeout=0.5)
                    if self._stop:
                        return
                self.engine.step()
                self._dispatch()
        except BaseException as exc:  # surface to every open stream instead of hanging them
            self.error = exc
            for _, queue, loop in list(self._streams.values()):
                loop.call_soon_threadsafe(queue.put_nowait, exc)

    def _dispatch(self) -> None:
        """Hand this step's events to their streams: one wake-up of each event loop per step that
        has any (not one per event: each is a write to the loop's self-pipe and a turn of the loop,
        taken with the GIL the step thread needs for the next step's launch)."""
        batches: dict[asyncio.AbstractEventLoop, list] = {}
        for req, queue, loop in list(self._streams.values()):
            if req.events:
                events = []
                while req.events:
                    events.append(req.events.popleft())
                batches.setdefault(loop, []).append((queue, events))
        for loop, batch in batches.items():
            loop.call_soon_threadsafe(_deliver, batch)


def _deliver(batch: list[tuple[asyncio.Queue, list]]) -> None:
    for queue, events in batch:
        for event in events:
            queue.put_nowait(event)
