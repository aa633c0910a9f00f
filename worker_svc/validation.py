"""What both worker paths (Steerling: service.py, causal: causal.py) check the same way.

A refused request raises `BadRequest` with the gRPC status to answer; seeds arrive as uint64
and the engines hash them as int64 (`signed_seed`).
"""

from __future__ import annotations

import grpc

from cde.rpc.v1 import worker_pb2


class BadRequest(ValueError):
    """A request this worker refuses; `code` is the gRPC status to answer with."""

    def __init__(self, message: str, code: grpc.StatusCode = grpc.StatusCode.INVALID_ARGUMENT):
        super().__init__(message)
        self.code = code


def signed_seed(seed: int) -> int:
    """uint64 -> the int64 with the same bits: counter_uniform hashes the low and high 32-bit
    halves, which two's complement keeps, and torch has no uint64 tensors."""
    return seed - (1 << 64) if seed >= 1 << 63 else seed


def checked_prompt(req: worker_pb2.WorkerSubmit, token_limit: int, mask_id: int | None) -> list[int]:
    """The request id is set and the prompt is non-empty, in the vocabulary, without the mask id."""
    if not req.request_id:
        raise BadRequest("request_id is required")
    prompt = list(req.prompt_tokens)
    if not prompt:
        raise BadRequest("prompt_tokens must not be empty")
    bad = [t for t in prompt if t >= token_limit or t == mask_id]
    if bad:
        raise BadRequest(f"prompt token ids {bad[:4]} are outside the vocabulary ({token_limit}) or the mask id")
    return prompt
