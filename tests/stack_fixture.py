"""The whole system as real processes (cde.launch.Stack) for tests, plus the client helpers
the stack tests share (REST streams, public gRPC requests, the blocks Redis holds).

    with running_stack(tmp_path, workers=2, scheduler_args=["--max-running", "2"]) as stack:
        ...

The ``stack`` fixture (this module is a pytest plugin that conftest.py loads) is the default
stack, one per test module: the tiny Steerling model on the CPU, one worker, default arguments.
A module that needs other arguments defines its own ``stack`` fixture, which pytest takes instead.

``running_stack`` always stops every process it started (also when start-up fails);
``restart_service`` starts a killed service again with its original command line, port
and environment. Streams are read with bounded timeouts, never forever.

The stack has the internal token on, as ``python -m cde.launch`` does by default (a fresh token
per stack, ``stack.internal_token``): a test that calls the scheduler, a worker, steering or
attribution itself sends it with ``internal_aio_channel(stack, port)``, ``worker_info(stack, port)``
or ``metadata=stack.internal_metadata``; ``running_stack(..., internal_token=False)`` turns it off.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import grpc
import httpx
import pytest
import redis

from cde.launch import ROOT, TINY_MODEL, Service, Stack
from cde.redis_util import free_port
from cde.rpc.internal_auth import internal_channel
from cde.rpc.v1 import common_pb2, generate_pb2, worker_pb2, worker_pb2_grpc
from cde.sse import parse_sse_line

MODEL = "steerling-tiny"
PROMPT = "Tell me about the sea."
FINISHED_OK = ("stop", "length")   # finish reasons of a request that completed


def stack_args(run_dir: str | os.PathLike, *, workers: int = 1, scheduler_args: Sequence[str] = (),
               gateway_args: Sequence[str] = (), redis_url: str | None = None,
               timeout: float = 240.0, model_dir: str | os.PathLike = TINY_MODEL, internal_token: bool = True,
               internal_token_file: str | os.PathLike | None = None, ha: bool = False,
               schedulers: int | None = None, attribution_replicas: int | None = None,
               worker_args: Sequence[str] = (), weights: str | None = None,
               tensor_parallel: int = 1) -> argparse.Namespace:
    return argparse.Namespace(model_dir=str(model_dir), device="cpu", workers=workers, host="127.0.0.1",
                              http_port=free_port(), run_dir=str(run_dir), timeout=timeout,
                              scheduler_args=list(scheduler_args), gateway_args=list(gateway_args),
                              redis_url=redis_url, internal_token=internal_token,
                              internal_token_file=str(internal_token_file) if internal_token_file else None,
                              ha=ha, schedulers=schedulers, attribution_replicas=attribution_replicas,
                              worker_args=list(worker_args), weights=weights, tensor_parallel=tensor_parallel)


@contextlib.contextmanager
def running_stack(run_dir: str | os.PathLike, **kw) -> Iterator[Stack]:
    stack = Stack(stack_args(run_dir, **kw))
    try:
        stack.start()
        yield stack
    except BaseException:
        print_log_tails(stack)
        raise
    finally:
        stack.stop()


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Iterator[Stack]:
    with running_stack(tmp_path_factory.mktemp("stack")) as s:
        yield s


class LauncherOutput:
    """The launcher's stdout, read by a thread into a list (bounded waits on it)."""

    def __init__(self, proc) -> None:
        import threading
        self.lines: list[str] = []
        self._thread = threading.Thread(target=self._read, args=(proc,), daemon=True)
        self._thread.start()

    def _read(self, proc) -> None:
        for line in proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def find(self, needle: str) -> str | None:
        return next((l for l in list(self.lines) if needle in l), None)

    def text(self) -> str:
        return "\n".join(self.lines)


