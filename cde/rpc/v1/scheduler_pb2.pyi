from cde.rpc.v1 import common_pb2 as _common_pb2
from cde.rpc.v1 import resolved_pb2 as _resolved_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SubmitRequest(_message.Message):
    __slots__ = ("request_id", "model", "prompt_tokens", "options", "steering", "attribution", "attribution_top_k", "stream_steps", "top_logprobs", "grammar")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    STEERING_FIELD_NUMBER: _ClassVar[int]
    ATTRIBUTION_FIELD_NUMBER: _ClassVar[int]
    ATTRIBUTION_TOP_K_FIELD_NUMBER: _ClassVar[int]
    STREAM_STEPS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model: str
    prompt_tokens: _containers.RepeatedScalarFieldContainer[int]
    options: _resolved_pb2.ResolvedOptions
    steering: _common_pb2.PreparedSteering
    attribution: _common_pb2.AttributionMode
    attribution_top_k: int
    stream_steps: bool
    top_logprobs: int
    grammar: str
    def __init__(self, request_id: _Optional[str] = ..., model: _Optional[str] = ..., prompt_tokens: _Optional[_Iterable[int]] = ..., options: _Optional[_Union[_resolved_pb2.ResolvedOptions, _Mapping]] = ..., steering: _Optional[_Union[_common_pb2.PreparedSteering, _Mapping]] = ..., attribution: _Optional[_Union[_common_pb2.AttributionMode, str]] = ..., attribution_top_k: _Optional[int] = ..., stream_steps: bool = ..., top_logprobs: _Optional[int] = ..., grammar: _Optional[str] = ...) -> None: ...

class DetachRequest(_message.Message):
    __slots__ = ("request_id", "attach_id")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ATTACH_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    attach_id: str
    def __init__(self, request_id: _Optional[str] = ..., attach_id: _Optional[str] = ...) -> None: ...

class SchedulerEvent(_message.Message):
    __slots__ = ("accepted", "step", "block", "finished")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    BLOCK_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    accepted: _common_pb2.Accepted
    step: _common_pb2.StepEvent
    block: _common_pb2.BlockCommitted
    finished: _common_pb2.Finished
    def __init__(self, accepted: _Optional[_Union[_common_pb2.Accepted, _Mapping]] = ..., step: _Optional[_Union[_common_pb2.StepEvent, _Mapping]] = ..., block: _Optional[_Union[_common_pb2.BlockCommitted, _Mapping]] = ..., finished: _Optional[_Union[_common_pb2.Finished, _Mapping]] = ...) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("worker_id", "address", "model", "kv_pages_total", "kv_pages_free", "running", "waiting", "draining", "prefix_cache_queries", "prefix_cache_hits")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    KV_PAGES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_PAGES_FREE_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    address: str
    model: str
    kv_pages_total: int
    kv_pages_free: int
    running: int
    waiting: int
    draining: bool
    prefix_cache_queries: int
    prefix_cache_hits: int
    def __init__(self, worker_id: _Optional[str] = ..., address: _Optional[str] = ..., model: _Optional[str] = ..., kv_pages_total: _Optional[int] = ..., kv_pages_free: _Optional[int] = ..., running: _Optional[int] = ..., waiting: _Optional[int] = ..., draining: bool = ..., prefix_cache_queries: _Optional[int] = ..., prefix_cache_hits: _Optional[int] = ...) -> None: ...

class WorkerAck(_message.Message):
    __slots__ = ("heartbeat_interval_ms",)
    HEARTBEAT_INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    heartbeat_interval_ms: int
    def __init__(self, heartbeat_interval_ms: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("running", "waiting", "workers", "placed", "submit_to_worker_seconds_sum", "first_blocks", "first_block_relay_seconds_sum")
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    PLACED_FIELD_NUMBER: _ClassVar[int]
    SUBMIT_TO_WORKER_SECONDS_SUM_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_RELAY_SECONDS_SUM_FIELD_NUMBER: _ClassVar[int]
    running: int
    waiting: int
    workers: _containers.RepeatedCompositeFieldContainer[WorkerInfo]
    placed: int
    submit_to_worker_seconds_sum: float
    first_blocks: int
    first_block_relay_seconds_sum: float
    def __init__(self, running: _Optional[int] = ..., waiting: _Optional[int] = ..., workers: _Optional[_Iterable[_Union[WorkerInfo, _Mapping]]] = ..., placed: _Optional[int] = ..., submit_to_worker_seconds_sum: _Optional[float] = ..., first_blocks: _Optional[int] = ..., first_block_relay_seconds_sum: _Optional[float] = ...) -> None: ...
