"""Builders of the internal request contract, cde.v1 `ResolvedOptions` (protos/cde/v1/resolved.proto).

The gateway resolves a public request once (gateway/resolve.py) and builds its options with
these; the scheduler stores them and the workers apply them as they are. Tests that talk to the
scheduler or a worker directly build their requests here too, so they send what a gateway sends.
The keyword defaults are cde.limits' family defaults: only callers that resolve (the gateway,
tests) use them; the services after the gateway never call these.

Torch-free (the gateway imports it).
"""
from __future__ import annotations

from collections.abc import Iterable

from cde import limits as L
from cde.rpc.v1 import resolved_pb2


def sampling(defaults: L.SamplingDefaults, *, top_k: int = 0) -> resolved_pb2.ResolvedSampling:
    """ResolvedSampling with every field final (`defaults` is a family's set or resolved values)."""
    return resolved_pb2.ResolvedSampling(
        use_entropy_sampling=defaults.use_entropy_sampling, temperature=defaults.temperature,
        top_p=defaults.top_p, top_k=top_k, repetition_penalty=defaults.repetition_penalty)


def block_diffusion(*, seed: int, max_new_tokens: int, tokens_per_step: int = L.DEFAULT_TOKENS_PER_STEP,
                    confidence_threshold: float | None = None, stop_ids: Iterable[int] = (),
                    sampling_options: resolved_pb2.ResolvedSampling | None = None) -> resolved_pb2.ResolvedOptions:
    """A Steerling request's options."""
    decoder = resolved_pb2.BlockDiffusion(tokens_per_step=tokens_per_step)
    if confidence_threshold is not None:
        decoder.confidence_threshold = confidence_threshold
    return resolved_pb2.ResolvedOptions(
        seed=seed, max_new_tokens=max_new_tokens, stop_ids=list(dict.fromkeys(stop_ids)),
        sampling=sampling_options or sampling(L.STEERLING_SAMPLING), block_diffusion=decoder)


def isd(*, seed: int, max_new_tokens: int, stride: int = L.DEFAULT_STRIDE, stop_ids: Iterable[int] = (),
        sampling_options: resolved_pb2.ResolvedSampling | None = None,
        adapter: int = resolved_pb2.ISD_ADAPTER_GATED) -> resolved_pb2.ResolvedOptions:
    """A causal model's options (introspective strided decoding; stride 1 = plain AR)."""
    return resolved_pb2.ResolvedOptions(
        seed=seed, max_new_tokens=max_new_tokens, stop_ids=list(dict.fromkeys(stop_ids)),
        sampling=sampling_options or sampling(L.CAUSAL_SAMPLING), isd=resolved_pb2.Isd(stride=stride, adapter=adapter))
