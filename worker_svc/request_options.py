"""Submit request -> engine options, for both model families: the one place the worker turns
the proto's decode and sampling fields into `DecodeOptions` (block diffusion) or `IsdOptions`
(causal ISD), checking what only it can check (its engine's buckets and stride) and every
bound of cde.limits again."""

from __future__ import annotations

import os

from cde import limits as L
from cde.rpc.v1 import common_pb2
from cde.steerling.config import SteerlingConfig
from cde.steerling.reference_decoder import DecodeOptions
from cde.steerling.sampling import SamplingParams
from worker_svc.engine.isd_engine import IsdOptions
from worker_svc.engine.steerling_engine import TOKENS_PER_STEP_BUCKETS
from worker_svc.validation import BadRequest, check_sampling, check_stop_ids, signed_seed


def _block_sampling(sp: common_pb2.SamplingOptions) -> SamplingParams:
    d = SamplingParams()
    params = SamplingParams(
        use_entropy_sampling=sp.use_entropy_sampling if sp.HasField("use_entropy_sampling") else d.use_entropy_sampling,
        temperature=sp.temperature if sp.HasField("temperature") else d.temperature,
        top_p=sp.top_p if sp.HasField("top_p") else d.top_p,
        repetition_penalty=sp.repetition_penalty if sp.HasField("repetition_penalty") else d.repetition_penalty)
    check_sampling(params.temperature, params.top_p, params.repetition_penalty)
    return params


def block_diffusion_options(d: common_pb2.DecodeOptions, sp: common_pb2.SamplingOptions, cfg: SteerlingConfig,
                            token_limit: int) -> DecodeOptions:
    if d.max_new_tokens < 1:
        raise BadRequest("decode.max_new_tokens must be >= 1 (the gateway resolves the default)")
    if d.isd_stride:
        raise BadRequest("decode.isd_stride is not supported by a block-diffusion model (use 0)")
    tokens_per_step = d.tokens_per_step or L.DEFAULT_TOKENS_PER_STEP
    lo, hi = L.tokens_per_step_bounds(cfg.diff_block_size)
    hi = min(hi, TOKENS_PER_STEP_BUCKETS[-1])   # the engine's largest bucket (64, the 8B block size)
    if not lo <= tokens_per_step <= hi:
        raise BadRequest(f"decode.tokens_per_step must be in [{lo}, {hi}]")
    threshold = d.confidence_threshold if d.HasField("confidence_threshold") else None
    if threshold is not None and not L.THRESHOLD_MIN_EXCLUSIVE < threshold <= L.THRESHOLD_MAX:
        raise BadRequest(f"decode.confidence_threshold must be in ({L.THRESHOLD_MIN_EXCLUSIVE:g}, {L.THRESHOLD_MAX:g}]")
    check_stop_ids(list(d.stop_ids), token_limit)
    seed = d.seed if d.HasField("seed") else int.from_bytes(os.urandom(8), "little") >> 1
    return DecodeOptions(d.max_new_tokens, _block_sampling(sp), tokens_per_step, threshold, signed_seed(seed),
                         tuple(d.stop_ids))


def isd_options(d: common_pb2.DecodeOptions, sp: common_pb2.SamplingOptions, max_stride: int) -> IsdOptions:
    if d.max_new_tokens < 1:
        raise BadRequest("decode.max_new_tokens must be >= 1 (the gateway resolves the default)")
    if d.tokens_per_step > 1 or d.HasField("confidence_threshold"):
        raise BadRequest("decode.tokens_per_step / confidence_threshold apply to block-diffusion models; "
                         "a causal model uses decode.isd_stride")
    stride = d.isd_stride or 1
    if stride > max_stride:
        raise BadRequest(f"decode.isd_stride must be in [1, {max_stride}] on this worker")
    if sp.use_entropy_sampling:
        raise BadRequest("sampling.use_entropy_sampling applies to block-diffusion models only")
    if sp.HasField("repetition_penalty") and sp.repetition_penalty != 1.0:
        raise BadRequest("sampling.repetition_penalty must be 1 for causal (ISD) decoding")
    defaults = L.CAUSAL_SAMPLING
    temperature = sp.temperature if sp.HasField("temperature") else defaults.temperature
    top_p = sp.top_p if sp.HasField("top_p") else defaults.top_p
    check_sampling(temperature, top_p, defaults.repetition_penalty)
    if top_p == 0.0:   # the nucleus of mass 0 is the most likely token alone: greedy (as Steerling reads it)
        temperature, top_p = 0.0, 1.0
    seed = d.seed if d.HasField("seed") else 0
    return IsdOptions(max_new_tokens=d.max_new_tokens, stride=stride, temperature=float(temperature),
                      top_p=float(top_p), seed=signed_seed(seed), stop_ids=tuple(d.stop_ids))
