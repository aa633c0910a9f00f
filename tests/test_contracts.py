"""The cde.v1 contracts: stubs match the .proto files, changes stay backward compatible with
the golden descriptor set (and the checker really catches breaks), and the generated stubs
work over a real grpc.aio server with health, reflection and message-size limits.
"""

from __future__ import annotations

import asyncio
import copy
import importlib.util
import os
import subprocess
import sys
from contextlib import asynccontextmanager
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from google.protobuf.descriptor_pb2 import FieldDescriptorProto, FileDescriptorSet
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from cde.rpc import (MAX_MESSAGE_BYTES, bytes_to_floats, channel_options, floats_to_bytes, make_server,
                     service_name)
from cde.rpc import resolved
from cde.rpc.compat import check, load, loaded_descriptor_set
from cde.rpc.v1 import (attribution_pb2, attribution_pb2_grpc, common_pb2, generate_pb2, generate_pb2_grpc,
                        scheduler_pb2, scheduler_pb2_grpc, steering_pb2, steering_pb2_grpc, worker_pb2,
                        worker_pb2_grpc)

pytestmark = pytest.mark.contract

ROOT = Path(__file__).resolve().parents[1]
STUBS = ROOT / "cde" / "rpc" / "v1"
GOLDEN = ROOT / "protos" / "golden" / "cde_v1.binpb"
HAVE_PROTOC = importlib.util.find_spec("grpc_tools") is not None
needs_protoc = pytest.mark.skipif(not HAVE_PROTOC, reason="grpcio-tools not installed")


def _generate(out: Path) -> None:
    subprocess.run(["bash", str(ROOT / "scripts" / "gen_protos.sh"), "--out", str(out)], check=True,
                   env={**os.environ, "PYTHON": sys.executable}, capture_output=True)


def _files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.is_file()}


# ---- stubs and golden are what the .proto files say ------------------------------------------

@needs_protoc
def test_committed_stubs_are_regenerated_byte_for_byte(tmp_path):
    _generate(tmp_path)
    fresh, committed = _files(tmp_path / "cde" / "rpc" / "v1"), _files(STUBS)
    assert sorted(fresh) == sorted(committed), "run scripts/gen_protos.sh"
    stale = [name for name in fresh if fresh[name] != committed[name]]
    assert not stale, f"stale generated files {stale}: run scripts/gen_protos.sh"


def _current_set(tmp_path: Path) -> FileDescriptorSet:
    """The descriptor set of the .proto files as they are now."""
    out = tmp_path / "current.binpb"
    protos = sorted(str(p.relative_to(ROOT / "protos")) for p in (ROOT / "protos" / "cde" / "v1").glob("*.proto"))
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", "-I.", f"--descriptor_set_out={out}",
                    "--include_imports", *protos], cwd=ROOT / "protos", check=True, capture_output=True)
    return load(str(out))


@needs_protoc
def test_protos_are_compatible_with_golden(tmp_path):
    problems = check(load(str(GOLDEN)), _current_set(tmp_path))
    assert not problems, "incompatible contract change:\n" + "\n".join(problems)


@needs_protoc
def test_golden_is_up_to_date(tmp_path):
    current = _current_set(tmp_path)
    assert current.SerializeToString() == GOLDEN.read_bytes(), \
        "protos changed: run scripts/gen_protos.sh --update-golden (it checks compatibility first)"


def test_imported_stubs_are_compatible_with_golden():
    problems = check(load(str(GOLDEN)), loaded_descriptor_set())
    assert not problems, "\n".join(problems)


# ---- the checker fails on real breaks (a check that cannot fail is worthless) ----------------

def _golden() -> FileDescriptorSet:
    return load(str(GOLDEN))


def _message(fds: FileDescriptorSet, name: str):
    for f in fds.file:
        for m in f.message_type:
            if m.name == name:
                return m
    raise KeyError(name)


def _field(fds: FileDescriptorSet, message: str, field: str):
    return next(f for f in _message(fds, message).field if f.name == field)


def _enum(fds: FileDescriptorSet, name: str):
    return next(e for f in fds.file for e in f.enum_type if e.name == name)


def _service(fds: FileDescriptorSet, name: str):
    return next(s for f in fds.file for s in f.service if s.name == name)


def _method(fds: FileDescriptorSet, service: str, method: str):
    return next(m for m in _service(fds, service).method if m.name == method)


def _delete_field(fds, message, field, reserve=False):
    m = _message(fds, message)
    f = _field(fds, message, field)
    number = f.number
    m.field.remove(f)
    if reserve:
        m.reserved_range.add(start=number, end=number + 1)
        m.reserved_name.append(field)
    return m, number


