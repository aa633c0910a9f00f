from cde.rpc.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class ChatMessages(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "model", "prompt", "chat", "token_ids", "decode", "sampling", "steering", "attribution", "attribution_top_k", "stream_steps", "logprobs", "top_logprobs", "response_format")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DECODE_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    STEERING_FIELD_NUMBER: _ClassVar[int]
    ATTRIBUTION_FIELD_NUMBER: _ClassVar[int]
    ATTRIBUTION_TOP_K_FIELD_NUMBER: _ClassVar[int]
    STREAM_STEPS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FORMAT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model: str
    prompt: str
    chat: ChatMessages
    token_ids: TokenIds
    decode: _common_pb2.DecodeOptions
    sampling: _common_pb2.SamplingOptions
    steering: _common_pb2.SteeringRequest
    attribution: _common_pb2.AttributionMode
    attribution_top_k: int
    stream_steps: bool
    logprobs: bool
    top_logprobs: int
    response_format: ResponseFormat
    def __init__(self, request_id: _Optional[str] = ..., model: _Optional[str] = ..., prompt: _Optional[str] = ..., chat: _Optional[_Union[ChatMessages, _Mapping]] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., decode: _Optional[_Union[_common_pb2.DecodeOptions, _Mapping]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingOptions, _Mapping]] = ..., steering: _Optional[_Union[_common_pb2.SteeringRequest, _Mapping]] = ..., attribution: _Optional[_Union[_common_pb2.AttributionMode, str]] = ..., attribution_top_k: _Optional[int] = ..., stream_steps: bool = ..., logprobs: bool = ..., top_logprobs: _Optional[int] = ..., response_format: _Optional[_Union[ResponseFormat, _Mapping]] = ...) -> None: ...

class ResponseFormat(_message.Message):
    __slots__ = ("json_object", "json_schema", "regex")
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    json_object: bool
    json_schema: str
    regex: str
    def __init__(self, json_object: bool = ..., json_schema: _Optional[str] = ..., regex: _Optional[str] = ...) -> None: ...

class BlockEvent(_message.Message):
    __slots__ = ("block_index", "start", "tokens", "text", "token_attributions", "chunk_attributions", "logprobs")
    BLOCK_INDEX_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ATTRIBUTIONS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_ATTRIBUTIONS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    block_index: int
    start: int
    tokens: _containers.RepeatedScalarFieldContainer[int]
    text: str
    token_attributions: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenAttribution]
    chunk_attributions: _containers.RepeatedCompositeFieldContainer[_common_pb2.ChunkAttribution]
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenScore]
    def __init__(self, block_index: _Optional[int] = ..., start: _Optional[int] = ..., tokens: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., token_attributions: _Optional[_Iterable[_Union[_common_pb2.TokenAttribution, _Mapping]]] = ..., chunk_attributions: _Optional[_Iterable[_Union[_common_pb2.ChunkAttribution, _Mapping]]] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenScore, _Mapping]]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("accepted", "step", "block", "finished")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    BLOCK_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    accepted: _common_pb2.Accepted
    step: _common_pb2.StepEvent
    block: BlockEvent
    finished: _common_pb2.Finished
    def __init__(self, accepted: _Optional[_Union[_common_pb2.Accepted, _Mapping]] = ..., step: _Optional[_Union[_common_pb2.StepEvent, _Mapping]] = ..., block: _Optional[_Union[BlockEvent, _Mapping]] = ..., finished: _Optional[_Union[_common_pb2.Finished, _Mapping]] = ...) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("id", "diffusion_block_size", "max_context", "n_known_concepts", "n_discovered_concepts", "family")
    ID_FIELD_NUMBER: _ClassVar[int]
    DIFFUSION_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    N_KNOWN_CONCEPTS_FIELD_NUMBER: _ClassVar[int]
    N_DISCOVERED_CONCEPTS_FIELD_NUMBER: _ClassVar[int]
    FAMILY_FIELD_NUMBER: _ClassVar[int]
    id: str
    diffusion_block_size: int
    max_context: int
    n_known_concepts: int
    n_discovered_concepts: int
    family: str
    def __init__(self, id: _Optional[str] = ..., diffusion_block_size: _Optional[int] = ..., max_context: _Optional[int] = ..., n_known_concepts: _Optional[int] = ..., n_discovered_concepts: _Optional[int] = ..., family: _Optional[str] = ...) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("models",)
    MODELS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[ModelInfo]
    def __init__(self, models: _Optional[_Iterable[_Union[ModelInfo, _Mapping]]] = ...) -> None: ...
