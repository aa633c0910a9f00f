"""The internal request contract: ResolvedOptions (protos/cde/v1/resolved.proto) is what goes
inside, and the scheduler's stored spec carries it (v2), reading the v1 layout of before.
"""
from __future__ import annotations

import json

import pytest
from google.protobuf import descriptor_pb2
from google.protobuf.descriptor import FieldDescriptor

from cde import limits as L
from cde.rpc import resolved
from cde.rpc.v1 import resolved_pb2, scheduler_pb2, worker_pb2
from scheduler_svc.spec import SPEC_VERSION, check_submit, decode_spec, encode_spec, pages_needed

pytestmark = pytest.mark.contract

PUBLIC_OPTIONS = {"cde.v1.DecodeOptions", "cde.v1.SamplingOptions"}


@pytest.mark.parametrize("message", [scheduler_pb2.SubmitRequest, worker_pb2.WorkerSubmit])
def test_internal_requests_carry_resolved_options_not_the_public_ones(message):
    fields = message.DESCRIPTOR.fields_by_name
    carried = {f.message_type.full_name for f in message.DESCRIPTOR.fields if f.message_type is not None}
    assert not carried & PUBLIC_OPTIONS, carried
    assert fields["options"].message_type.full_name == "cde.v1.ResolvedOptions"


def test_resolved_options_have_no_unset_means_default_fields():
    """Only the confidence threshold is `optional` (absent = no threshold: a value, not a default)."""
    optional = []
    for msg in (resolved_pb2.ResolvedOptions, resolved_pb2.ResolvedSampling, resolved_pb2.BlockDiffusion,
                resolved_pb2.Isd):
        proto = descriptor_pb2.DescriptorProto()
        msg.DESCRIPTOR.CopyToProto(proto)
        optional += [f"{proto.name}.{f.name}" for f in proto.field if f.proto3_optional]
    assert optional == ["BlockDiffusion.confidence_threshold"]
    assert resolved_pb2.ResolvedOptions.DESCRIPTOR.fields_by_name["seed"].type == FieldDescriptor.TYPE_UINT64


def _submit(options: resolved_pb2.ResolvedOptions) -> scheduler_pb2.SubmitRequest:
    return scheduler_pb2.SubmitRequest(request_id="r1", model="m", prompt_tokens=list(range(1, 71)), options=options,
                                       attribution_top_k=8)


def test_spec_round_trip_keeps_every_resolved_value():
    req = _submit(resolved.block_diffusion(seed=L.SEED_MAX, max_new_tokens=60, tokens_per_step=4,
                                           confidence_threshold=0.5, stop_ids=[9, 9, 3]))
    back, deadline = decode_spec(encode_spec(req, 123.5))
    assert back == req and deadline == 123.5
    assert json.loads(encode_spec(req, None))["v"] == SPEC_VERSION == 2
    assert list(back.options.stop_ids) == [9, 3] and back.options.seed == 2**64 - 1
    assert pages_needed(back) == 3   # 70 + 60 tokens


def _v1_spec(decode: dict, sampling: dict) -> str:
    submit = {"request_id": "old", "model": "m", "prompt_tokens": [1, 2, 3], "decode": decode, "sampling": sampling,
              "attribution_top_k": 8}
    return json.dumps({"v": 1, "deadline": None, "submit": submit})


def test_spec_v1_of_a_block_diffusion_request_is_read_as_resolved_options():
    spec = _v1_spec({"max_new_tokens": 70, "tokens_per_step": 2, "confidence_threshold": 0.75, "seed": "77",
                     "stop_ids": [5]},
                    {"use_entropy_sampling": True, "temperature": 1.2, "top_p": 0.8, "repetition_penalty": 1.1})
    req, deadline = decode_spec(spec)
    want = resolved.block_diffusion(seed=77, max_new_tokens=70, tokens_per_step=2, confidence_threshold=0.75,
                                    stop_ids=[5], sampling_options=resolved.sampling(L.STEERLING_SAMPLING))
    assert req.options == want and deadline is None
    assert req.request_id == "old" and list(req.prompt_tokens) == [1, 2, 3] and req.attribution_top_k == 8
    assert check_submit(req) is None


def test_spec_v1_of_a_causal_request_is_read_as_isd():
    spec = _v1_spec({"max_new_tokens": 8, "tokens_per_step": 1, "seed": "5", "isd_stride": 4},
                    {"use_entropy_sampling": False, "temperature": 0.5, "top_p": 1.0, "repetition_penalty": 1.0})
    options = decode_spec(spec)[0].options
    assert options.WhichOneof("decoder") == "isd" and options.isd.stride == 4
    assert options.isd.adapter == resolved_pb2.ISD_ADAPTER_GATED and options.seed == 5
    assert options.sampling.temperature == 0.5 and options.sampling.top_k == 0


def test_spec_of_an_unknown_version_is_refused():
    with pytest.raises(ValueError, match="spec version 3"):
        decode_spec(json.dumps({"v": 3, "submit": {}}))


def test_scheduler_refuses_unresolved_requests_naming_the_field():
    ok = _submit(resolved.isd(seed=0, max_new_tokens=4))
    assert check_submit(ok) is None
    no_options = _submit(ok.options)
    no_options.ClearField("options")
    no_decoder = _submit(ok.options)
    no_decoder.options.ClearField("isd")
    no_length = _submit(ok.options)
    no_length.options.max_new_tokens = 0
    no_prompt = _submit(ok.options)
    del no_prompt.prompt_tokens[:]
    for req, field in ((no_options, "options"), (no_decoder, "options.decoder"),
                       (no_length, "options.max_new_tokens"), (no_prompt, "prompt_tokens")):
        problem = check_submit(req)
        assert problem is not None and problem.startswith(field), (field, problem)
