"""The public gRPC API (cde.v1.Generation, mirrors REST): stream a steered generation with chunk
attributions, then reattach with Resume(request_id, after_block) and get the blocks after the
first one again, as a client does after a dropped connection.

    .venv/bin/python examples/grpc_resume.py [--target HOST:PORT]
        # default $CDE_GRPC_TARGET or 127.0.0.1:50050 (the launcher's default, compose publishes the same)
"""

import argparse
import asyncio
import os
import sys
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the generated stubs live in the repo's cde/
from cde.rpc.v1 import common_pb2, generate_pb2, generate_pb2_grpc  # noqa: E402


async def main(target: str) -> None:
    async with grpc.aio.insecure_channel(target) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        request = generate_pb2.GenerateRequest(
            model="steerling-small", prompt="Once upon a time",
            decode=common_pb2.DecodeOptions(max_new_tokens=192, seed=1),
            steering=common_pb2.SteeringRequest(concepts=[common_pb2.SteeringConcept(name="sea")]),
            attribution=common_pb2.ATTRIBUTION_CHUNKS)
        request_id, blocks = "", {}
        async for event in stub.Generate(request, timeout=300):
            kind = event.WhichOneof("event")
            if kind == "accepted":
                request_id = event.accepted.request_id
                print(f"accepted {request_id} (seed {event.accepted.seed})")
            elif kind == "block":
                block = event.block
                blocks[block.block_index] = block.text
                top = ", ".join(f"{c.label} {c.score:+.3f}" for ch in block.chunk_attributions for c in ch.top[:3])
                print(f"block {block.block_index}: {len(block.tokens)} tokens; concepts: {top}")
            elif kind == "finished":
                print(f"finished: {common_pb2.FinishReason.Name(event.finished.reason)}")

        first = min(blocks)
        replayed = {}
        async for event in stub.Resume(common_pb2.ResumeRequest(request_id=request_id, after_block=first),
                                       timeout=60):
            if event.HasField("block"):
                replayed[event.block.block_index] = event.block.text
        same = replayed == {i: t for i, t in blocks.items() if i > first}
        print(f"resume after block {first}: {len(replayed)} blocks replayed, same as the first stream: {same}")
        if not same:
            sys.exit(1)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=os.environ.get("CDE_GRPC_TARGET", "127.0.0.1:50050"))
    asyncio.run(main(ap.parse_args().target))
