"""Every request bound and default, in one torch-free module.

The gateway (pydantic schemas and the gRPC API's checks), steering_svc and the worker import
their bounds from here, so a value one service accepts is never refused by the next one for
being out of range. Model-dependent bounds are functions of the model's sizes. The README's
"Limits" table is `markdown_table()` (a test keeps the two equal), and the REST schema's
field descriptions are built from the same constants.

Nothing here imports torch: the gateway must stay torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass

# ---- integer widths of the proto fields values travel in --------------------------------
U32_MAX = 2**32 - 1
U64_MAX = 2**64 - 1

# ---- length -----------------------------------------------------------------------------
DEFAULT_MAX_TOKENS = 128        # gateway --default-max-tokens (shrunk to what the context holds)
MAX_TOKENS_LIMIT = 1024         # gateway --max-tokens-limit default
MAX_BODY_BYTES = 1 << 20        # gateway --max-body-bytes default (413 above it)
MIN_BODY_BYTES = 1024           # the smallest --max-body-bytes a gateway accepts

# ---- sampling ---------------------------------------------------------------------------
TEMPERATURE_MIN, TEMPERATURE_MAX = 0.0, 2.0     # 0 = greedy
TOP_P_MIN, TOP_P_MAX = 0.0, 1.0
REPETITION_PENALTY_MAX = 10.0                   # (0, max]; 1 = off
SEED_MAX = U64_MAX


@dataclass(frozen=True)
class SamplingDefaults:
    """What an unset sampling field means for a model family."""

    use_entropy_sampling: bool
    temperature: float
    top_p: float
    repetition_penalty: float


# Steerling: the public package's GenerationConfig defaults (cde.steerling.sampling.SamplingParams;
# a test keeps the two equal). Causal (I-DLM): plain temperature sampling, no penalty (a penalty
# would break ISD's lossless acceptance rule).
STEERLING_SAMPLING = SamplingDefaults(use_entropy_sampling=True, temperature=1.2, top_p=0.8, repetition_penalty=1.1)
CAUSAL_SAMPLING = SamplingDefaults(use_entropy_sampling=False, temperature=1.0, top_p=1.0, repetition_penalty=1.0)

# ---- decoding ---------------------------------------------------------------------------
DEFAULT_TOKENS_PER_STEP = 1
THRESHOLD_MIN_EXCLUSIVE, THRESHOLD_MAX = 0.0, 1.0   # decode.threshold in (0, 1]
DEFAULT_STRIDE = 4              # causal models: decode.stride unset
MAX_STRIDE = 8                  # the workers' default --max-stride


def tokens_per_step_bounds(diff_block_size: int) -> tuple[int, int]:
    """decode.tokens_per_step: at least one, at most the whole diffusion block."""
    return 1, diff_block_size


# ---- stops ------------------------------------------------------------------------------
MAX_STOP_STRINGS = 4
MAX_STOP_STRING_CHARS = 256
MAX_STOP_IDS = 16

# ---- steering ---------------------------------------------------------------------------
MAX_CONCEPTS = 16               # steering.concepts per request
CONCEPT_NAME_MAX = 256          # characters of steering.concepts[].name
STRENGTH_MAX = 10.0             # per-concept weight in the direction, (0, max]
DEFAULT_STRENGTH = 1.0
TARGET_ABS_MAX = 50.0           # amplify: logit units; suppress: raw alpha
AMPLIFY_TARGET = 8.0            # the public package's presets
SUPPRESS_TARGET = -7.0
CUTOFF_MIN, CUTOFF_MAX = 1, 4096    # steering.cutoff (hard_cutoff schedule), tokens
DEFAULT_CUTOFF = 32
AMPLIFY_INJECT_LAYER = 8        # the preset's layer, meant for 32-layer models


REFERENCE_N_LAYERS = 32   # Steerling-8B, whose amplify preset injects from layer 8


def inject_layer_bounds(n_layers: int) -> tuple[int, int]:
    """steering.inject_layer: the model adds the direction at block i when i + 1 >= inject_layer,
    so 1 steers every block and n_layers only the last (0 would mean the same as 1; more than
    n_layers would steer nothing)."""
    return 1, n_layers


def default_inject_layer(n_layers: int, amplify: bool) -> int:
    """Amplify: the preset's layer 8 of Steerling-8B's 32, scaled to the model's depth (rounded
    up, at least 1), so a small model is steered over the same share of its blocks (clamping 8
    to a 6-layer model steered only its last block, which moves single tokens instead of the
    text); suppress: the public package's n_layers // 2 (at least 1)."""
    if amplify:
        return max(1, -(-n_layers * AMPLIFY_INJECT_LAYER // REFERENCE_N_LAYERS))
    return max(1, n_layers // 2)


# ---- attribution ------------------------------------------------------------------------
DEFAULT_ATTRIBUTION_TOP_K = 8
ATTRIBUTION_TOP_K_MAX = 64

# ---- OpenAI fields accepted with one value only -------------------------------------------
N_MAX = 1                       # n and best_of: one choice per request
# logprobs / top_logprobs, presence_penalty, frequency_penalty, logit_bias: refused when set
# (use attribution and repetition_penalty instead).

# ---- concept catalog --------------------------------------------------------------------
SEARCH_QUERY_MAX_CHARS = 200
DEFAULT_SEARCH_LIMIT = 20
SEARCH_LIMIT_MAX = 200
DEFAULT_LIST_LIMIT = 50
LIST_LIMIT_MAX = 500
DEFAULT_TOP_TOKENS = 15         # the public package's concept_top_tokens(k=15)
TOP_TOKENS_MAX = 100


# ---- the documented table -----------------------------------------------------------------
@dataclass(frozen=True)
class Limit:
    """One row of the README's Limits table."""

    field: str
    bound: str
    default: str
    note: str = ""


def _g(x: float) -> str:
    return f"{x:g}"


def documented_limits() -> tuple[Limit, ...]:
    """Every limit a client can hit, as the README states it."""
    return (
        Limit("`max_tokens` / `max_completion_tokens`", f"[1, `--max-tokens-limit`] (default limit {MAX_TOKENS_LIMIT})",
              f"{DEFAULT_MAX_TOKENS}, shrunk to what the context holds", "prompt + max_tokens <= context length"),
        Limit("context length", "the model's `max_context` (`GET /v1/models`)", "-",
              "400 `context_length_exceeded` above it"),
        Limit("request body", f"`--max-body-bytes` (default {MAX_BODY_BYTES} bytes)", "-", "413 above it"),
        Limit("`temperature`", f"[{_g(TEMPERATURE_MIN)}, {_g(TEMPERATURE_MAX)}]",
              f"{_g(STEERLING_SAMPLING.temperature)} (causal: {_g(CAUSAL_SAMPLING.temperature)})",
              "setting it turns entropy sampling off; 0 = greedy"),
        Limit("`top_p`", f"[{_g(TOP_P_MIN)}, {_g(TOP_P_MAX)}]",
              f"{_g(STEERLING_SAMPLING.top_p)} (causal: {_g(CAUSAL_SAMPLING.top_p)})"),
        Limit("`repetition_penalty`", f"(0, {_g(REPETITION_PENALTY_MAX)}]",
              f"{_g(STEERLING_SAMPLING.repetition_penalty)} (causal: must be 1)"),
        Limit("`presence_penalty`, `frequency_penalty`, `logit_bias`", "0 / unset", "-",
              "any other value is refused (use `repetition_penalty`)"),
        Limit("`seed`", f"[0, 2^64 - 1]", "server-chosen, reported as `cde.seed`"),
        Limit("`n`, `best_of`", f"{N_MAX}", f"{N_MAX}"),
        Limit("`logprobs`, `top_logprobs`", "unset", "-", "refused when set (see `attribution`)"),
        Limit("`stop`", f"at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_STRING_CHARS} characters", "none"),
        Limit("`stop_token_ids`", f"at most {MAX_STOP_IDS} vocabulary ids", "none"),
        Limit("`decode.tokens_per_step`", "[1, diffusion block size] (64)", f"{DEFAULT_TOKENS_PER_STEP}"),
        Limit("`decode.threshold`", f"({_g(THRESHOLD_MIN_EXCLUSIVE)}, {_g(THRESHOLD_MAX)}]", "unset"),
        Limit("`decode.stride` (causal models)", f"[1, {MAX_STRIDE}]", f"{DEFAULT_STRIDE}", "1 = plain autoregressive"),
        Limit("`steering.concepts`", f"1 to {MAX_CONCEPTS}, names of at most {CONCEPT_NAME_MAX} characters", "-",
              "known, steerable concepts only"),
        Limit("`steering.concepts[].strength`", f"(0, {_g(STRENGTH_MAX)}]", _g(DEFAULT_STRENGTH)),
        Limit("`steering.target`", f"[-{_g(TARGET_ABS_MAX)}, {_g(TARGET_ABS_MAX)}]",
              f"amplify {_g(AMPLIFY_TARGET)}, suppress {_g(SUPPRESS_TARGET)}",
              "amplify: logit units; suppress: raw alpha"),
        Limit("`steering.inject_layer`", "[1, n_layers]",
              f"amplify ceil({AMPLIFY_INJECT_LAYER} * n_layers / {REFERENCE_N_LAYERS}) ({AMPLIFY_INJECT_LAYER} at {REFERENCE_N_LAYERS} layers), suppress max(1, n_layers // 2)",
              "layer i (from 1) and all after it are steered"),
        Limit("`steering.cutoff`", f"[{CUTOFF_MIN}, {CUTOFF_MAX}] tokens", f"{DEFAULT_CUTOFF}",
              "schedule `hard_cutoff` only"),
        Limit("`attribution_top_k`", f"[1, {ATTRIBUTION_TOP_K_MAX}]", f"{DEFAULT_ATTRIBUTION_TOP_K}"),
        Limit("`GET /v1/concepts?q=` search", f"`q` at most {SEARCH_QUERY_MAX_CHARS} characters, "
              f"`limit` [1, {SEARCH_LIMIT_MAX}]", f"{DEFAULT_SEARCH_LIMIT}"),
        Limit("`GET /v1/concepts` listing `limit`", f"[1, {LIST_LIMIT_MAX}]", f"{DEFAULT_LIST_LIMIT}"),
        Limit("`GET /v1/concepts/{id}?top_tokens=`", f"[0, {TOP_TOKENS_MAX}]", f"{DEFAULT_TOP_TOKENS}"),
    )


def markdown_table() -> str:
    """The README's Limits table (tests/test_limits.py checks the README carries it verbatim)."""
    rows = ["| field | accepted | default | notes |", "|---|---|---|---|"]
    rows += [f"| {r.field} | {r.bound} | {r.default} | {r.note} |".replace("|  |", "| |") for r in documented_limits()]
    return "\n".join(rows)


if __name__ == "__main__":  # python -m cde.limits: print the table for the README
    print(markdown_table())
