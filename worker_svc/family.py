"""What the worker's one `Submit` (service.WorkerServicer) needs from a model family: parse a
WorkerSubmit into a `Job` in engine types, answer a resumed request that is already over, turn
the engine's events into WorkerEvents, describe the worker. block_diffusion.py (Steerling) and
causal.py (ISD) implement it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from cde.rpc.v1 import common_pb2, worker_pb2
from worker_svc.engine.runtime import EngineRuntime, EngineStats


@dataclass(frozen=True)
class Job:
    """A validated WorkerSubmit in engine types."""

    request_id: str
    prompt: list[int]
    options: Any                  # DecodeOptions (block diffusion) | IsdOptions (causal)
    committed: list[int]
    next_step: int
    stream_steps: bool = False    # one StepEvent per step / forward
    records: bool = True          # raw concept records with each block (block diffusion; for attributions)
    steering: Any = None          # PreparedSteering (block diffusion only)
    stop_ids: frozenset[int] = frozenset()   # causal: the model's EOS ids and the request's stop ids


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
