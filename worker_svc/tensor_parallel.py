"""`worker_svc --tensor-parallel N`: one worker whose model is split over N ranks (cde/tp.py), the
ranks in lockstep.

Rank 0 is the worker the scheduler sees (gRPC, registration, heartbeats); ranks 1..N-1 are
follower processes it starts (`python -m worker_svc ... --tp-rank r`), each with its shard of
the model and an engine of its own over its KV heads. Every engine forward holds two
all-reduces a layer, so all ranks must run the same forwards in the same order. They do by
running the same engine code on the same sequence of commands: rank 0 never lets a Submit,
Cancel or Score touch its engine from the gRPC thread; it queues them, and its step thread, before
each step, broadcasts the queued commands and a STEP to the followers and then applies them
itself. Commands are the requests' own wire bytes (WorkerSubmit, ScoreRequest: protobuf, no
pickle), which each rank parses with the same family code, so a rank's Job (options, steering,
grammar state, resume point) is rank 0's. Given the same commands the engines make the same
plans (admission, pages, preemption, prefix cache, overlapped steps: nothing depends on
wall-clock time), the all-reduced activations are identical on every rank, and so are the
sampled tokens (the sampler's randomness is a function of seed, position and step): nothing
else is exchanged. Only rank 0 reports events; the followers drop theirs.

The commands travel over a gloo group on the CPU (a byte tensor broadcast from rank 0), beside
the model's NCCL group on GPUs. A follower that dies breaks rank 0's next broadcast (or its
monitor sees the exit) and rank 0 exits, so the launcher or Kubernetes restarts the whole worker
and the scheduler re-places its requests; a rank 0 that dies breaks the followers' receive and
they exit.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import struct
import subprocess
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass

import torch
import torch.distributed as dist

from cde.rpc.v1 import common_pb2, worker_pb2

log = logging.getLogger("worker_svc.tp")

SUBMIT, CANCEL, SCORE, STEP, STOP = range(5)
# idle ranks wait in a broadcast for the next step; a worker may idle for days
IDLE_TIMEOUT = datetime.timedelta(days=30)


@dataclass(frozen=True)
class RankInfo:
    rank: int
    world: int
    port: int                  # the rendezvous port on 127.0.0.1


def init_ranks(info: RankInfo, device: str) -> object:
    """Join the process group (NCCL on CUDA, gloo on the CPU); returns the gloo group commands use."""
    backend = "nccl" if device.startswith("cuda") else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(info.rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{info.port}", rank=info.rank,
                            world_size=info.world, timeout=IDLE_TIMEOUT)
    return dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT) if backend != "gloo" else dist.group.WORLD


def rank_device(device: str, rank: int) -> str:
    """Rank r's device: cuda:r of the visible devices, or the CPU."""
    return f"cuda:{rank}" if device.startswith("cuda") else device


def shard(model, causal: bool) -> None:
    """This rank's shard of `model`, in place (cde/tp.py; ValueError naming the sizes that do not
    divide by the ranks)."""
    from cde.tp import shard_qwen3, shard_steerling
    (shard_qwen3 if causal else shard_steerling)(model)


def die_with_parent() -> None:
    """Linux: this process gets SIGKILL when its parent (rank 0) exits, however it exits."""
    if sys.platform.startswith("linux"):
        import ctypes
        import signal
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, int(signal.SIGKILL))   # PR_SET_PDEATHSIG


# ---- commands ---------------------------------------------------------------------------------

def encode(commands: list[tuple[int, bytes]]) -> bytes:
    return b"".join(struct.pack("<BI", kind, len(payload)) + payload for kind, payload in commands)


def decode(data: bytes) -> list[tuple[int, bytes]]:
    out, i = [], 0
    while i < len(data):
        kind, n = struct.unpack_from("<BI", data, i)
        i += 5
        out.append((kind, data[i:i + n]))
        i += n
    return out


class Commands:
    """Rank 0 broadcasts a list of commands; the others receive it (length, then the bytes)."""

    def __init__(self, group):
        self.group = group

    def send(self, commands: list[tuple[int, bytes]]) -> None:
        data = encode(commands)
        dist.broadcast(torch.tensor([len(data)], dtype=torch.int64), 0, group=self.group)
        dist.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8), 0, group=self.group)

    def recv(self) -> list[tuple[int, bytes]]:
        n = torch.zeros(1, dtype=torch.int64)
        dist.broadcast(n, 0, group=self.group)
        buf = torch.empty(int(n), dtype=torch.uint8)
        dist.broadcast(buf, 0, group=self.group)
        return decode(buf.numpy().tobytes())


# ---- rank 0 -----------------------------------------------------------------------------------