def print_log_tails(stack: Stack, lines: int = 40) -> None:
    """A failed test shows what every service logged last (CI keeps only the test output)."""
    for svc in stack.services:
        if svc.log is not None:
            print(f"----- {svc.name} ({svc.log}) -----\n{stack.log_tail(svc, lines)}")


def service(stack: Stack, name: str) -> Service:
    return next(s for s in stack.services if s.name == name)


def workers(stack: Stack) -> list[Service]:
    return [s for s in stack.services if s.name.startswith("worker")]


def kill(svc: Service) -> None:
    """SIGKILL: no shutdown work at all."""
    svc.proc.send_signal(signal.SIGKILL)
    svc.proc.wait(timeout=10)


def restart_service(stack: Stack, svc: Service) -> None:
    """Start ``svc`` again with the same arguments (hence port) and environment; the Stack stops it."""
    assert svc.proc is None or svc.proc.poll() is not None, f"{svc.name} is still running"
    with svc.log.open("ab") as log:
        svc.proc = subprocess.Popen(svc.args, cwd=ROOT, env=stack.env, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)


def all_alive(stack: Stack) -> dict[str, int | None]:
    """name -> exit code of every service that is NOT running (empty when all are alive)."""
    return {s.name: s.proc.returncode for s in stack.services if s.proc is None or s.proc.poll() is not None}


def wait_until(pred, timeout: float, interval: float = 0.05, what: str = "condition"):
    """Poll ``pred()`` until it returns something truthy; AssertionError after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(interval)


def healthy(stack: Stack, timeout: float = 30.0) -> None:
    def ok():
        try:
            return httpx.get(f"{stack.base_url}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False
    wait_until(ok, timeout, 0.2, "gateway /health 200")


def worker_info(stack: Stack, port: int, timeout: float = 2.0) -> worker_pb2.WorkerStatus:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        return worker_pb2_grpc.WorkerStub(ch).Info(worker_pb2.WorkerStatusRequest(), timeout=timeout,
                                                   metadata=stack.internal_metadata)


def internal_aio_channel(stack: Stack, port: int, options: Sequence[tuple] | None = None) -> grpc.aio.Channel:
    """An asyncio channel to one of the stack's internal services (loopback) that sends the
    stack's internal token (none when the stack runs without one)."""
    return internal_channel(f"127.0.0.1:{port}", options=options, token=stack.internal_token or "")


def chat_body(seed: int, max_tokens: int, stream: bool = True, content: str = PROMPT, **extra) -> dict:
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "seed": seed, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    body.update(extra)
    return body


class StreamResult:
    """What one streamed REST completion delivered, in order."""

    def __init__(self) -> None:
        self.status: int | None = None    # HTTP status
        self.request_id: str | None = None
        self.blocks: list[int] = []
        self.tokens: list[int] = []
        self.text = ""
        self.finish: str | None = None
        self.usage: dict | None = None
        self.errors: list[dict] = []
        self.done = False            # saw data: [DONE]
        self.block_cde: list[dict] = []   # each block's "cde" object (attributions included)

    def feed(self, line: str) -> None:
        if line.strip() == "data: [DONE]":
            self.done = True
            return
        ev = parse_sse_line(line)
        if ev is None:
            return
        if "error" in ev:
            self.errors.append(ev["error"])
            return
        cde = ev.get("cde") or {}
        if "request_id" in cde and self.request_id is None:
            self.request_id = cde["request_id"]
        if "block_index" in cde:
            self.block_cde.append(cde)
            self.blocks.append(cde["block_index"])
            self.tokens += cde["tokens"]
        for c in ev.get("choices") or []:
            self.text += (c.get("delta") or {}).get("content") or c.get("text") or ""
            if c.get("finish_reason"):
                self.finish = c["finish_reason"]
        if ev.get("usage"):
            self.usage = ev["usage"]


# ---- clients: REST streams, public gRPC, the blocks Redis holds ---------------------------------