def _drop_optional(fds):
    m = _message(fds, "DecodeOptions")
    f = _field(fds, "DecodeOptions", "seed")
    synthetic = f.oneof_index
    f.proto3_optional = False
    f.ClearField("oneof_index")
    del m.oneof_decl[synthetic]
    for other in m.field:
        if other.HasField("oneof_index") and other.oneof_index > synthetic:
            other.oneof_index -= 1


def _delete_enum_value(fds, enum, value, reserve=False):
    e = _enum(fds, enum)
    v = next(v for v in e.value if v.name == value)
    e.value.remove(v)
    if reserve:
        e.reserved_range.add(start=v.number, end=v.number)  # enum ranges are inclusive
        e.reserved_name.append(value)


def _remove_message(fds, name):
    for f in fds.file:
        for m in f.message_type:
            if m.name == name:
                f.message_type.remove(m)
                return


BREAKING = {
    "field renumbered": lambda d: setattr(_field(d, "GenerateRequest", "prompt"), "number", 30),
    "field deleted": lambda d: _delete_field(d, "RawConceptRecords", "known_idx"),
    "field retyped": lambda d: setattr(_field(d, "Usage", "steps"), "type", FieldDescriptorProto.TYPE_UINT64),
    "message type changed": lambda d: setattr(_field(d, "GenerateRequest", "steering"), "type_name",
                                              ".cde.v1.PreparedSteering"),
    "field renamed": lambda d: setattr(_field(d, "Finished", "reason"), "name", "finish_reason"),
    "repeated made singular": lambda d: setattr(_field(d, "StepEvent", "tokens"), "label",
                                                FieldDescriptorProto.LABEL_OPTIONAL),
    "optional dropped": _drop_optional,
    "moved out of oneof": lambda d: _field(d, "GenerateResponse", "block").ClearField("oneof_index"),
    "enum value deleted": lambda d: _delete_enum_value(d, "FinishReason", "FINISH_REASON_CANCELLED"),
    "enum value renamed": lambda d: setattr(_enum(d, "FinishReason").value[1], "name", "FINISH_REASON_EOS"),
    "message removed": lambda d: _remove_message(d, "ChunkAttribution"),
    "server streaming dropped": lambda d: setattr(_method(d, "Generation", "Generate"), "server_streaming", False),
    "client streaming dropped": lambda d: setattr(_method(d, "Attribution", "Attribute"), "client_streaming", False),
    "method input changed": lambda d: setattr(_method(d, "Worker", "Submit"), "input_type", ".cde.v1.SubmitRequest"),
    "method removed": lambda d: _service(d, "Scheduler").method.remove(_method(d, "Scheduler", "Resume")),
}

COMPATIBLE = {
    "unchanged": lambda d: None,
    "field deleted and reserved": lambda d: _delete_field(d, "RawConceptRecords", "known_idx", reserve=True),
    "enum value deleted and reserved": lambda d: _delete_enum_value(d, "FinishReason", "FINISH_REASON_CANCELLED",
                                                                    reserve=True),
    "field added": lambda d: _message(d, "Usage").field.add(name="prefill_tokens", number=7,
                                                            type=FieldDescriptorProto.TYPE_UINT32,
                                                            label=FieldDescriptorProto.LABEL_OPTIONAL),
    "message added": lambda d: d.file[0].message_type.add(name="Brand"),
    "method added": lambda d: _service(d, "Worker").method.add(
        name="Drain", input_type=".cde.v1.WorkerStatusRequest", output_type=".cde.v1.WorkerStatus"),
}


@pytest.mark.parametrize("change", sorted(BREAKING))
def test_checker_rejects_breaking_change(change):
    golden = _golden()
    broken = copy.deepcopy(golden)
    BREAKING[change](broken)
    assert broken != golden
    assert check(golden, broken), f"checker accepted: {change}"


def test_checker_rejects_reuse_of_reserved_numbers_and_names():
    # golden after a compatible removal: Usage.steps and FINISH_REASON_CANCELLED reserved
    golden = _golden()
    _delete_field(golden, "Usage", "steps", reserve=True)
    _delete_enum_value(golden, "FinishReason", "FINISH_REASON_CANCELLED", reserve=True)
    uint64 = dict(type=FieldDescriptorProto.TYPE_UINT64, label=FieldDescriptorProto.LABEL_OPTIONAL)
    cases = {
        "field number": lambda d: _message(d, "Usage").field.add(name="step_count", number=3, **uint64),
        "field name": lambda d: _message(d, "Usage").field.add(name="steps", number=9, **uint64),
        "enum number": lambda d: _enum(d, "FinishReason").value.add(name="FINISH_REASON_ABORTED", number=3),
        "enum name": lambda d: _enum(d, "FinishReason").value.add(name="FINISH_REASON_CANCELLED", number=9),
    }
    for case, mutate in cases.items():
        current = copy.deepcopy(golden)
        mutate(current)
        problems = check(golden, current)
        assert len(problems) == 1 and "reuses a reserved" in problems[0], (case, problems)


