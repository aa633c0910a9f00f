"""What both worker paths (Steerling: block_diffusion.py, causal: causal.py) check the same way.

A refused request raises `BadRequest` with the gRPC status to answer; seeds arrive as uint64
and the engines hash them as int64 (`signed_seed`). The gateway applied every bound of
cde.limits before the request came in, so the worker checks only what it alone knows: that the
options are present and for its family, its vocabulary, and its model's sizes.
"""

from __future__ import annotations

import grpc

from cde import limits as L
from cde.rpc.v1 import resolved_pb2, worker_pb2


class BadRequest(ValueError):
    """A request this worker refuses; `code` is the gRPC status to answer with."""

    def __init__(self, message: str, code: grpc.StatusCode = grpc.StatusCode.INVALID_ARGUMENT):
        super().__init__(message)
        self.code = code


def signed_seed(seed: int) -> int:
    """uint64 -> the int64 with the same bits: counter_uniform hashes the low and high 32-bit
    halves, which two's complement keeps, and torch has no uint64 tensors."""
    return seed - (1 << 64) if seed >= 1 << 63 else seed


def checked_options(req: worker_pb2.WorkerSubmit, decoder: str) -> resolved_pb2.ResolvedOptions:
    """The request's ResolvedOptions, present and for this worker's family (``decoder``: the oneof
    case it decodes, "block_diffusion" or "isd"). Nothing is defaulted here: the gateway resolved
    every value, so a missing one is a malformed request."""
    if not req.HasField("options"):
        raise BadRequest("options is required (the gateway resolves every option into ResolvedOptions)")
    o = req.options
    got = o.WhichOneof("decoder")
    if got != decoder:
        family = "a block-diffusion" if decoder == "block_diffusion" else "a causal (ISD)"
        raise BadRequest(f"options.{decoder} is required: this worker serves {family} model"
                         + (f" (got options.{got})" if got else ""))
    if not o.HasField("sampling"):
        raise BadRequest("options.sampling is required")
    if o.max_new_tokens < 1:
        raise BadRequest("options.max_new_tokens must be >= 1")
    return o


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


def check_stop_ids(stop_ids: list[int], token_limit: int) -> None:
    """The stop ids are inside this worker's vocabulary."""
    bad = [t for t in stop_ids if t >= token_limit]
    if bad:
        raise BadRequest(f"options.stop_ids {bad[:4]} are outside the vocabulary ({token_limit})")


def check_inject_layer(inject_layer: int, n_layers: int) -> None:
    """Prepared steering names a layer of this worker's model."""
    lo, hi = L.inject_layer_bounds(n_layers)
    if not lo <= inject_layer <= hi:
        raise BadRequest(f"steering.inject_layer must be in [{lo}, {hi}] for this model, got {inject_layer}")
