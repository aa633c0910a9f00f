from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class IsdAdapter(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ISD_ADAPTER_UNSPECIFIED: _ClassVar[IsdAdapter]
    ISD_ADAPTER_GATED: _ClassVar[IsdAdapter]
    ISD_ADAPTER_UNGATED: _ClassVar[IsdAdapter]
ISD_ADAPTER_UNSPECIFIED: IsdAdapter
ISD_ADAPTER_GATED: IsdAdapter
ISD_ADAPTER_UNGATED: IsdAdapter

class ResolvedSampling(_message.Message):
    __slots__ = ("use_entropy_sampling", "temperature", "top_p", "top_k", "repetition_penalty")
    USE_ENTROPY_SAMPLING_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    use_entropy_sampling: bool
    temperature: float
    top_p: float
    top_k: int
    repetition_penalty: float
    def __init__(self, use_entropy_sampling: bool = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., repetition_penalty: _Optional[float] = ...) -> None: ...

class BlockDiffusion(_message.Message):
    __slots__ = ("tokens_per_step", "confidence_threshold")
    TOKENS_PER_STEP_FIELD_NUMBER: _ClassVar[int]
    CONFIDENCE_THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    tokens_per_step: int
    confidence_threshold: float
    def __init__(self, tokens_per_step: _Optional[int] = ..., confidence_threshold: _Optional[float] = ...) -> None: ...

class Isd(_message.Message):
    __slots__ = ("stride", "adapter")
    STRIDE_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    stride: int
    adapter: IsdAdapter
    def __init__(self, stride: _Optional[int] = ..., adapter: _Optional[_Union[IsdAdapter, str]] = ...) -> None: ...

class ResolvedOptions(_message.Message):
    __slots__ = ("seed", "max_new_tokens", "stop_ids", "sampling", "block_diffusion", "isd")
    SEED_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    BLOCK_DIFFUSION_FIELD_NUMBER: _ClassVar[int]
    ISD_FIELD_NUMBER: _ClassVar[int]
    seed: int
    max_new_tokens: int
    stop_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: ResolvedSampling
    block_diffusion: BlockDiffusion
    isd: Isd
    def __init__(self, seed: _Optional[int] = ..., max_new_tokens: _Optional[int] = ..., stop_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[ResolvedSampling, _Mapping]] = ..., block_diffusion: _Optional[_Union[BlockDiffusion, _Mapping]] = ..., isd: _Optional[_Union[Isd, _Mapping]] = ...) -> None: ...