class LockstepEngine:
    """Rank 0's engine as the AsyncEngine and the servicer see it: submit, cancel and scoring are
    queued, and `step` (the step thread) broadcasts them with a STEP before applying them."""

    def __init__(self, engine, commands: Commands):
        self.engine = engine
        self.commands = commands
        self._pending: list[tuple[int, bytes, object]] = []
        self._lock = threading.Lock()
        self.closed = False
        self.wake: Callable[[], None] = lambda: None   # the AsyncEngine's notify, set by the worker

    def __getattr__(self, name):   # stats, requests, kv, strategy, warmup, ...: the engine's own
        return getattr(self.engine, name)

    def submit(self, job):
        if job.wire is None:
            raise ValueError("a tensor-parallel worker takes jobs parsed from a WorkerSubmit (Job.wire)")
        req = self.engine.new_request(job)   # its checks raise here, before anything is queued
        with self._lock:
            if job.request_id in self.engine.requests or any(
                    k == SUBMIT and r.request_id == job.request_id for k, _, r in self._pending):
                raise ValueError(f"duplicate request id {job.request_id!r}")
            self._pending.append((SUBMIT, job.wire, req))
        return req

    def cancel(self, request_id: str) -> bool:
        with self._lock:
            known = request_id in self.engine.requests or any(
                k == SUBMIT and r.request_id == request_id for k, _, r in self._pending)
            if known:
                self._pending.append((CANCEL, request_id.encode(), None))
        return known

    def score(self, req: common_pb2.ScoreRequest, compute: Callable) -> Future:
        """The scoring forward, run by every rank between two steps; its result on rank 0."""
        fut: Future = Future()
        with self._lock:
            self._pending.append((SCORE, req.SerializeToString(), (req, compute, fut)))
        self.wake()   # the step thread may be idle: nothing else would run this forward
        return fut

    def has_work(self) -> bool:
        return bool(self._pending) or self.engine.has_work()

    def step(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        try:
            self.commands.send([(k, p) for k, p, _ in pending] + [(STEP, b"")])
        except Exception as e:   # noqa: BLE001 - a rank is gone: this worker cannot step again
            log.error("tensor-parallel broadcast failed (%r): exiting", e)
            os._exit(1)
        for kind, payload, obj in pending:   # in order, as the followers apply them
            if kind == SUBMIT:
                try:
                    self.engine.add(obj)
                except ValueError as e:   # every rank refuses it alike
                    log.error("submit refused: %s", e)
            elif kind == CANCEL:
                self.engine.cancel(payload.decode())
            elif kind == SCORE:
                req, compute, fut = obj
                # computed even when the caller left meanwhile: the followers run this forward too
                try:
                    result, error = compute(req), None
                except Exception as e:   # noqa: BLE001 - every rank ran the same forward; report it
                    result, error = None, e
                with contextlib.suppress(InvalidStateError):   # cancelled by the caller
                    fut.set_exception(error) if error is not None else fut.set_result(result)
        self.engine.step()

    def close(self) -> None:
        """Tell the followers to exit (after the step thread stopped)."""
        if not self.closed:
            self.closed = True
            try:
                self.commands.send([(STOP, b"")])
            except Exception as e:   # noqa: BLE001 - a follower already gone
                log.warning("could not stop the followers: %r", e)


# ---- ranks 1..N-1 -----------------------------------------------------------------------------

def follow(engine, parse: Callable[[worker_pb2.WorkerSubmit], object], score: Callable, commands: Commands) -> None:
    """A follower's loop: apply rank 0's commands in order, step when it steps, drop the events."""
    tracked: dict[str, object] = {}
    while True:
        for kind, payload in commands.recv():
            if kind == STOP:
                return
            if kind == SUBMIT:
                job = parse(worker_pb2.WorkerSubmit.FromString(payload))
                try:
                    tracked[job.request_id] = engine.submit(job)
                except ValueError as e:
                    log.error("submit refused: %s", e)
            elif kind == CANCEL:
                engine.cancel(payload.decode())
            elif kind == SCORE:
                try:
                    score(common_pb2.ScoreRequest.FromString(payload))
                except Exception as e:   # noqa: BLE001 - rank 0 reports it
                    log.debug("score failed here as on rank 0: %r", e)
            elif kind == STEP:
                engine.step()
        for rid in [r for r, req in tracked.items() if req.events or req.finished]:
            req = tracked[rid]
            req.events.clear()
            if req.finished:
                del tracked[rid]


def start_followers(argv: list[str], world: int, port: int) -> list[subprocess.Popen]:
    """Ranks 1..world-1 as child processes: this worker's own command line plus --tp-rank r."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return [subprocess.Popen([sys.executable, "-m", "worker_svc", *argv, "--tp-rank", str(r), "--tp-port", str(port)],
                             env=env) for r in range(1, world)]


def watch_followers(procs: list[subprocess.Popen]) -> None:
    """Exit this worker when a follower exits: its shard is gone, nothing can step any more."""
    def run() -> None:
        while True:
            for p in procs:
                try:
                    rc = p.wait(timeout=1.0)
                except subprocess.TimeoutExpired:
                    continue
                log.error("tensor-parallel rank (pid %d) exited with %s: exiting", p.pid, rc)
                os._exit(1)
    threading.Thread(target=run, name="tp-followers", daemon=True).start()
