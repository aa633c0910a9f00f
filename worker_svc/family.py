"""What the worker's one `Submit` (service.WorkerServicer) needs from a model family: parse a
WorkerSubmit into a `Job` in engine types, answer a resumed request that is already over, turn
the engine's events into WorkerEvents, describe the worker. block_diffusion.py (Steerling) and
causal.py (ISD) implement it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from cde.rpc.v1 import common_pb2, worker_pb2
from worker_svc.engine.job import Job
from worker_svc.engine.runtime import EngineRuntime, EngineStats


EventTranslator = Callable[[object], list[worker_pb2.WorkerEvent]]   # one engine event -> what to send


class ModelFamily(Protocol):
    engine: EngineRuntime

    def parse(self, request: worker_pb2.WorkerSubmit) -> Job:
        """Validate; raises validation.BadRequest with the status code to answer."""

    def already_finished(self, job: Job) -> common_pb2.Finished | None:
        """A resumed request whose committed tokens already end it: its Finished, else None."""

    def translator(self, job: Job) -> EventTranslator:
        """A per-request translator of engine events (it may keep state, e.g. chunking)."""

    def status(self, stats: EngineStats, model_name: str, dtype: str, device: str) -> worker_pb2.WorkerStatus:
        """Worker.Info's answer."""