@pytest.mark.parametrize("change", sorted(COMPATIBLE))
def test_checker_accepts_compatible_change(change):
    golden = _golden()
    changed = copy.deepcopy(golden)
    COMPATIBLE[change](changed)
    assert check(golden, changed) == []


# ---- the stubs over a real server --------------------------------------------------------

CALLED: set[str] = set()


def _called(service: str, method: str) -> None:
    CALLED.add(f"{service}.{method}")


def _records(n: int = 2, k_known: int = 3, k_disc: int = 4) -> common_pb2.RawConceptRecords:
    return common_pb2.RawConceptRecords(
        positions=list(range(64, 64 + n)), tokens=[7] * n, target_logits=[1.5] * n,
        k_known=k_known, known_idx=list(range(n * k_known)), known_logits=[0.5] * (n * k_known),
        k_disc=k_disc, disc_idx=list(range(n * k_disc)), disc_logits=[-0.5] * (n * k_disc))


def _top() -> list[common_pb2.ConceptScore]:
    return [common_pb2.ConceptScore(concept_id=3, label="Known: ocean", head="known", score=0.75)]


def _usage() -> common_pb2.Usage:
    return common_pb2.Usage(prompt_tokens=3, completion_tokens=2, steps=2, forwards=2, tokens_per_forward=1.0)


class Generation(generate_pb2_grpc.GenerationServicer):
    async def Generate(self, request, context):
        _called("Generation", "Generate")
        yield generate_pb2.GenerateResponse(accepted=common_pb2.Accepted(
            request_id=request.request_id or "gen-1", prompt_tokens=len(request.token_ids.ids), seed=42))
        if request.stream_steps:
            yield generate_pb2.GenerateResponse(step=common_pb2.StepEvent(step=0, block_index=1, positions=[64],
                                                                          tokens=[9]))
        yield generate_pb2.GenerateResponse(block=generate_pb2.BlockEvent(
            block_index=1, start=64, tokens=[9, 10], text=request.prompt.upper(),
            token_attributions=[common_pb2.TokenAttribution(position=64, token=9, target_logit=2.0, residual=0.5,
                                                            top=_top())],
            chunk_attributions=[common_pb2.ChunkAttribution(start=64, end=66, residual_pct=12.5, top=_top())]))
        yield generate_pb2.GenerateResponse(finished=common_pb2.Finished(reason=common_pb2.FINISH_REASON_LENGTH,
                                                                         usage=_usage()))

    async def Resume(self, request, context):
        _called("Generation", "Resume")
        first = request.after_block + 1 if request.HasField("after_block") else 0
        for i in range(first, 3):
            yield generate_pb2.GenerateResponse(block=generate_pb2.BlockEvent(block_index=i))
        yield generate_pb2.GenerateResponse(finished=common_pb2.Finished(reason=common_pb2.FINISH_REASON_STOP))

    async def Cancel(self, request, context):
        _called("Generation", "Cancel")
        if request.request_id != "gen-1":
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown request {request.request_id!r}")
        return common_pb2.CancelResponse(cancelled=True)

    async def ListModels(self, request, context):
        _called("Generation", "ListModels")
        return generate_pb2.ListModelsResponse(models=[generate_pb2.ModelInfo(
            id="steerling-tiny", diffusion_block_size=64, max_context=1024, n_known_concepts=48,
            n_discovered_concepts=96)])

    async def SearchConcepts(self, request, context):
        _called("Generation", "SearchConcepts")
        return common_pb2.SearchConceptsResponse(concepts=[common_pb2.Concept(id=0, name=request.query, head="known")])

    async def AttributeInputs(self, request, context):
        _called("Generation", "AttributeInputs")
        for ev in _input_events(request.positions):
            yield ev


