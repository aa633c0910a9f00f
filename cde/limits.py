"""Every request bound and default, and the checks that apply them; torch-free.

The gateway (its pydantic schemas declare the constants, `gateway.resolve` calls the checks) and
steering_svc import their bounds from here, so a value one service accepts is never refused by
the next one for being out of range. Model-dependent bounds are functions of the model's sizes.
A check raises `LimitError` naming the offending field as the REST API spells it. The README's
"Limits" table is `markdown_table()` (a test keeps the two equal).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
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
REFERENCE_N_LAYERS = 32         # Steerling-8B, whose amplify preset injects from layer 8
INJECT_LAYER_DEFAULT_TEXT = (f"amplify ceil({AMPLIFY_INJECT_LAYER} * n_layers / {REFERENCE_N_LAYERS}) "
                             f"({AMPLIFY_INJECT_LAYER} at {REFERENCE_N_LAYERS} layers), suppress max(1, n_layers // 2)")


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


@dataclass(frozen=True)
class SteeringPreset:
    """What the unset steering fields of a mode mean (the public package's presets)."""

    target: float
    inject_layer: int
    schedule: str               # "hard_cutoff" | "fixed"
    cutoff: int


def steering_preset(n_layers: int, amplify: bool) -> SteeringPreset:
    """Amplify: target 8 logits, hard cutoff after 32 tokens; suppress: raw alpha -7, fixed."""
    if amplify:
        return SteeringPreset(AMPLIFY_TARGET, default_inject_layer(n_layers, True), "hard_cutoff", DEFAULT_CUTOFF)
    return SteeringPreset(SUPPRESS_TARGET, default_inject_layer(n_layers, False), "fixed", DEFAULT_CUTOFF)


# ---- attribution ------------------------------------------------------------------------
DEFAULT_ATTRIBUTION_TOP_K = 8
ATTRIBUTION_TOP_K_MAX = 64
# input attribution (POST /v1/attributions/inputs): integrated gradients per target token
DEFAULT_IG_STEPS = 32           # the public package's n_steps
IG_STEPS_MAX = 256
INPUT_TARGETS_MAX = 64          # generated tokens explained per call (a chunk counts its committed tokens)

# ---- OpenAI fields accepted with one value only -------------------------------------------
N_MAX = 16                      # n: choices per request (each its own scheduler request)
BEST_OF_MAX = 1                 # best_of: not served beyond 1
# presence_penalty, frequency_penalty, logit_bias: refused when set (use repetition_penalty).

# ---- logprobs and scoring given text (echo) ------------------------------------------------
TOP_LOGPROBS_MAX = 20           # chat top_logprobs and completions logprobs: alternatives per token
DEFAULT_MC_SAMPLES = 128        # block diffusion echo logprobs: the public package's mc_num
MC_SAMPLES_MAX = 1024
MC_BATCH_SIZE = 32              # masked copies per forward (the package's mc_batch_size)
SCORE_QUEUE_MAX = 64            # scoring calls a worker holds (running + waiting) before RESOURCE_EXHAUSTED

# ---- concept catalog --------------------------------------------------------------------
SEARCH_QUERY_MAX_CHARS = 200
DEFAULT_SEARCH_LIMIT = 20
SEARCH_LIMIT_MAX = 200
DEFAULT_LIST_LIMIT = 50
LIST_LIMIT_MAX = 500
DEFAULT_TOP_TOKENS = 15         # the public package's concept_top_tokens(k=15)
TOP_TOKENS_MAX = 100


# ---- checks ---------------------------------------------------------------------------------
class LimitError(ValueError):
    """A value outside its bound. `path` is the field as the REST API spells it
    (`steering.concepts[0].strength`); `code` is the OpenAI error code where one applies."""

    def __init__(self, path: str, message: str, code: str | None = None):
        super().__init__(message)
        self.path, self.message, self.code = path, message, code


def _finite_in(x: float, lo: float, hi: float, *, lo_open: bool = False) -> bool:
    return math.isfinite(x) and (x > lo if lo_open else x >= lo) and x <= hi


def check_length(prompt_tokens: int, max_new_tokens: int | None, context: int, max_tokens_limit: int) -> None:
    """The completion fits this server's limit and, after the prompt, the model's context.
    `max_new_tokens` None: the client left it to the default, which shrinks to the room left."""
    if max_new_tokens is None:
        if prompt_tokens >= context:
            raise LimitError("prompt", f"the prompt ({prompt_tokens} tokens) fills this model's maximum context of "
                             f"{context} tokens", "context_length_exceeded")
        return
    if max_new_tokens > max_tokens_limit:
        raise LimitError("max_tokens", f"max_tokens {max_new_tokens} exceeds this server's limit of {max_tokens_limit}")
    if prompt_tokens + max_new_tokens > context:
        raise LimitError("max_tokens", f"this model's maximum context length is {context} tokens; the request asks "
                         f"for {prompt_tokens + max_new_tokens} ({prompt_tokens} in the prompt, {max_new_tokens} for "
                         "the completion)", "context_length_exceeded")


def check_sampling(temperature: float, top_p: float, repetition_penalty: float) -> None:
    if not _finite_in(temperature, TEMPERATURE_MIN, TEMPERATURE_MAX):
        raise LimitError("temperature", f"temperature must be in [{TEMPERATURE_MIN:g}, {TEMPERATURE_MAX:g}]")
    if not _finite_in(top_p, TOP_P_MIN, TOP_P_MAX):
        raise LimitError("top_p", f"top_p must be in [{TOP_P_MIN:g}, {TOP_P_MAX:g}]")
    if not _finite_in(repetition_penalty, 0.0, REPETITION_PENALTY_MAX, lo_open=True):
        raise LimitError("repetition_penalty", f"repetition_penalty must be in (0, {REPETITION_PENALTY_MAX:g}]")


def check_tokens_per_step(tokens_per_step: int, diff_block_size: int) -> None:
    """Block diffusion: at least one position per step, at most the whole diffusion block."""
    lo, hi = tokens_per_step_bounds(diff_block_size)
    if not lo <= tokens_per_step <= hi:
        raise LimitError("decode.tokens_per_step", f"tokens_per_step must be in [{lo}, {hi}] (the diffusion block size)")


def check_threshold(threshold: float) -> None:
    if not _finite_in(threshold, THRESHOLD_MIN_EXCLUSIVE, THRESHOLD_MAX, lo_open=True):
        raise LimitError("decode.threshold", f"decode.threshold must be in ({THRESHOLD_MIN_EXCLUSIVE:g}, {THRESHOLD_MAX:g}]")


def check_stride(stride: int) -> None:
    """Causal models' decode.stride (a worker may allow fewer: its --max-stride)."""
    if not 1 <= stride <= MAX_STRIDE:
        raise LimitError("decode.stride", f"decode.stride must be in [1, {MAX_STRIDE}] (1 = plain autoregressive)")


def check_stop_ids(stop_ids: Sequence[int], vocab_size: int) -> None:
    if len(stop_ids) > MAX_STOP_IDS:
        raise LimitError("stop_token_ids", f"at most {MAX_STOP_IDS} stop ids")
    bad = next((i for i in stop_ids if not 0 <= i < vocab_size), None)
    if bad is not None:
        raise LimitError("stop_token_ids", f"stop token id {bad} is outside the vocabulary (size {vocab_size})")


def check_attribution_top_k(top_k: int) -> None:
    if not 1 <= top_k <= ATTRIBUTION_TOP_K_MAX:
        raise LimitError("attribution_top_k", f"attribution_top_k must be in [1, {ATTRIBUTION_TOP_K_MAX}]")


def check_concept_count(n: int) -> None:
    if n < 1:
        raise LimitError("steering.concepts", "steering needs at least one concept")
    if n > MAX_CONCEPTS:
        raise LimitError("steering.concepts", f"{n} steering concepts; at most {MAX_CONCEPTS}")


def check_concept(index: int, ref: str | int | None, strength: float | None) -> None:
    """steering.concepts[index]: `ref` is its name, its id, or None when it has neither;
    `strength` None is not checked (unset, or checked later with `check_strength`)."""
    path = f"steering.concepts[{index}]"
    if ref is None or (isinstance(ref, str) and not ref.strip()):
        raise LimitError(path, f"{path} needs an 'id' or a non-empty 'name'")
    if isinstance(ref, str) and len(ref) > CONCEPT_NAME_MAX:
        raise LimitError(f"{path}.name", f"{path}.name is longer than {CONCEPT_NAME_MAX} characters")
    if strength is not None:
        check_strength(index, strength)


def check_strength(index: int, strength: float) -> None:
    if not _finite_in(strength, 0.0, STRENGTH_MAX, lo_open=True):
        raise LimitError(f"steering.concepts[{index}].strength",
                         f"steering.concepts[{index}].strength must be in (0, {STRENGTH_MAX:g}]")


def check_steering_settings(target: float | None, inject_layer: int | None, cutoff: int | None, n_layers: int) -> None:
    """The steering fields besides the concepts (None = unset: the preset's)."""
    if target is not None and not _finite_in(target, -TARGET_ABS_MAX, TARGET_ABS_MAX):
        raise LimitError("steering.target", f"steering.target must be in [-{TARGET_ABS_MAX:g}, {TARGET_ABS_MAX:g}]")
    lo, hi = inject_layer_bounds(n_layers)
    if inject_layer is not None and not lo <= inject_layer <= hi:
        raise LimitError("steering.inject_layer", f"steering.inject_layer must be in [{lo}, {hi}] for this model")
    if cutoff is not None and not CUTOFF_MIN <= cutoff <= CUTOFF_MAX:
        raise LimitError("steering.cutoff", f"steering.cutoff must be in [{CUTOFF_MIN}, {CUTOFF_MAX}]")


def check_cutoff_applies(cutoff_set: bool, schedule: str) -> None:
    """A client's cutoff with an explicit fixed schedule is a mistake (the cutoff would be ignored)."""
    if cutoff_set and schedule == "fixed":
        raise LimitError("steering.cutoff", "steering.cutoff only applies to schedule 'hard_cutoff'")


def check_search(query: str, limit: int) -> None:
    """GET /v1/concepts?q=: `limit` 0 = the default."""
    if not query.strip():
        raise LimitError("q", "a search query is required (q is empty)")
    if len(query) > SEARCH_QUERY_MAX_CHARS:
        raise LimitError("q", f"q is {len(query)} characters; at most {SEARCH_QUERY_MAX_CHARS}")
    if limit > SEARCH_LIMIT_MAX:
        raise LimitError("limit", f"limit must be in [1, {SEARCH_LIMIT_MAX}]")


def check_list_limit(limit: int) -> None:
    """GET /v1/concepts listing: `limit` 0 = the default."""
    if limit > LIST_LIMIT_MAX:
        raise LimitError("limit", f"limit must be in [1, {LIST_LIMIT_MAX}]")


def check_input_attribution(n_steps: int, targets: int) -> None:
    if not 1 <= n_steps <= IG_STEPS_MAX:
        raise LimitError("n_steps", f"n_steps must be in [1, {IG_STEPS_MAX}]")
    if not 1 <= targets <= INPUT_TARGETS_MAX:
        raise LimitError("positions", f"between 1 and {INPUT_TARGETS_MAX} generated tokens per call; got {targets}")


def check_top_tokens(top_tokens: int) -> None:
    if not 0 <= top_tokens <= TOP_TOKENS_MAX:
        raise LimitError("top_tokens", f"top_tokens must be in [0, {TOP_TOKENS_MAX}]")


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
        Limit("`seed`", "[0, 2^64 - 1]", "server-chosen, reported as `cde.seed`"),
        Limit("`n`", f"[1, {N_MAX}]", "1", "choice i runs with seed + i (mod 2^64)"),
        Limit("`best_of`", f"{BEST_OF_MAX}", f"{BEST_OF_MAX}"),
        Limit("`logprobs` (completions), `top_logprobs` (chat)", f"[0, {TOP_LOGPROBS_MAX}]", "unset",
              "block diffusion: generated tokens at their committing step; `echo` needs `echo_context_tokens`"),
        Limit("`echo_context_tokens`", "[1, prompt tokens]", "-",
              f"block diffusion echo logprobs: the context; {DEFAULT_MC_SAMPLES} masked copies, seeded by `seed`"),
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
        Limit("`steering.inject_layer`", "[1, n_layers]", INJECT_LAYER_DEFAULT_TEXT,
              "layer i (from 1) and all after it are steered"),
        Limit("`steering.cutoff`", f"[{CUTOFF_MIN}, {CUTOFF_MAX}] tokens", f"{DEFAULT_CUTOFF}",
              "schedule `hard_cutoff` only"),
        Limit("`attribution_top_k`", f"[1, {ATTRIBUTION_TOP_K_MAX}]", f"{DEFAULT_ATTRIBUTION_TOP_K}"),
        Limit("input attribution `n_steps`", f"[1, {IG_STEPS_MAX}]", f"{DEFAULT_IG_STEPS}",
              "integrated-gradients points per target (`POST /v1/attributions/inputs`)"),
        Limit("input attribution `positions` / `chunk`", f"1 to {INPUT_TARGETS_MAX} generated tokens per call", "-"),
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
