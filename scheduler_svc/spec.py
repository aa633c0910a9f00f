"""A request's spec: the SubmitRequest as the scheduler received it, kept in Redis.

The spec is what any scheduler instance needs to run the request again: the prompt, the
options the gateway resolved (`ResolvedOptions`: seed, length, stops, sampling, decoder), the
prepared steering and the absolute deadline. It is stored as protobuf JSON, versioned:

* v2 (written now): `options` is the internal ResolvedOptions.
* v1 (read only, written before the internal contract): the public `decode` / `sampling`
  messages, already resolved by the gateway and the seed filled by the scheduler; upgraded on
  read, so a request in flight during the upgrade keeps running with the same values.

Also here: the request's block numbering (Redis counts a request's blocks from 0, the wire
uses absolute indices) and the Accepted event its streams begin with.
"""
from __future__ import annotations

import json

from google.protobuf import json_format

from cde.blocks import BLOCK, pages_for
from cde.rpc import resolved
from cde.rpc.v1 import common_pb2, resolved_pb2, scheduler_pb2

SPEC_VERSION = 2


def check_submit(request: scheduler_pb2.SubmitRequest) -> str | None:
    """Why the scheduler cannot run ``request`` (a message naming the field), or None. The
    values themselves are the gateway's and the worker's to check; the scheduler needs a
    length for placement and a decoder for the worker."""
    if not request.prompt_tokens:
        return "prompt_tokens must not be empty"
    if not request.HasField("options"):
        return "options is required: the gateway resolves every option (ResolvedOptions)"
    if request.options.max_new_tokens < 1:
        return "options.max_new_tokens must be >= 1"
    if request.options.WhichOneof("decoder") is None:
        return "options.decoder must be block_diffusion or isd"
    return None


def encode_spec(request: scheduler_pb2.SubmitRequest, deadline: float | None) -> str:
    return json.dumps({"v": SPEC_VERSION, "deadline": deadline,
                       "submit": json_format.MessageToDict(request, preserving_proto_field_name=True)},
                      separators=(",", ":"))


def _options_from_v1(decode: dict, sampling: dict) -> resolved_pb2.ResolvedOptions:
    """A v1 spec's public DecodeOptions + SamplingOptions (resolved by the gateway of then,
    seed set by the scheduler of then) as ResolvedOptions: isd_stride > 0 was a causal model."""
    d = json_format.ParseDict(decode, common_pb2.DecodeOptions())
    s = json_format.ParseDict(sampling, common_pb2.SamplingOptions())
    rs = resolved_pb2.ResolvedSampling(use_entropy_sampling=s.use_entropy_sampling, temperature=s.temperature,
                                       top_p=s.top_p, repetition_penalty=s.repetition_penalty)
    if d.isd_stride:
        return resolved.isd(seed=d.seed, max_new_tokens=d.max_new_tokens, stride=d.isd_stride,
                            stop_ids=d.stop_ids, sampling_options=rs)
    threshold = d.confidence_threshold if d.HasField("confidence_threshold") else None
    return resolved.block_diffusion(seed=d.seed, max_new_tokens=d.max_new_tokens,
                                    tokens_per_step=d.tokens_per_step or 1, confidence_threshold=threshold,
                                    stop_ids=d.stop_ids, sampling_options=rs)


def decode_spec(spec: str) -> tuple[scheduler_pb2.SubmitRequest, float | None]:
    """The stored request and its deadline; ValueError for a spec this version cannot read."""
    d = json.loads(spec)
    version = d.get("v")
    submit = dict(d["submit"])
    if version == 1:
        options = _options_from_v1(submit.pop("decode", {}), submit.pop("sampling", {}))
        request = json_format.ParseDict(submit, scheduler_pb2.SubmitRequest())
        request.options.CopyFrom(options)
        return request, d.get("deadline")
    if version != SPEC_VERSION:
        raise ValueError(f"unknown spec version {version!r}")
    return json_format.ParseDict(submit, scheduler_pb2.SubmitRequest()), d.get("deadline")


def first_block(request: scheduler_pb2.SubmitRequest) -> int:
    """Absolute index of the request's first generated block. Redis numbers a request's
    blocks from 0 (``RequestStore.append_block``); the wire uses absolute indices."""
    return len(request.prompt_tokens) // BLOCK


def stored_after(request: scheduler_pb2.SubmitRequest, after_block: int) -> int:
    """The Redis ``after`` argument for blocks with absolute index > after_block."""
    return max(-1, after_block - first_block(request))


def pages_needed(request: scheduler_pb2.SubmitRequest) -> int:
    """KV pages the request takes on a worker at most (prompt + every new token)."""
    return pages_for(len(request.prompt_tokens) + request.options.max_new_tokens)


def accepted(request: scheduler_pb2.SubmitRequest) -> scheduler_pb2.SchedulerEvent:
    return scheduler_pb2.SchedulerEvent(accepted=common_pb2.Accepted(
        request_id=request.request_id, prompt_tokens=len(request.prompt_tokens), seed=request.options.seed,
        stop_ids=request.options.stop_ids))