def _input_events(positions) -> list[common_pb2.InputAttributionEvent]:
    return [common_pb2.InputAttributionEvent(progress=common_pb2.InputAttributionProgress(done=0, total=len(positions)))] + [
        common_pb2.InputAttributionEvent(target=common_pb2.TargetAttribution(
            position=p, token=7, commit_order=i, inputs=[common_pb2.InputScore(position=0, token=1, score=0.25,
                                                                               normalized=1.0)]))
        for i, p in enumerate(positions)] + [common_pb2.InputAttributionEvent(summary=common_pb2.InputAttributionSummary(
            prompt=[common_pb2.InputScore(position=0, token=1, score=1.0)], targets=len(positions), n_steps=32))]


class Scheduler(scheduler_pb2_grpc.SchedulerServicer):
    def __init__(self) -> None:
        self.workers: dict[str, scheduler_pb2.WorkerInfo] = {}

    async def Submit(self, request, context):
        _called("Scheduler", "Submit")
        yield scheduler_pb2.SchedulerEvent(accepted=common_pb2.Accepted(
            request_id=request.request_id, prompt_tokens=len(request.prompt_tokens), seed=request.options.seed))
        yield scheduler_pb2.SchedulerEvent(block=common_pb2.BlockCommitted(
            block_index=1, start=64, tokens=[5, 6], records=_records()))
        yield scheduler_pb2.SchedulerEvent(finished=common_pb2.Finished(reason=common_pb2.FINISH_REASON_STOP,
                                                                        usage=_usage()))

    async def Resume(self, request, context):
        _called("Scheduler", "Resume")
        yield scheduler_pb2.SchedulerEvent(block=common_pb2.BlockCommitted(block_index=request.after_block + 1))
        yield scheduler_pb2.SchedulerEvent(finished=common_pb2.Finished(reason=common_pb2.FINISH_REASON_CANCELLED))

    async def Cancel(self, request, context):
        _called("Scheduler", "Cancel")
        return common_pb2.CancelResponse(cancelled=False)

    async def Detach(self, request, context):
        _called("Scheduler", "Detach")
        return common_pb2.CancelResponse(cancelled=request.attach_id == "a1")

    async def RegisterWorker(self, request, context):
        _called("Scheduler", "RegisterWorker")
        self.workers[request.worker_id] = request
        return scheduler_pb2.WorkerAck(heartbeat_interval_ms=1000)

    async def Heartbeat(self, request, context):
        _called("Scheduler", "Heartbeat")
        if request.worker_id not in self.workers:
            await context.abort(grpc.StatusCode.NOT_FOUND, "register first")
        self.workers[request.worker_id] = request
        return scheduler_pb2.WorkerAck(heartbeat_interval_ms=1000)

    async def Stats(self, request, context):
        _called("Scheduler", "Stats")
        return scheduler_pb2.StatsResponse(running=1, waiting=0, workers=list(self.workers.values()))

    async def Score(self, request, context):
        _called("Scheduler", "Score")
        return _scores(request)

    async def AttributeInputs(self, request, context):
        _called("Scheduler", "AttributeInputs")
        for ev in _input_events(request.positions):
            yield ev


def _scores(request: common_pb2.ScoreRequest) -> common_pb2.ScoreResponse:
    out = common_pb2.ScoreResponse(total=-0.5 * (len(request.tokens) - request.score_from))
    for t in request.tokens[request.score_from:]:
        out.scores.add(logprob=-0.5, greedy=True, top_ids=[t], top_logprobs=[-0.5])
    return out


