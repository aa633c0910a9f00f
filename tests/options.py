"""Engine options for tests (a helper module): `DecodeOptions` and `IsdOptions` (cde/options.py)
have no defaults, so the tests fill the ones the suite was written against here, in one place."""

from __future__ import annotations

from cde.options import DecodeOptions, IsdOptions
from cde.steerling.sampling import SamplingParams


def decode_options(max_new_tokens: int, **overrides) -> DecodeOptions:
    """DecodeOptions with the tests' defaults: default sampling, one token per step, no
    confidence threshold, seed 0, no stop ids."""
    fields = dict(sampling=SamplingParams(), tokens_per_step=1, confidence_threshold=None, seed=0, stop_ids=())
    return DecodeOptions(max_new_tokens=max_new_tokens, **{**fields, **overrides})


def isd_options(max_new_tokens: int = 64, **overrides) -> IsdOptions:
    """IsdOptions with the tests' defaults: plain AR (stride 1), greedy, no top-k / top-p, seed 0,
    sampled drafts, a gated LoRA, no stop ids."""
    fields = dict(stride=1, temperature=0.0, top_k=0, top_p=1.0, seed=0, proposal="sample", lora_gated=True,
                  stop_ids=())
    return IsdOptions(max_new_tokens=max_new_tokens, **{**fields, **overrides})
