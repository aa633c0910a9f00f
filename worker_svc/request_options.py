"""Submit request -> engine options, for both model families: the one place the worker turns the
request's `ResolvedOptions` (resolved once, in the gateway) into `DecodeOptions` (block diffusion)
or `IsdOptions` (causal ISD). Nothing is defaulted here: a missing value is a malformed request.
Bounds are the gateway's (cde.limits); here only what the worker alone knows is checked: its
engine's buckets, its --max-stride, its vocabulary, and the fields of its family."""

from __future__ import annotations

from cde import limits as L
from cde.options import DecodeOptions, IsdOptions
from cde.rpc.v1 import resolved_pb2, worker_pb2
from cde.steerling.config import SteerlingConfig
from cde.steerling.sampling import SamplingParams
from worker_svc.engine.steerling_graphs import TOKENS_PER_STEP_BUCKETS
from worker_svc.validation import BadRequest, check_stop_ids, checked_options, signed_seed

_ADAPTER_GATED = {resolved_pb2.ISD_ADAPTER_GATED: True, resolved_pb2.ISD_ADAPTER_UNGATED: False}


def _block_sampling(sp: resolved_pb2.ResolvedSampling) -> SamplingParams:
    if sp.top_k:
        raise BadRequest("options.sampling.top_k is not supported by a block-diffusion model (use 0)")
    return SamplingParams(use_entropy_sampling=sp.use_entropy_sampling, temperature=sp.temperature,
                          top_p=sp.top_p, repetition_penalty=sp.repetition_penalty)


def block_diffusion_options(req: worker_pb2.WorkerSubmit, cfg: SteerlingConfig, token_limit: int) -> DecodeOptions:
    """The request's resolved options as block-diffusion engine options, checked."""
    o = checked_options(req, "block_diffusion")
    bd = o.block_diffusion
    tokens_per_step = bd.tokens_per_step
    lo, hi = L.tokens_per_step_bounds(cfg.diff_block_size)
    hi = min(hi, TOKENS_PER_STEP_BUCKETS[-1])   # the engine's largest bucket (64, the 8B block size)
    if not lo <= tokens_per_step <= hi:
        raise BadRequest(f"options.block_diffusion.tokens_per_step must be in [{lo}, {hi}], got {tokens_per_step}")
    threshold = bd.confidence_threshold if bd.HasField("confidence_threshold") else None
    check_stop_ids(list(o.stop_ids), token_limit)
    return DecodeOptions(o.max_new_tokens, _block_sampling(o.sampling), tokens_per_step, threshold,
                         signed_seed(o.seed), tuple(o.stop_ids))


def isd_options(req: worker_pb2.WorkerSubmit, max_stride: int, token_limit: int) -> IsdOptions:
    """The request's resolved options as ISD engine options, checked."""
    o = checked_options(req, "isd")
    stride = o.isd.stride
    if not 1 <= stride <= max_stride:
        raise BadRequest(f"options.isd.stride must be in [1, {max_stride}] on this worker, got {stride}")
    if o.isd.adapter not in _ADAPTER_GATED:
        raise BadRequest("options.isd.adapter must be ISD_ADAPTER_GATED or ISD_ADAPTER_UNGATED")
    sp = o.sampling
    if sp.use_entropy_sampling:
        raise BadRequest("options.sampling.use_entropy_sampling applies to block-diffusion models only")
    if sp.repetition_penalty != 1.0:
        raise BadRequest("options.sampling.repetition_penalty must be 1 for causal (ISD) decoding")
    if sp.top_k > token_limit:
        raise BadRequest(f"options.sampling.top_k must be in [0, {token_limit}] (0 = off)")
    temperature, top_p = sp.temperature, sp.top_p
    if top_p == 0.0:   # the nucleus of mass 0 is the most likely token alone: greedy (as Steerling reads it)
        temperature, top_p = 0.0, 1.0
    check_stop_ids(list(o.stop_ids), token_limit)
    return IsdOptions(max_new_tokens=o.max_new_tokens, stride=stride, temperature=float(temperature),
                      top_k=sp.top_k, top_p=float(top_p), seed=signed_seed(o.seed), proposal="sample",
                      lora_gated=_ADAPTER_GATED[o.isd.adapter], stop_ids=tuple(o.stop_ids))