class Worker(worker_pb2_grpc.WorkerServicer):
    async def Score(self, request, context):
        _called("Worker", "Score")
        return _scores(request)

    async def Submit(self, request, context):
        _called("Worker", "Submit")
        pos = len(request.prompt_tokens) + len(request.committed_tokens)
        yield worker_pb2.WorkerEvent(step=common_pb2.StepEvent(step=request.next_step, positions=[pos], tokens=[1]))
        mask = bytes_to_floats(request.steering.relu_mask_f32)
        yield worker_pb2.WorkerEvent(block=common_pb2.BlockCommitted(
            block_index=pos // 64, start=pos, tokens=[1], records=_records(1)))
        yield worker_pb2.WorkerEvent(finished=common_pb2.Finished(
            reason=common_pb2.FINISH_REASON_LENGTH, message=f"mask {len(mask)}"))

    async def Cancel(self, request, context):
        _called("Worker", "Cancel")
        return common_pb2.CancelResponse(cancelled=True)

    async def Info(self, request, context):
        _called("Worker", "Info")
        return worker_pb2.WorkerStatus(model="steerling-tiny", preset="tiny", dtype="float32", device="cpu",
                                       kv_pages_total=128, kv_pages_free=120, steps=2**40, compiles=3,
                                       diffusion_block_size=64, vocab_size=320, n_known=48, n_discovered=96,
                                       max_context=1024)


class Steering(steering_pb2_grpc.SteeringServicer):
    D, V = 4096, 100_352  # Steerling-8B sizes: a realistic PreparedSteering

    async def SearchConcepts(self, request, context):
        _called("Steering", "SearchConcepts")
        hits = [common_pb2.Concept(id=i, name=f"{request.query} {i}", head="known", group_id=1, steerable=True)
                for i in range(request.limit or 20)]
        return common_pb2.SearchConceptsResponse(concepts=hits)

    async def GetConcept(self, request, context):
        _called("Steering", "GetConcept")
        if request.WhichOneof("ref") == "name" and request.name == "ocean":
            return common_pb2.Concept(id=0, name="ocean", head="known", group_id=0, group_name="water")
        await context.abort(grpc.StatusCode.NOT_FOUND, "unknown concept")

    async def ListConcepts(self, request, context):
        _called("Steering", "ListConcepts")
        start = request.after + 1 if request.HasField("after") else 0
        ids = range(start, min(start + (request.limit or 50), 100))
        return steering_pb2.ListConceptsResponse(
            concepts=[common_pb2.Concept(id=i, name=f"c{i}", head=request.head or "known") for i in ids],
            has_more=start + len(ids) < 100)

    async def DescribeConcept(self, request, context):
        _called("Steering", "DescribeConcept")
        top = [steering_pb2.ConceptTopToken(token_id=t, score=1.0 / (t + 1)) for t in range(request.top_tokens)]
        return steering_pb2.ConceptDetail(concept=common_pb2.Concept(id=request.concept_id, name="ocean"),
                                          top_tokens=top)

    async def BuildSteering(self, request, context):
        _called("Steering", "BuildSteering")
        direction = torch.zeros(self.D, dtype=torch.bfloat16)
        direction[0] = 1.0
        suppress = request.steering.mode == common_pb2.STEERING_MODE_SUPPRESS
        mask = floats_to_bytes(torch.linspace(0, 1, self.V)) if suppress else b""
        return common_pb2.PreparedSteering(
            direction_f32=floats_to_bytes(direction), base_alpha=-7.0 if suppress else 2.5, inject_layer=16,
            schedule=common_pb2.STEERING_SCHEDULE_FIXED if suppress else common_pb2.STEERING_SCHEDULE_HARD_CUTOFF,
            cutoff_tokens=32, relu_mask_f32=mask, concept_ids=[c.concept_id for c in request.steering.concepts],
            model=request.model)


class Attribution(attribution_pb2_grpc.AttributionServicer):
    async def AttributeInputs(self, request, context):
        _called("Attribution", "AttributeInputs")
        if not request.options.HasField("block_diffusion"):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "options.block_diffusion is required")
        for ev in _input_events(request.positions):
            yield ev

    async def Attribute(self, request_iterator, context):
        _called("Attribution", "Attribute")
        async for req in request_iterator:
            n = len(req.records.tokens)
            yield attribution_pb2.AttributeResponse(
                request_id=req.request_id, block_index=req.block_index,
                token_attributions=[common_pb2.TokenAttribution(position=p, token=t, top=_top()[:req.top_k])
                                    for p, t in zip(req.records.positions, req.records.tokens)],
                chunk_attributions=[common_pb2.ChunkAttribution(start=req.start, end=req.start + n)] if req.last
                else [])


SERVICES = [(generate_pb2, "Generation", generate_pb2_grpc.add_GenerationServicer_to_server, Generation),
            (scheduler_pb2, "Scheduler", scheduler_pb2_grpc.add_SchedulerServicer_to_server, Scheduler),
            (worker_pb2, "Worker", worker_pb2_grpc.add_WorkerServicer_to_server, Worker),
            (steering_pb2, "Steering", steering_pb2_grpc.add_SteeringServicer_to_server, Steering),
            (attribution_pb2, "Attribution", attribution_pb2_grpc.add_AttributionServicer_to_server, Attribution)]
SERVICE_NAMES = [service_name(mod, name) for mod, name, _, _ in SERVICES]


@asynccontextmanager
async def serving(max_message_bytes: int = MAX_MESSAGE_BYTES):
    server, health = await make_server(SERVICE_NAMES, max_message_bytes=max_message_bytes)
    for _, _, add, servicer in SERVICES:
        add(servicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    assert port
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=channel_options()) as channel:
            yield port, channel, health
    finally:
        await server.stop(None)


def test_every_rpc_through_the_generated_stubs():
    CALLED.clear()

    async def main():
        async with serving() as (_, ch, _health):
            gen = generate_pb2_grpc.GenerationStub(ch)
            events = [e async for e in gen.Generate(generate_pb2.GenerateRequest(
                request_id="gen-1", prompt="hello", stream_steps=True,
                decode=common_pb2.DecodeOptions(max_new_tokens=64, seed=0),
                sampling=common_pb2.SamplingOptions(use_entropy_sampling=False, temperature=0.0),
                steering=common_pb2.SteeringRequest(concepts=[common_pb2.SteeringConcept(name="ocean", strength=1)]),
                attribution=common_pb2.ATTRIBUTION_ALL), timeout=10)]
            assert [e.WhichOneof("event") for e in events] == ["accepted", "step", "block", "finished"]
            assert events[0].accepted.request_id == "gen-1" and events[0].accepted.seed == 42
            block = events[2].block
            assert block.text == "HELLO" and block.token_attributions[0].top[0].label == "Known: ocean"
            assert block.chunk_attributions[0].residual_pct == 12.5
            assert events[3].finished.reason == common_pb2.FINISH_REASON_LENGTH
            assert events[3].finished.usage.completion_tokens == 2

            resumed = [e async for e in gen.Resume(common_pb2.ResumeRequest(request_id="gen-1", after_block=0))]
            assert [e.block.block_index for e in resumed[:-1]] == [1, 2]
            replay = [e async for e in gen.Resume(common_pb2.ResumeRequest(request_id="gen-1"))]
            assert [e.block.block_index for e in replay[:-1]] == [0, 1, 2]
            assert (await gen.Cancel(common_pb2.CancelRequest(request_id="gen-1"))).cancelled
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await gen.Cancel(common_pb2.CancelRequest(request_id="nope"))
            assert err.value.code() == grpc.StatusCode.NOT_FOUND
            models = await gen.ListModels(generate_pb2.ListModelsRequest())
            assert models.models[0].diffusion_block_size == 64
            found = await gen.SearchConcepts(common_pb2.SearchConceptsRequest(query="sea"))
            assert found.concepts[0].name == "sea"
            ask = common_pb2.InputAttributionRequest(request_id="gen-1", positions=[70, 71], n_steps=32)
            got = [e.WhichOneof("event") async for e in gen.AttributeInputs(ask)]
            assert got == ["progress", "target", "target", "summary"]
            got = [e async for e in scheduler_pb2_grpc.SchedulerStub(ch).AttributeInputs(ask)]
            assert [e.target.position for e in got[1:3]] == [70, 71] and got[-1].summary.targets == 2
            job = attribution_pb2.InputAttributionJob(request_id="gen-1", prompt_tokens=[1, 2],
                                                      options=resolved.block_diffusion(seed=3, max_new_tokens=8),
                                                      generated=[5] * 8, positions=[2])
            got = [e async for e in attribution_pb2_grpc.AttributionStub(ch).AttributeInputs(job)]
            assert got[1].target.inputs[0].normalized == 1.0

            sched = scheduler_pb2_grpc.SchedulerStub(ch)
            events = [e async for e in sched.Submit(scheduler_pb2.SubmitRequest(
                request_id="r1", prompt_tokens=[1, 2, 3], options=resolved.block_diffusion(seed=7, max_new_tokens=8),
                steering=common_pb2.PreparedSteering(direction_f32=floats_to_bytes([1.0, 0.0])),
                attribution=common_pb2.ATTRIBUTION_TOKENS))]
            assert [e.WhichOneof("event") for e in events] == ["accepted", "block", "finished"]
            records = events[1].block.records
            assert len(records.known_idx) == len(records.positions) * records.k_known
            assert events[0].accepted.seed == 7
            resumed = [e async for e in sched.Resume(common_pb2.ResumeRequest(request_id="r1", after_block=4))]
            assert resumed[0].block.block_index == 5
            assert not (await sched.Cancel(common_pb2.CancelRequest(request_id="r1"))).cancelled
            assert (await sched.Detach(scheduler_pb2.DetachRequest(request_id="r1", attach_id="a1"))).cancelled
            info = scheduler_pb2.WorkerInfo(worker_id="w0", address="127.0.0.1:1", model="tiny", kv_pages_total=8,
                                            kv_pages_free=8)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await sched.Heartbeat(info)
            assert err.value.code() == grpc.StatusCode.NOT_FOUND
            assert (await sched.RegisterWorker(info)).heartbeat_interval_ms == 1000
            info.kv_pages_free = 5
            await sched.Heartbeat(info)
            stats = await sched.Stats(scheduler_pb2.StatsRequest())
            assert stats.workers[0].kv_pages_free == 5
            score_req = common_pb2.ScoreRequest(model="tiny", tokens=[5, 6, 7, 8], score_from=1, top_logprobs=1,
                                                seed=2**64 - 1, mc_samples=3)
            scored = await sched.Score(score_req)
            assert [s.top_ids[0] for s in scored.scores] == [6, 7, 8] and scored.total == -1.5

            steer = steering_pb2_grpc.SteeringStub(ch)
            hits = await steer.SearchConcepts(common_pb2.SearchConceptsRequest(query="ocean", limit=3, known_only=True))
            assert len(hits.concepts) == 3 and hits.concepts[0].HasField("group_id")
            assert (await steer.GetConcept(steering_pb2.GetConceptRequest(name="ocean"))).group_name == "water"
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await steer.GetConcept(steering_pb2.GetConceptRequest(concept_id=999))
            assert err.value.code() == grpc.StatusCode.NOT_FOUND
            page = await steer.ListConcepts(steering_pb2.ListConceptsRequest(limit=30, after=79, head="discovered",
                                                                              group_id=2, steerable=False))
            assert [c.id for c in page.concepts] == list(range(80, 100)) and not page.has_more
            assert page.concepts[0].head == "discovered"
            detail = await steer.DescribeConcept(steering_pb2.DescribeConceptRequest(concept_id=5, top_tokens=3))
            assert detail.concept.id == 5 and [t.token_id for t in detail.top_tokens] == [0, 1, 2]
            assert detail.top_tokens[1].score == pytest.approx(0.5)
            prepared = await steer.BuildSteering(steering_pb2.BuildSteeringRequest(
                model="steerling-8b", steering=common_pb2.SteeringRequest(
                    concepts=[common_pb2.SteeringConcept(concept_id=3)], mode=common_pb2.STEERING_MODE_SUPPRESS)))
            direction = bytes_to_floats(prepared.direction_f32, expected_len=Steering.D)
            mask = bytes_to_floats(prepared.relu_mask_f32, expected_len=Steering.V)
            assert direction[0] == 1.0 and direction[1:].sum() == 0.0 and mask[-1] == 1.0
            assert len(prepared.relu_mask_f32) == 392 * 1024 and list(prepared.concept_ids) == [3]

            worker = worker_pb2_grpc.WorkerStub(ch)
            events = [e async for e in worker.Submit(worker_pb2.WorkerSubmit(
                request_id="r1", prompt_tokens=list(range(60)), committed_tokens=list(range(68)), next_step=68,
                steering=prepared))]
            assert [e.WhichOneof("event") for e in events] == ["step", "block", "finished"]
            assert events[0].step.step == 68 and events[1].block.start == 128
            assert events[2].finished.message == f"mask {Steering.V}"
            assert (await worker.Cancel(common_pb2.CancelRequest(request_id="r1"))).cancelled
            status = await worker.Info(worker_pb2.WorkerStatusRequest())
            assert status.steps == 2**40 and status.n_known == 48
            assert len((await worker.Score(score_req)).scores) == 3

            async def blocks():
                for i in range(3):
                    yield attribution_pb2.AttributeRequest(request_id="r1", block_index=i, records=_records(2),
                                                           mode=common_pb2.ATTRIBUTION_ALL, top_k=1, start=64 * i,
                                                           context_tokens=[7, 7], last=i == 2)
            out = [r async for r in attribution_pb2_grpc.AttributionStub(ch).Attribute(blocks())]
            assert [r.block_index for r in out] == [0, 1, 2]
            assert all(len(r.token_attributions) == 2 for r in out)
            assert [len(r.chunk_attributions) for r in out] == [0, 0, 1]

    asyncio.run(main())
    every = {f"{s.name}.{m.name}" for mod, name, _, _ in SERVICES
             for s in [mod.DESCRIPTOR.services_by_name[name]] for m in s.methods}
    assert CALLED == every, f"RPCs not exercised: {sorted(every - CALLED)}"


def test_health_starts_not_serving_and_reflection_lists_services():
    async def main():
        async with serving() as (_, ch, health):
            check_ = health_pb2_grpc.HealthStub(ch).Check
            for name in ["", *SERVICE_NAMES]:
                got = await check_(health_pb2.HealthCheckRequest(service=name))
                assert got.status == health_pb2.HealthCheckResponse.NOT_SERVING, name
            await health.set_serving(True)
            for name in ["", *SERVICE_NAMES]:
                got = await check_(health_pb2.HealthCheckRequest(service=name))
                assert got.status == health_pb2.HealthCheckResponse.SERVING, name
            await health.set_serving(False)
            got = await check_(health_pb2.HealthCheckRequest(service="cde.v1.Worker"))
            assert got.status == health_pb2.HealthCheckResponse.NOT_SERVING

            stub = reflection_pb2_grpc.ServerReflectionStub(ch)

            async def ask():
                yield reflection_pb2.ServerReflectionRequest(list_services="")
                yield reflection_pb2.ServerReflectionRequest(file_containing_symbol="cde.v1.Worker")
            answers = [a async for a in stub.ServerReflectionInfo(ask())]
            listed = {s.name for s in answers[0].list_services_response.service}
            assert set(SERVICE_NAMES) | {"grpc.health.v1.Health"} <= listed
            files = answers[1].file_descriptor_response.file_descriptor_proto
            assert files and b"cde/v1/worker.proto" in files[0]

    asyncio.run(main())


def test_oversized_messages_are_resource_exhausted():
    big = common_pb2.PreparedSteering(relu_mask_f32=b"\0" * (MAX_MESSAGE_BYTES + 1024))

    async def main():
        async with serving() as (port, ch, _health):
            # the client refuses to send it ...
            with pytest.raises(grpc.aio.AioRpcError) as err:
                _ = [e async for e in worker_pb2_grpc.WorkerStub(ch).Submit(worker_pb2.WorkerSubmit(steering=big))]
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            # ... and a client with a looser limit is refused by the server
            loose = [("grpc.max_send_message_length", 4 * MAX_MESSAGE_BYTES)]
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=loose) as ch2:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    _ = [e async for e in worker_pb2_grpc.WorkerStub(ch2).Submit(worker_pb2.WorkerSubmit(steering=big))]
                assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            # just under the limit goes through
            fits = common_pb2.PreparedSteering(relu_mask_f32=b"\0" * (MAX_MESSAGE_BYTES - 4096))
            events = [e async for e in worker_pb2_grpc.WorkerStub(ch).Submit(worker_pb2.WorkerSubmit(steering=fits))]
            assert events[-1].WhichOneof("event") == "finished"

    asyncio.run(main())


