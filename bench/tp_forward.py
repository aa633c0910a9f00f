"""Tensor-parallel forward time against its floor, one process per GPU (torchrun).

    NCCL_NVLS_ENABLE=0 torchrun --nproc_per_node 2 -m bench.tp_forward --out bench/results/tp-32b.json   # 2 GPUs
    torchrun --nproc_per_node 2 -m bench.tp_forward --dims tiny --backend gloo --batches 1,2       # CPU smoke

Each rank holds its shard of a Qwen3 model at the given dims (random bf16 weights, built as the
shard directly: a 32B model never exists whole on one GPU), in the layout cde/tp.py gives a
full model: q/k/v and gate/up column-parallel, o_proj and down_proj row-parallel with one
all-reduce each. Timed: a forward of B rows x 64 query tokens (dense causal attention), with
the all-reduces (the served path) and without them (each GPU's own GEMMs and attention: the
floor of a 2-GPU step), medians of CUDA-event timings after warm-up. The ratio is what the
two all-reduces per layer cost.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist

from cde.qwen3.config import Qwen3Config, preset
from cde.qwen3.model import Qwen3Model
from cde.tp import RowParallel

DIMS = {
    # Qwen3-32B's shapes
    "32b": Qwen3Config(n_layers=64, hidden=5120, n_heads=64, n_kv_heads=8, head_dim=128, intermediate=25600,
                       vocab_size=151936, max_positions=4096, mask_token_id=151669, bos_token_id=None,
                       eos_token_ids=(151645,)),
    "tiny": preset("tiny"),
}


def shard_model(cfg: Qwen3Config, world: int, device, dtype, reduce: bool) -> Qwen3Model:
    local = cfg.replace(n_heads=cfg.n_heads // world, n_kv_heads=cfg.n_kv_heads // world,
                        intermediate=cfg.intermediate // world)
    with torch.device("meta"):
        model = Qwen3Model(local)
    model = model.to_empty(device=device).to(dtype)
    model.rebuild_rope(device)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    if reduce:
        for layer in model.model.layers:
            a, m = layer.self_attn, layer.mlp
            a.o_proj = RowParallel(a.o_proj.weight, None, None)
            m.down_proj = RowParallel(m.down_proj.weight, None, None)
    model.fuse_projections()
    return model.eval()


def time_forward(model: Qwen3Model, batch: int, vocab: int, device, repeats: int) -> float:
    tokens = torch.randint(0, vocab, (batch, 64), device=device)
    cuda = device.type == "cuda"
    times = []
    with torch.inference_mode():
        for i in range(repeats + 3):
            if cuda:
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
            t0 = time.perf_counter()
            model(tokens)
            if cuda:
                e.record()
                torch.cuda.synchronize()
                ms = s.elapsed_time(e)
            else:
                ms = (time.perf_counter() - t0) * 1e3
            if i >= 3:
                times.append(ms)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dims", default="32b", choices=sorted(DIMS))
    ap.add_argument("--backend", default="nccl")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--out")
    args = ap.parse_args()
    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    cuda = args.backend == "nccl"
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', rank))}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    dtype = torch.bfloat16 if cuda else torch.float32
    cfg = DIMS[args.dims]
    rows = []
    for reduce in (False, True):
        model = shard_model(cfg, world, device, dtype, reduce)
        for b in [int(x) for x in args.batches.split(",")]:
            dist.barrier()
            ms = time_forward(model, b, cfg.vocab_size, device, args.repeats)
            rows.append({"batch": b, "query_tokens": 64, "all_reduce": reduce, "ms_per_forward": round(ms, 3)})
        del model
        if cuda:
            torch.cuda.empty_cache()
    if rank == 0:
        floor = {r["batch"]: r["ms_per_forward"] for r in rows if not r["all_reduce"]}
        for r in rows:
            if r["all_reduce"]:
                r["ratio_to_floor"] = round(r["ms_per_forward"] / floor[r["batch"]], 3)
        result = {"gpu": torch.cuda.get_device_name() if cuda else "cpu", "world": world, "dims": args.dims,
                  "dtype": str(dtype), "backend": args.backend, "commit": os.environ.get("CDE_COMMIT", ""),
                  "nccl_nvls_enable": os.environ.get("NCCL_NVLS_ENABLE"), "runs": rows}
        print(json.dumps(result, indent=1))
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=2)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
