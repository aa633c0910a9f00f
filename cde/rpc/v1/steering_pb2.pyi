from cde.rpc.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GetConceptRequest(_message.Message):
    __slots__ = ("concept_id", "name", "model")
    CONCEPT_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    concept_id: int
    name: str
    model: str
    def __init__(self, concept_id: _Optional[int] = ..., name: _Optional[str] = ..., model: _Optional[str] = ...) -> None: ...

class BuildSteeringRequest(_message.Message):
    __slots__ = ("model", "steering")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    STEERING_FIELD_NUMBER: _ClassVar[int]
    model: str
    steering: _common_pb2.SteeringRequest
    def __init__(self, model: _Optional[str] = ..., steering: _Optional[_Union[_common_pb2.SteeringRequest, _Mapping]] = ...) -> None: ...

class ListConceptsRequest(_message.Message):
    __slots__ = ("model", "limit", "after", "head", "group_id", "steerable")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    AFTER_FIELD_NUMBER: _ClassVar[int]
    HEAD_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    STEERABLE_FIELD_NUMBER: _ClassVar[int]
    model: str
    limit: int
    after: int
    head: str
    group_id: int
    steerable: bool
    def __init__(self, model: _Optional[str] = ..., limit: _Optional[int] = ..., after: _Optional[int] = ..., head: _Optional[str] = ..., group_id: _Optional[int] = ..., steerable: bool = ...) -> None: ...

class ListConceptsResponse(_message.Message):
    __slots__ = ("concepts", "has_more")
    CONCEPTS_FIELD_NUMBER: _ClassVar[int]
    HAS_MORE_FIELD_NUMBER: _ClassVar[int]
    concepts: _containers.RepeatedCompositeFieldContainer[_common_pb2.Concept]
    has_more: bool
    def __init__(self, concepts: _Optional[_Iterable[_Union[_common_pb2.Concept, _Mapping]]] = ..., has_more: bool = ...) -> None: ...

class DescribeConceptRequest(_message.Message):
    __slots__ = ("concept_id", "model", "top_tokens")
    CONCEPT_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    concept_id: int
    model: str
    top_tokens: int
    def __init__(self, concept_id: _Optional[int] = ..., model: _Optional[str] = ..., top_tokens: _Optional[int] = ...) -> None: ...

class ConceptTopToken(_message.Message):
    __slots__ = ("token_id", "score")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    score: float
    def __init__(self, token_id: _Optional[int] = ..., score: _Optional[float] = ...) -> None: ...

class ConceptDetail(_message.Message):
    __slots__ = ("concept", "top_tokens")
    CONCEPT_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    concept: _common_pb2.Concept
    top_tokens: _containers.RepeatedCompositeFieldContainer[ConceptTopToken]
    def __init__(self, concept: _Optional[_Union[_common_pb2.Concept, _Mapping]] = ..., top_tokens: _Optional[_Iterable[_Union[ConceptTopToken, _Mapping]]] = ...) -> None: ...