# ---- float payloads ---------------------------------------------------------------------

def test_float_payloads_are_little_endian_float32():
    t = torch.tensor([1.0, -2.5, 3.25], dtype=torch.bfloat16)
    data = floats_to_bytes(t)
    assert data == np.array([1.0, -2.5, 3.25], dtype="<f4").tobytes()
    assert floats_to_bytes([1.0, -2.5, 3.25]) == data == floats_to_bytes(np.array([1, -2.5, 3.25], dtype=">f8"))
    back = bytes_to_floats(data, expected_len=3)
    assert back.dtype == np.float32 and back.flags.writeable and back.tolist() == [1.0, -2.5, 3.25]
    assert torch.equal(torch.from_numpy(back), t.float())
    assert floats_to_bytes(torch.zeros(0)) == b"" and bytes_to_floats(b"").shape == (0,)
    with pytest.raises(ValueError):
        bytes_to_floats(data[:-1])
    with pytest.raises(ValueError):
        bytes_to_floats(data, expected_len=4)
    with pytest.raises(ValueError):
        floats_to_bytes(torch.zeros(2, 2))


# ---- malformed request bytes ------------------------------------------------------------

def test_malformed_request_bytes_are_invalid_argument_on_every_service():
    """Every cde.v1 method with a unary request answers INVALID_ARGUMENT (not grpcio's UNKNOWN)
    to bytes that are not its request message: make_server installs the interceptor on the
    public and the internal servers alike."""
    bad = [b"\x0a\x05ab", b"\xff\xff\xff\xff\xff", b"\x08\x80\x80\x80\x80\x80\x80\x80\x80\x80\x80"]
    methods = [(f"/{svc.full_name}/{m.name}", m.server_streaming)
               for mod, name, _, _ in SERVICES for svc in [mod.DESCRIPTOR.services_by_name[name]]
               for m in svc.methods if not m.client_streaming]
    assert len(methods) >= 8

    async def main():
        async with serving() as (_port, ch, _health):
            for path, streaming in methods:
                for payload in bad:
                    call = (ch.unary_stream if streaming else ch.unary_unary)(path)
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        if streaming:
                            _ = [e async for e in call(payload, timeout=10)]
                        else:
                            await call(payload, timeout=10)
                    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (path, payload, err.value.code())

    asyncio.run(main())
