from cde.rpc.v1 import common_pb2 as _common_pb2
from cde.rpc.v1 import resolved_pb2 as _resolved_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class InputAttributionJob(_message.Message):
    __slots__ = ("request_id", "model", "prompt_tokens", "options", "steering", "generated", "positions", "chunk_start", "chunk_end", "n_steps")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    STEERING_FIELD_NUMBER: _ClassVar[int]
    GENERATED_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_START_FIELD_NUMBER: _ClassVar[int]
    CHUNK_END_FIELD_NUMBER: _ClassVar[int]
    N_STEPS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model: str
    prompt_tokens: _containers.RepeatedScalarFieldContainer[int]
    options: _resolved_pb2.ResolvedOptions
    steering: _common_pb2.PreparedSteering
    generated: _containers.RepeatedScalarFieldContainer[int]
    positions: _containers.RepeatedScalarFieldContainer[int]
    chunk_start: int
    chunk_end: int
    n_steps: int
    def __init__(self, request_id: _Optional[str] = ..., model: _Optional[str] = ..., prompt_tokens: _Optional[_Iterable[int]] = ..., options: _Optional[_Union[_resolved_pb2.ResolvedOptions, _Mapping]] = ..., steering: _Optional[_Union[_common_pb2.PreparedSteering, _Mapping]] = ..., generated: _Optional[_Iterable[int]] = ..., positions: _Optional[_Iterable[int]] = ..., chunk_start: _Optional[int] = ..., chunk_end: _Optional[int] = ..., n_steps: _Optional[int] = ...) -> None: ...

class AttributeRequest(_message.Message):
    __slots__ = ("request_id", "model", "block_index", "mode", "top_k", "records", "start", "context_tokens", "last")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    BLOCK_INDEX_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    RECORDS_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model: str
    block_index: int
    mode: _common_pb2.AttributionMode
    top_k: int
    records: _common_pb2.RawConceptRecords
    start: int
    context_tokens: _containers.RepeatedScalarFieldContainer[int]
    last: bool
    def __init__(self, request_id: _Optional[str] = ..., model: _Optional[str] = ..., block_index: _Optional[int] = ..., mode: _Optional[_Union[_common_pb2.AttributionMode, str]] = ..., top_k: _Optional[int] = ..., records: _Optional[_Union[_common_pb2.RawConceptRecords, _Mapping]] = ..., start: _Optional[int] = ..., context_tokens: _Optional[_Iterable[int]] = ..., last: bool = ...) -> None: ...

class AttributeResponse(_message.Message):
    __slots__ = ("request_id", "block_index", "token_attributions", "chunk_attributions")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ATTRIBUTIONS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_ATTRIBUTIONS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    block_index: int
    token_attributions: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenAttribution]
    chunk_attributions: _containers.RepeatedCompositeFieldContainer[_common_pb2.ChunkAttribution]
    def __init__(self, request_id: _Optional[str] = ..., block_index: _Optional[int] = ..., token_attributions: _Optional[_Iterable[_Union[_common_pb2.TokenAttribution, _Mapping]]] = ..., chunk_attributions: _Optional[_Iterable[_Union[_common_pb2.ChunkAttribution, _Mapping]]] = ...) -> None: ...
