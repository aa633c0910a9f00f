"""A tensor-parallel rank for tests/test_tp.py: gloo on loopback, the full model built from the
seed in float64 and sharded (cde/tp.py), then what test_tp compares saved per rank: for Qwen3
logits, greedy AR / ISD from the reference decoders and ISD from the paged engine; for Steerling
a steered reference generation (tokens and concept records) and the paged engine's blocks."""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from cde.isd.decoder import generate_ar_batch, generate_isd_batch
from cde.qwen3.config import preset
from cde.qwen3.model import Qwen3Model
from cde.steerling.config import TINY
from cde.steerling.model import SteerlingModel
from cde.steerling.reference_decoder import generate
from cde.steerling.sampling import SamplingParams
from cde.steerling.steering import SteeringSpec, prepare
from cde.options import DecodeOptions, IsdOptions
from cde.tp import shard_qwen3, shard_steerling
from worker_svc.engine.events import BlockEvent, FinishEvent
from worker_svc.engine.isd_engine import IsdEngine
from worker_svc.engine.job import Job
from worker_svc.engine.steerling_engine import SteerlingEngine


def model_for(family: str, world: int, seed: int):
    if family == "qwen3":
        cfg = preset("tiny")
        if world > 2:   # n_heads, n_kv_heads divisible by the ranks
            cfg = cfg.replace(n_heads=8, n_kv_heads=4, head_dim=8)
        return Qwen3Model(cfg).init_random(seed).double().eval()
    cfg = TINY if world <= 2 else TINY.replace(n_kv_heads=4)
    return SteerlingModel(cfg).init_random(seed, std=0.05).double().eval()


def _prompts(seed: int, vocab: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (3, 40), generator=g), [torch.randint(0, vocab, (n,), generator=g).tolist()
                                                           for n in (3, 17, 70)]


def results(family: str, model, seed: int) -> dict:
    if family == "qwen3":
        tokens, prompts = _prompts(seed, 500)
        with torch.no_grad():
            logits = model(tokens)
        engine = IsdEngine(model, n_pages=64, max_stride=4)
        handles = [engine.submit(Job(f"i{i}", p, IsdOptions(max_new_tokens=12, stride=1 + i, temperature=0.0, top_k=0,
                                                          top_p=1.0, seed=i, proposal="sample", lora_gated=True,
                                                          stop_ids=()))) for i, p in enumerate(prompts)]
        engine.run_until_idle()
        served = [[e for e in engine.drain(h) if isinstance(e, FinishEvent)][0].output_tokens for h in handles]
        return {"logits": logits, "ar": [g.tokens for g in generate_ar_batch(model, prompts, 12)],
                "isd": [g.tokens for g in generate_isd_batch(model, prompts, 12, 3)], "engine": served}
    _, prompts = _prompts(seed, 256)
    spec = SteeringSpec.amplify([3], 10.0, 2, 24)
    steering = prepare(spec, model.known_head.embeddings(torch.tensor(spec.concept_ids)),
                       model.transformer.lm_head.weight, model.cfg.n_layers)
    opts = [DecodeOptions(40, SamplingParams(), 1 + i % 2, None, seed + i, ()) for i in range(len(prompts))]
    ref = generate(model, prompts[1], opts[1], steering, tokenizer_vocab_size=264)
    engine = SteerlingEngine(model, tokenizer_vocab_size=264, n_pages=64)
    handles = [engine.submit(Job(f"s{i}", p, o, steering=steering if i == 1 else None))
               for i, (p, o) in enumerate(zip(prompts, opts))]
    engine.run_until_idle()
    blocks = []
    for h in handles:
        for e in engine.drain(h):
            if isinstance(e, BlockEvent):
                blocks.append((e.tokens, e.records.positions.tolist(), e.records.known_logits, e.records.target_logits))
    return {"ref_tokens": ref.output_tokens, "ref_known": ref.records.known_logits,
            "ref_known_idx": ref.records.known_idx, "engine": blocks}


def run(rank: int, world: int, port: int, family: str, seed: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        model = model_for(family, world, seed)
        if family == "qwen3":
            shard_qwen3(model).fuse_projections()   # the serving path: fused local q/k/v and gate/up
        else:
            shard_steerling(model)
        torch.save(results(family, model, seed), f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()
