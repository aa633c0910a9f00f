from cde.rpc.v1 import common_pb2 as _common_pb2
from cde.rpc.v1 import resolved_pb2 as _resolved_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WorkerSubmit(_message.Message):
    __slots__ = ("request_id", "prompt_tokens", "committed_tokens", "next_step", "options", "steering", "stream_steps", "no_records", "top_logprobs", "grammar")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NEXT_STEP_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    STEERING_FIELD_NUMBER: _ClassVar[int]
    STREAM_STEPS_FIELD_NUMBER: _ClassVar[int]
    NO_RECORDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_tokens: _containers.RepeatedScalarFieldContainer[int]
    committed_tokens: _containers.RepeatedScalarFieldContainer[int]
    next_step: int
    options: _resolved_pb2.ResolvedOptions
    steering: _common_pb2.PreparedSteering
    stream_steps: bool
    no_records: bool
    top_logprobs: int
    grammar: str
    def __init__(self, request_id: _Optional[str] = ..., prompt_tokens: _Optional[_Iterable[int]] = ..., committed_tokens: _Optional[_Iterable[int]] = ..., next_step: _Optional[int] = ..., options: _Optional[_Union[_resolved_pb2.ResolvedOptions, _Mapping]] = ..., steering: _Optional[_Union[_common_pb2.PreparedSteering, _Mapping]] = ..., stream_steps: bool = ..., no_records: bool = ..., top_logprobs: _Optional[int] = ..., grammar: _Optional[str] = ...) -> None: ...

class WorkerEvent(_message.Message):
    __slots__ = ("step", "block", "finished")
    STEP_FIELD_NUMBER: _ClassVar[int]
    BLOCK_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    step: _common_pb2.StepEvent
    block: _common_pb2.BlockCommitted
    finished: _common_pb2.Finished
    def __init__(self, step: _Optional[_Union[_common_pb2.StepEvent, _Mapping]] = ..., block: _Optional[_Union[_common_pb2.BlockCommitted, _Mapping]] = ..., finished: _Optional[_Union[_common_pb2.Finished, _Mapping]] = ...) -> None: ...

class WorkerStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerStatus(_message.Message):
    __slots__ = ("model", "preset", "dtype", "device", "kv_pages_total", "kv_pages_free", "running", "waiting", "steps", "compiles", "diffusion_block_size", "vocab_size", "n_known", "n_discovered", "max_context", "graphs", "overlapped_steps", "admitted", "queue_seconds_sum", "first_blocks", "first_block_seconds_sum", "late_plans", "late_plan_misses", "prefix_cache_queries", "prefix_cache_hits")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PRESET_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    KV_PAGES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_PAGES_FREE_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    COMPILES_FIELD_NUMBER: _ClassVar[int]
    DIFFUSION_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    N_KNOWN_FIELD_NUMBER: _ClassVar[int]
    N_DISCOVERED_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    GRAPHS_FIELD_NUMBER: _ClassVar[int]
    OVERLAPPED_STEPS_FIELD_NUMBER: _ClassVar[int]
    ADMITTED_FIELD_NUMBER: _ClassVar[int]
    QUEUE_SECONDS_SUM_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_SECONDS_SUM_FIELD_NUMBER: _ClassVar[int]
    LATE_PLANS_FIELD_NUMBER: _ClassVar[int]
    LATE_PLAN_MISSES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    model: str
    preset: str
    dtype: str
    device: str
    kv_pages_total: int
    kv_pages_free: int
    running: int
    waiting: int
    steps: int
    compiles: int
    diffusion_block_size: int
    vocab_size: int
    n_known: int
    n_discovered: int
    max_context: int
    graphs: int
    overlapped_steps: int
    admitted: int
    queue_seconds_sum: float
    first_blocks: int
    first_block_seconds_sum: float
    late_plans: int
    late_plan_misses: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    def __init__(self, model: _Optional[str] = ..., preset: _Optional[str] = ..., dtype: _Optional[str] = ..., device: _Optional[str] = ..., kv_pages_total: _Optional[int] = ..., kv_pages_free: _Optional[int] = ..., running: _Optional[int] = ..., waiting: _Optional[int] = ..., steps: _Optional[int] = ..., compiles: _Optional[int] = ..., diffusion_block_size: _Optional[int] = ..., vocab_size: _Optional[int] = ..., n_known: _Optional[int] = ..., n_discovered: _Optional[int] = ..., max_context: _Optional[int] = ..., graphs: _Optional[int] = ..., overlapped_steps: _Optional[int] = ..., admitted: _Optional[int] = ..., queue_seconds_sum: _Optional[float] = ..., first_blocks: _Optional[int] = ..., first_block_seconds_sum: _Optional[float] = ..., late_plans: _Optional[int] = ..., late_plan_misses: _Optional[int] = ..., prefix_cache_queries: _Optional[int] = ..., prefix_cache_hits: _Optional[int] = ...) -> None: ...
