"""Per-request decoding options of both engines, side by side. Neither type has defaults: the
gateway (gateway/resolve.py) is the only place a default is chosen, and every other caller says
what it wants. The checks here are the types' own invariants (what no decoder could run), not
the served limits (cde/limits.py)."""

from __future__ import annotations

from dataclasses import dataclass

from cde.steerling.sampling import SamplingParams

# how ISD proposes drafts (cde/isd/decoder.py)
PROPOSALS = ("sample", "argmax_onehot", "argmax")


@dataclass(frozen=True)
class DecodeOptions:
    """Block diffusion (Steerling): the reference decoder's and the engine's arguments."""

    max_new_tokens: int
    sampling: SamplingParams
    tokens_per_step: int                  # masked positions committed per step
    confidence_threshold: float | None    # commit those at or above it (at least one); None: off
    seed: int
    stop_ids: tuple[int, ...]             # ids that end the request after their block

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop_ids", tuple(int(t) for t in self.stop_ids))
        if self.max_new_tokens <= 0:
            raise ValueError("max_new_tokens must be positive")
        if self.tokens_per_step <= 0:
            raise ValueError("tokens_per_step must be positive")
        if self.confidence_threshold is not None and not 0.0 < self.confidence_threshold <= 1.0:
            raise ValueError("confidence_threshold must be in (0, 1]")


@dataclass(frozen=True)
class IsdOptions:
    """Causal ISD: the reference decoder's (cde/isd/decoder.py) and the engine's arguments."""

    max_new_tokens: int
    stride: int                  # N: 1 = plain AR, >= 2 = ISD with N - 1 drafts per step
    temperature: float           # 0 = greedy
    top_k: int                   # 0 = off
    top_p: float                 # 1 = off
    seed: int
    proposal: str                # "sample" | "argmax_onehot" | "argmax" (see cde/isd/decoder.py)
    lora_gated: bool             # R-ISD: an attached LoRA only at [MASK] positions (False: everywhere)
    stop_ids: tuple[int, ...]    # ids that end the request like the model's EOS (kept in the output)

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop_ids", tuple(int(t) for t in self.stop_ids))
        if self.max_new_tokens <= 0:
            raise ValueError("max_new_tokens must be positive")
        if self.stride < 1:
            raise ValueError("stride must be >= 1")
        if self.temperature < 0 or self.top_k < 0 or not 0.0 < self.top_p <= 1.0:
            raise ValueError("need temperature >= 0, top_k >= 0 and 0 < top_p <= 1")
        if self.proposal not in PROPOSALS:
            raise ValueError(f"proposal must be one of {PROPOSALS}, got {self.proposal!r}")
        if not -(1 << 63) <= self.seed < (1 << 63):
            raise ValueError("seed must fit in int64")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
