"""A request as the engine takes it: what the worker service parsed from a WorkerSubmit (the
model families, worker_svc/block_diffusion.py and causal.py), in engine types. One object from
the worker's Submit to `EngineRuntime.submit`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cde.options import DecodeOptions, IsdOptions
from cde.steerling.steering import PreparedSteering


@dataclass(frozen=True)
class Job:
    request_id: str
    prompt: list[int]
    options: DecodeOptions | IsdOptions   # the engine's own: SteerlingEngine | IsdEngine
    # resuming a request that stopped elsewhere: what it had generated and where it was
    committed: tuple[int, ...] = ()
    next_step: int = 0
    stream_steps: bool = True     # one StepEvent per step (False: only blocks / commits and the finish)
    records: bool = True          # raw concept records with each block (block diffusion; for attributions)
    logprobs: int | None = None   # block diffusion: each committed token's logprob + this many alternatives
    steering: PreparedSteering | None = None   # block diffusion only
    stop_ids: frozenset[int] = frozenset()     # causal: the model's EOS ids and the request's stop ids
    # structured output (cde.grammar.Constraint), in its state after `committed`: block diffusion
    # commits left to right, one token a step, each drawn from the model's distribution masked to
    # what the grammar allows next
    constraint: Any = None
    # the WorkerSubmit this job was parsed from (serialized): with --tensor-parallel the other ranks
    # parse it again to run the same request (worker_svc/tensor_parallel.py); None otherwise
    wire: bytes | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompt", list(self.prompt))
        object.__setattr__(self, "committed", tuple(self.committed))
