from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class AttributionMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ATTRIBUTION_NONE: _ClassVar[AttributionMode]
    ATTRIBUTION_TOKENS: _ClassVar[AttributionMode]
    ATTRIBUTION_CHUNKS: _ClassVar[AttributionMode]
    ATTRIBUTION_ALL: _ClassVar[AttributionMode]

class SteeringMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STEERING_MODE_AMPLIFY: _ClassVar[SteeringMode]
    STEERING_MODE_SUPPRESS: _ClassVar[SteeringMode]

class SteeringSchedule(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STEERING_SCHEDULE_DEFAULT: _ClassVar[SteeringSchedule]
    STEERING_SCHEDULE_FIXED: _ClassVar[SteeringSchedule]
    STEERING_SCHEDULE_HARD_CUTOFF: _ClassVar[SteeringSchedule]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_CANCELLED: _ClassVar[FinishReason]
    FINISH_REASON_ERROR: _ClassVar[FinishReason]
ATTRIBUTION_NONE: AttributionMode
ATTRIBUTION_TOKENS: AttributionMode
ATTRIBUTION_CHUNKS: AttributionMode
ATTRIBUTION_ALL: AttributionMode
STEERING_MODE_AMPLIFY: SteeringMode
STEERING_MODE_SUPPRESS: SteeringMode
STEERING_SCHEDULE_DEFAULT: SteeringSchedule
STEERING_SCHEDULE_FIXED: SteeringSchedule
STEERING_SCHEDULE_HARD_CUTOFF: SteeringSchedule
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_CANCELLED: FinishReason
FINISH_REASON_ERROR: FinishReason

class SamplingOptions(_message.Message):
    __slots__ = ("use_entropy_sampling", "temperature", "top_p", "repetition_penalty")
    USE_ENTROPY_SAMPLING_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    use_entropy_sampling: bool
    temperature: float
    top_p: float
    repetition_penalty: float
    def __init__(self, use_entropy_sampling: bool = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., repetition_penalty: _Optional[float] = ...) -> None: ...

class DecodeOptions(_message.Message):
    __slots__ = ("max_new_tokens", "tokens_per_step", "confidence_threshold", "seed", "stop_ids", "isd_stride")
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_STEP_FIELD_NUMBER: _ClassVar[int]
    CONFIDENCE_THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_IDS_FIELD_NUMBER: _ClassVar[int]
    ISD_STRIDE_FIELD_NUMBER: _ClassVar[int]
    max_new_tokens: int
    tokens_per_step: int
    confidence_threshold: float
    seed: int
    stop_ids: _containers.RepeatedScalarFieldContainer[int]
    isd_stride: int
    def __init__(self, max_new_tokens: _Optional[int] = ..., tokens_per_step: _Optional[int] = ..., confidence_threshold: _Optional[float] = ..., seed: _Optional[int] = ..., stop_ids: _Optional[_Iterable[int]] = ..., isd_stride: _Optional[int] = ...) -> None: ...

class SteeringConcept(_message.Message):
    __slots__ = ("concept_id", "name", "strength")
    CONCEPT_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    STRENGTH_FIELD_NUMBER: _ClassVar[int]
    concept_id: int
    name: str
    strength: float
    def __init__(self, concept_id: _Optional[int] = ..., name: _Optional[str] = ..., strength: _Optional[float] = ...) -> None: ...

class SteeringRequest(_message.Message):
    __slots__ = ("concepts", "mode", "target", "inject_layer", "schedule", "cutoff_tokens")
    CONCEPTS_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    INJECT_LAYER_FIELD_NUMBER: _ClassVar[int]
    SCHEDULE_FIELD_NUMBER: _ClassVar[int]
    CUTOFF_TOKENS_FIELD_NUMBER: _ClassVar[int]
    concepts: _containers.RepeatedCompositeFieldContainer[SteeringConcept]
    mode: SteeringMode
    target: float
    inject_layer: int
    schedule: SteeringSchedule
    cutoff_tokens: int
    def __init__(self, concepts: _Optional[_Iterable[_Union[SteeringConcept, _Mapping]]] = ..., mode: _Optional[_Union[SteeringMode, str]] = ..., target: _Optional[float] = ..., inject_layer: _Optional[int] = ..., schedule: _Optional[_Union[SteeringSchedule, str]] = ..., cutoff_tokens: _Optional[int] = ...) -> None: ...

class PreparedSteering(_message.Message):
    __slots__ = ("direction_f32", "base_alpha", "inject_layer", "schedule", "cutoff_tokens", "relu_mask_f32", "concept_ids", "model")
    DIRECTION_F32_FIELD_NUMBER: _ClassVar[int]
    BASE_ALPHA_FIELD_NUMBER: _ClassVar[int]
    INJECT_LAYER_FIELD_NUMBER: _ClassVar[int]
    SCHEDULE_FIELD_NUMBER: _ClassVar[int]
    CUTOFF_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RELU_MASK_F32_FIELD_NUMBER: _ClassVar[int]
    CONCEPT_IDS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    direction_f32: bytes
    base_alpha: float
    inject_layer: int
    schedule: SteeringSchedule
    cutoff_tokens: int
    relu_mask_f32: bytes
    concept_ids: _containers.RepeatedScalarFieldContainer[int]
    model: str
    def __init__(self, direction_f32: _Optional[bytes] = ..., base_alpha: _Optional[float] = ..., inject_layer: _Optional[int] = ..., schedule: _Optional[_Union[SteeringSchedule, str]] = ..., cutoff_tokens: _Optional[int] = ..., relu_mask_f32: _Optional[bytes] = ..., concept_ids: _Optional[_Iterable[int]] = ..., model: _Optional[str] = ...) -> None: ...

class Concept(_message.Message):
    __slots__ = ("id", "name", "head", "description", "group_id", "group_name", "steerable")
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    HEAD_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_NAME_FIELD_NUMBER: _ClassVar[int]
    STEERABLE_FIELD_NUMBER: _ClassVar[int]
    id: int
    name: str
    head: str
    description: str
    group_id: int
    group_name: str
    steerable: bool
    def __init__(self, id: _Optional[int] = ..., name: _Optional[str] = ..., head: _Optional[str] = ..., description: _Optional[str] = ..., group_id: _Optional[int] = ..., group_name: _Optional[str] = ..., steerable: bool = ...) -> None: ...

class SearchConceptsRequest(_message.Message):
    __slots__ = ("query", "limit", "known_only", "model")
    QUERY_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    KNOWN_ONLY_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    query: str
    limit: int
    known_only: bool
    model: str
    def __init__(self, query: _Optional[str] = ..., limit: _Optional[int] = ..., known_only: bool = ..., model: _Optional[str] = ...) -> None: ...

class SearchConceptsResponse(_message.Message):
    __slots__ = ("concepts",)
    CONCEPTS_FIELD_NUMBER: _ClassVar[int]
    concepts: _containers.RepeatedCompositeFieldContainer[Concept]
    def __init__(self, concepts: _Optional[_Iterable[_Union[Concept, _Mapping]]] = ...) -> None: ...

class RawConceptRecords(_message.Message):
    __slots__ = ("positions", "tokens", "target_logits", "k_known", "known_idx", "known_logits", "k_disc", "disc_idx", "disc_logits")
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    TARGET_LOGITS_FIELD_NUMBER: _ClassVar[int]
    K_KNOWN_FIELD_NUMBER: _ClassVar[int]
    KNOWN_IDX_FIELD_NUMBER: _ClassVar[int]
    KNOWN_LOGITS_FIELD_NUMBER: _ClassVar[int]
    K_DISC_FIELD_NUMBER: _ClassVar[int]
    DISC_IDX_FIELD_NUMBER: _ClassVar[int]
    DISC_LOGITS_FIELD_NUMBER: _ClassVar[int]
    positions: _containers.RepeatedScalarFieldContainer[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    target_logits: _containers.RepeatedScalarFieldContainer[float]
    k_known: int
    known_idx: _containers.RepeatedScalarFieldContainer[int]
    known_logits: _containers.RepeatedScalarFieldContainer[float]
    k_disc: int
    disc_idx: _containers.RepeatedScalarFieldContainer[int]
    disc_logits: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, positions: _Optional[_Iterable[int]] = ..., tokens: _Optional[_Iterable[int]] = ..., target_logits: _Optional[_Iterable[float]] = ..., k_known: _Optional[int] = ..., known_idx: _Optional[_Iterable[int]] = ..., known_logits: _Optional[_Iterable[float]] = ..., k_disc: _Optional[int] = ..., disc_idx: _Optional[_Iterable[int]] = ..., disc_logits: _Optional[_Iterable[float]] = ...) -> None: ...

class ConceptScore(_message.Message):
    __slots__ = ("concept_id", "label", "head", "score")
    CONCEPT_ID_FIELD_NUMBER: _ClassVar[int]
    LABEL_FIELD_NUMBER: _ClassVar[int]
    HEAD_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    concept_id: int
    label: str
    head: str
    score: float
    def __init__(self, concept_id: _Optional[int] = ..., label: _Optional[str] = ..., head: _Optional[str] = ..., score: _Optional[float] = ...) -> None: ...

class OtherConcepts(_message.Message):
    __slots__ = ("known", "discovered")
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    DISCOVERED_FIELD_NUMBER: _ClassVar[int]
    known: float
    discovered: float
    def __init__(self, known: _Optional[float] = ..., discovered: _Optional[float] = ...) -> None: ...

class TokenAttribution(_message.Message):
    __slots__ = ("position", "token", "target_logit", "residual", "top", "other", "commit_order")
    POSITION_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    TARGET_LOGIT_FIELD_NUMBER: _ClassVar[int]
    RESIDUAL_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    OTHER_FIELD_NUMBER: _ClassVar[int]
    COMMIT_ORDER_FIELD_NUMBER: _ClassVar[int]
    position: int
    token: int
    target_logit: float
    residual: float
    top: _containers.RepeatedCompositeFieldContainer[ConceptScore]
    other: OtherConcepts
    commit_order: int
    def __init__(self, position: _Optional[int] = ..., token: _Optional[int] = ..., target_logit: _Optional[float] = ..., residual: _Optional[float] = ..., top: _Optional[_Iterable[_Union[ConceptScore, _Mapping]]] = ..., other: _Optional[_Union[OtherConcepts, _Mapping]] = ..., commit_order: _Optional[int] = ...) -> None: ...

class ChunkAttribution(_message.Message):
    __slots__ = ("start", "end", "residual_pct", "top", "other")
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    RESIDUAL_PCT_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    OTHER_FIELD_NUMBER: _ClassVar[int]
    start: int
    end: int
    residual_pct: float
    top: _containers.RepeatedCompositeFieldContainer[ConceptScore]
    other: OtherConcepts
    def __init__(self, start: _Optional[int] = ..., end: _Optional[int] = ..., residual_pct: _Optional[float] = ..., top: _Optional[_Iterable[_Union[ConceptScore, _Mapping]]] = ..., other: _Optional[_Union[OtherConcepts, _Mapping]] = ...) -> None: ...

class Accepted(_message.Message):
    __slots__ = ("request_id", "prompt_tokens", "seed", "stop_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_tokens: int
    seed: int
    stop_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., seed: _Optional[int] = ..., stop_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class StepEvent(_message.Message):
    __slots__ = ("step", "block_index", "positions", "tokens", "drafts_proposed", "drafts_accepted", "rejected_token")
    STEP_FIELD_NUMBER: _ClassVar[int]
    BLOCK_INDEX_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFTS_PROPOSED_FIELD_NUMBER: _ClassVar[int]
    DRAFTS_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REJECTED_TOKEN_FIELD_NUMBER: _ClassVar[int]
    step: int
    block_index: int
    positions: _containers.RepeatedScalarFieldContainer[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    drafts_proposed: int
    drafts_accepted: int
    rejected_token: int
    def __init__(self, step: _Optional[int] = ..., block_index: _Optional[int] = ..., positions: _Optional[_Iterable[int]] = ..., tokens: _Optional[_Iterable[int]] = ..., drafts_proposed: _Optional[int] = ..., drafts_accepted: _Optional[int] = ..., rejected_token: _Optional[int] = ...) -> None: ...

class BlockCommitted(_message.Message):
    __slots__ = ("block_index", "start", "tokens", "records", "token_attributions", "chunk_attributions", "next_step", "last", "logprobs")
    BLOCK_INDEX_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    RECORDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ATTRIBUTIONS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_ATTRIBUTIONS_FIELD_NUMBER: _ClassVar[int]
    NEXT_STEP_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    block_index: int
    start: int
    tokens: _containers.RepeatedScalarFieldContainer[int]
    records: RawConceptRecords
    token_attributions: _containers.RepeatedCompositeFieldContainer[TokenAttribution]
    chunk_attributions: _containers.RepeatedCompositeFieldContainer[ChunkAttribution]
    next_step: int
    last: bool
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenScore]
    def __init__(self, block_index: _Optional[int] = ..., start: _Optional[int] = ..., tokens: _Optional[_Iterable[int]] = ..., records: _Optional[_Union[RawConceptRecords, _Mapping]] = ..., token_attributions: _Optional[_Iterable[_Union[TokenAttribution, _Mapping]]] = ..., chunk_attributions: _Optional[_Iterable[_Union[ChunkAttribution, _Mapping]]] = ..., next_step: _Optional[int] = ..., last: bool = ..., logprobs: _Optional[_Iterable[_Union[TokenScore, _Mapping]]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "steps", "forwards", "tokens_per_forward", "isd_acceptance")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    FORWARDS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_FORWARD_FIELD_NUMBER: _ClassVar[int]
    ISD_ACCEPTANCE_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    steps: int
    forwards: int
    tokens_per_forward: float
    isd_acceptance: float
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., steps: _Optional[int] = ..., forwards: _Optional[int] = ..., tokens_per_forward: _Optional[float] = ..., isd_acceptance: _Optional[float] = ...) -> None: ...

class Finished(_message.Message):
    __slots__ = ("reason", "usage", "message")
    REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    reason: FinishReason
    usage: Usage
    message: str
    def __init__(self, reason: _Optional[_Union[FinishReason, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., message: _Optional[str] = ...) -> None: ...

class ResumeRequest(_message.Message):
    __slots__ = ("request_id", "after_block")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    AFTER_BLOCK_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    after_block: int
    def __init__(self, request_id: _Optional[str] = ..., after_block: _Optional[int] = ...) -> None: ...

class CancelRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class CancelResponse(_message.Message):
    __slots__ = ("cancelled",)
    CANCELLED_FIELD_NUMBER: _ClassVar[int]
    cancelled: bool
    def __init__(self, cancelled: bool = ...) -> None: ...

class ScoreRequest(_message.Message):
    __slots__ = ("model", "tokens", "score_from", "top_logprobs", "seed", "mc_samples")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    SCORE_FROM_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MC_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    model: str
    tokens: _containers.RepeatedScalarFieldContainer[int]
    score_from: int
    top_logprobs: int
    seed: int
    mc_samples: int
    def __init__(self, model: _Optional[str] = ..., tokens: _Optional[_Iterable[int]] = ..., score_from: _Optional[int] = ..., top_logprobs: _Optional[int] = ..., seed: _Optional[int] = ..., mc_samples: _Optional[int] = ...) -> None: ...

class TokenScore(_message.Message):
    __slots__ = ("logprob", "greedy", "top_ids", "top_logprobs")
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    GREEDY_FIELD_NUMBER: _ClassVar[int]
    TOP_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    logprob: float
    greedy: bool
    top_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, logprob: _Optional[float] = ..., greedy: bool = ..., top_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class ScoreResponse(_message.Message):
    __slots__ = ("scores", "total")
    SCORES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    scores: _containers.RepeatedCompositeFieldContainer[TokenScore]
    total: float
    def __init__(self, scores: _Optional[_Iterable[_Union[TokenScore, _Mapping]]] = ..., total: _Optional[float] = ...) -> None: ...

class InputAttributionRequest(_message.Message):
    __slots__ = ("request_id", "positions", "chunk_start", "chunk_end", "n_steps")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_START_FIELD_NUMBER: _ClassVar[int]
    CHUNK_END_FIELD_NUMBER: _ClassVar[int]
    N_STEPS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    positions: _containers.RepeatedScalarFieldContainer[int]
    chunk_start: int
    chunk_end: int
    n_steps: int
    def __init__(self, request_id: _Optional[str] = ..., positions: _Optional[_Iterable[int]] = ..., chunk_start: _Optional[int] = ..., chunk_end: _Optional[int] = ..., n_steps: _Optional[int] = ...) -> None: ...

class InputScore(_message.Message):
    __slots__ = ("position", "token", "score", "normalized")
    POSITION_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    NORMALIZED_FIELD_NUMBER: _ClassVar[int]
    position: int
    token: int
    score: float
    normalized: float
    def __init__(self, position: _Optional[int] = ..., token: _Optional[int] = ..., score: _Optional[float] = ..., normalized: _Optional[float] = ...) -> None: ...

class TargetAttribution(_message.Message):
    __slots__ = ("position", "token", "commit_order", "inputs")
    POSITION_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    COMMIT_ORDER_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    position: int
    token: int
    commit_order: int
    inputs: _containers.RepeatedCompositeFieldContainer[InputScore]
    def __init__(self, position: _Optional[int] = ..., token: _Optional[int] = ..., commit_order: _Optional[int] = ..., inputs: _Optional[_Iterable[_Union[InputScore, _Mapping]]] = ...) -> None: ...

class InputAttributionProgress(_message.Message):
    __slots__ = ("done", "total")
    DONE_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    done: int
    total: int
    def __init__(self, done: _Optional[int] = ..., total: _Optional[int] = ...) -> None: ...

class InputAttributionEvent(_message.Message):
    __slots__ = ("progress", "target", "summary")
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    progress: InputAttributionProgress
    target: TargetAttribution
    summary: InputAttributionSummary
    def __init__(self, progress: _Optional[_Union[InputAttributionProgress, _Mapping]] = ..., target: _Optional[_Union[TargetAttribution, _Mapping]] = ..., summary: _Optional[_Union[InputAttributionSummary, _Mapping]] = ...) -> None: ...

class InputAttributionSummary(_message.Message):
    __slots__ = ("prompt", "targets", "n_steps")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    TARGETS_FIELD_NUMBER: _ClassVar[int]
    N_STEPS_FIELD_NUMBER: _ClassVar[int]
    prompt: _containers.RepeatedCompositeFieldContainer[InputScore]
    targets: int
    n_steps: int
    def __init__(self, prompt: _Optional[_Iterable[_Union[InputScore, _Mapping]]] = ..., targets: _Optional[int] = ..., n_steps: _Optional[int] = ...) -> None: ...
