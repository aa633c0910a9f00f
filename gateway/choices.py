"""`n` > 1: several choices of one prompt.

Each choice is its own scheduler request carrying what the gateway resolved once (prompt,
options, prepared steering); choice i runs with seed (seed + i) mod 2^64, so choice 0 is the
n = 1 request with the same seed and choice i the n = 1 request with seed + i (greedy choices
are all the same text). Ids: choice 0 keeps the request id, choice i gets "<id>-<i>"; the
response's `id` is choice 0's. Usage counts the prompt once and every choice's completion.
Choices share the prompt's KV pages on a worker with prefix caching (the default): the first
choice admitted prefills the prompt's full 64-token blocks, the others wait for them and reuse
the pages (`worker_svc/engine/request_table.py`); the scheduler keeps them on one worker while it
has room (prompt affinity, `scheduler_svc/workers.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from cde.rpc.v1 import scheduler_pb2
from gateway.errors import openai_error_body
from gateway.resolve import Prepared

U64 = 1 << 64

Batch = tuple[list[dict[str, Any]], bool]   # SSE objects ready together, and whether it is the choice's last


def choice_requests(prepared: Prepared, n: int) -> list[Prepared]:
    out = [prepared]
    for i in range(1, n):
        submit = scheduler_pb2.SubmitRequest()
        submit.CopyFrom(prepared.submit)
        submit.request_id = f"{prepared.submit.request_id}-{i}"
        submit.options.seed = (prepared.seed + i) % U64
        out.append(Prepared(submit, prepared.prompt_tokens))
    return out


def _usage(usages: list[dict[str, int]]) -> dict[str, int]:
    prompt = usages[0]["prompt_tokens"]
    completion = sum(u["completion_tokens"] for u in usages)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def merged_response(bodies: list[dict[str, Any]]) -> dict[str, Any]:
    """The non-streamed response of n choices from the n single-choice ones."""
    out = dict(bodies[0])
    out["choices"] = [{**b["choices"][0], "index": i} for i, b in enumerate(bodies)]
    out["usage"] = _usage([b["usage"] for b in bodies])
    out["cde"] = {"request_id": bodies[0]["cde"].get("request_id"), "choices": [b["cde"] for b in bodies]}
    return out


async def merged_batches(gens: list[AsyncIterator[Batch]], include_usage: bool,
                         response_id: str) -> AsyncIterator[Batch]:
    """The n choices' SSE batches as one stream: each choice's objects carry its index and the
    response's id (choice 0's), in the order they are ready; the choices' usage chunks become one summed
    chunk at the end."""
    queue: asyncio.Queue[tuple[int, list[dict[str, Any]], bool]] = asyncio.Queue()

    async def pump(i: int, gen: AsyncIterator[Batch]) -> None:
        try:
            async for objs, last in gen:
                await queue.put((i, objs, last))
                if last:
                    return
        except Exception as e:   # anything _sse_batches did not turn into an in-band error itself
            await queue.put((i, [openai_error_body(500, f"choice {i} failed: {e}", None, "internal_error")], True))

    tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(gens)]
    usages: list[dict[str, Any]] = []
    ended = 0
    try:
        while ended < len(gens):
            i, objs, last = await queue.get()
            kept = []
            for o in objs:
                if o.get("usage") and not o.get("choices"):   # a choice's usage chunk
                    usages.append(o)
                    continue
                if "id" in o:
                    o["id"] = response_id
                for c in o.get("choices", ()):
                    c["index"] = i
                kept.append(o)
            ended += last
            done = ended == len(gens)
            if done and include_usage and usages:
                total = dict(usages[0])
                total["usage"] = _usage([u["usage"] for u in usages])
                total["cde"] = {"choices": [u.get("cde") for u in usages]}
                total["id"] = response_id
                kept.append(total)
            if kept or done:
                yield kept, done
    finally:
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