async def stream_rest(client: httpx.AsyncClient, url: str, body: dict, res: StreamResult,
                      path: str = "/v1/chat/completions") -> StreamResult:
    async with client.stream("POST", url + path, json=body) as r:
        res.status = r.status_code
        if r.status_code != 200:
            res.errors.append(json.loads(await r.aread()).get("error", {}))
            return res
        async for line in r.aiter_lines():
            res.feed(line)
    return res


async def stream_many(url: str, bodies: list[dict], timeout: float = 120) -> list[StreamResult]:
    results = [StreamResult() for _ in bodies]
    async with httpx.AsyncClient(timeout=timeout) as c:
        await asyncio.wait_for(asyncio.gather(*(stream_rest(c, url, b, r) for b, r in zip(bodies, results))),
                               timeout)
    return results


def contiguous(blocks: list[int]) -> bool:
    return bool(blocks) and blocks == list(range(blocks[0], blocks[0] + len(blocks)))


def stored_block_indices(rds: redis.Redis, request_id: str) -> list[int]:
    """Absolute block indices of the blocks Redis holds for a request, by stored position."""
    stored = rds.hgetall(f"cde:req:{request_id}:blocks")
    assert sorted(int(k) for k in stored) == list(range(len(stored))), sorted(stored)
    return [common_pb2.BlockCommitted.FromString(stored[str(i).encode()]).block_index for i in range(len(stored))]


def grpc_request(seed: int, max_tokens: int, request_id: str = "") -> generate_pb2.GenerateRequest:
    return generate_pb2.GenerateRequest(
        request_id=request_id, model=MODEL,
        chat=generate_pb2.ChatMessages(messages=[generate_pb2.ChatMessage(role="user", content=PROMPT)]),
        decode=common_pb2.DecodeOptions(max_new_tokens=max_tokens, seed=seed))


class GrpcStream:
    """Everything one public gRPC generation delivered, across reconnects."""

    def __init__(self, request: generate_pb2.GenerateRequest | None = None, request_id: str = ""):
        self.request = request
        self.request_id = request_id or (request.request_id if request is not None else "")
        self.blocks: list[int] = []
        self.tokens: list[int] = []
        self.text = ""
        self.finished: common_pb2.Finished | None = None
        self.errors: list[str] = []
        self.resumes = 0

    def feed(self, ev: generate_pb2.GenerateResponse) -> None:
        kind = ev.WhichOneof("event")
        if kind == "accepted":
            self.request_id = self.request_id or ev.accepted.request_id
        elif kind == "block":
            self.blocks.append(ev.block.block_index)
            self.tokens += ev.block.tokens
            self.text += ev.block.text
        elif kind == "finished":
            self.finished = ev.finished


async def follow_grpc(stub, st: GrpcStream, budget_s: float = 90.0) -> GrpcStream:
    """Generate (or, without a request, Resume from the start); on a broken stream Resume after
    the last block seen, until Finished or the budget is spent."""
    deadline = time.monotonic() + budget_s
    if st.request is not None:
        call = stub.Generate(st.request, timeout=budget_s)
    else:
        call = stub.Resume(common_pb2.ResumeRequest(request_id=st.request_id), timeout=budget_s)
    while True:
        try:
            async for ev in call:
                st.feed(ev)
            if st.finished is not None:
                return st
            st.errors.append("stream ended without Finished")
        except grpc.aio.AioRpcError as e:
            st.errors.append(e.code().name)
            if e.code() == grpc.StatusCode.NOT_FOUND:
                return st
        left = deadline - time.monotonic()
        assert left > 0, f"request {st.request_id} did not finish within {budget_s:g}s: {st.errors[-5:]}"
        await asyncio.sleep(0.2)
        resume = common_pb2.ResumeRequest(request_id=st.request_id)
        if st.blocks:
            resume.after_block = st.blocks[-1]
        st.resumes += 1
        call = stub.Resume(resume, timeout=left)


def write_json(path: Path, obj: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=2) + "\n")
