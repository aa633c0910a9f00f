from cde.rpc.v1 import common_pb2 as _common_pb2
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Mapping as _Mapping, Optional as _Optional, Union as _Union

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
