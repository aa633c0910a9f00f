"""CLI: python -m worker_svc --model-dir DIR [--host H] [--port P] [--scheduler HOST:PORT]
[--worker-id ID] [--device cpu|cuda] [--dtype float32|bfloat16] [--compile] [--cuda-graphs]
[--kv-pages N] [--random-weights SEED].

Environment fallbacks: CDE_MODEL_DIR, CDE_WORKER_HOST, CDE_WORKER_PORT, CDE_SCHEDULER,
CDE_WORKER_ID, CDE_WORKER_ADVERTISE, CDE_MODEL_NAME, CDE_DEVICE, CDE_DTYPE, CDE_COMPILE=1,
CDE_CUDA_GRAPHS=1, CDE_KV_PAGES, CDE_DRAIN_TIMEOUT, CDE_LOG_LEVEL, CDE_WEIGHTS, CDE_TENSOR_PARALLEL. --random-weights has no
environment fallback on purpose: it is for benchmarks only (bench/services.py).
"""

from __future__ import annotations

import argparse
import os
import socket
import sys

from cde import limits
from cde.rpc.serving import run_main
from worker_svc.service import DEFAULT_PORT, serve


def _flag(name: str) -> bool:
    return os.environ.get(name, "").lower() in ("1", "true", "yes", "on")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    env = os.environ.get
    ap = argparse.ArgumentParser(prog="python -m worker_svc", description="cde.v1.Worker: the engine behind gRPC")
    ap.add_argument("--model-dir", default=env("CDE_MODEL_DIR"), help="config.json + checkpoint (env CDE_MODEL_DIR)")
    ap.add_argument("--model-name", default=env("CDE_MODEL_NAME", ""), help="default: the model directory's name")
    ap.add_argument("--host", default=env("CDE_WORKER_HOST", "127.0.0.1"))
    ap.add_argument("--port", type=int, default=int(env("CDE_WORKER_PORT", DEFAULT_PORT)))
    ap.add_argument("--advertise", default=env("CDE_WORKER_ADVERTISE", ""),
                    help="host:port the scheduler dials (default --host:--port)")
    ap.add_argument("--scheduler", default=env("CDE_SCHEDULER", ""), help="scheduler host:port to register with")
    ap.add_argument("--worker-id", default=env("CDE_WORKER_ID", ""),
                    help="stable id (default hostname-port)")
    ap.add_argument("--device", default=env("CDE_DEVICE", "cpu"), choices=("cpu", "cuda"))
    ap.add_argument("--dtype", default=env("CDE_DTYPE", "float32"), choices=("float32", "bfloat16", "float16"))
    ap.add_argument("--weights", default=env("CDE_WEIGHTS", "dense"), choices=("dense", "fp8"),
                    help="fp8: the trunk's linear layers in e4m3 with per-output-channel scales (FP8 tensor cores "
                         "on H100/H200; emulated elsewhere); LM head, embeddings and concept heads stay in --dtype. "
                         "Both families (a causal model's listed adapters are merged first)")
    ap.add_argument("--compile", action="store_true", default=_flag("CDE_COMPILE"))
    ap.add_argument("--cuda-graphs", action="store_true", default=_flag("CDE_CUDA_GRAPHS"))
    ap.add_argument("--kv-pages", type=int, default=int(env("CDE_KV_PAGES", 0)) or None,
                    help="KV pages (default: from free GPU memory; 256 on the CPU)")
    ap.add_argument("--max-slots", type=int, default=int(env("CDE_MAX_SLOTS", 64)))
    ap.add_argument("--capture-rows", type=int, default=int(env("CDE_CAPTURE_ROWS", 48)),
                    help="block diffusion with --cuda-graphs: steps of up to this many 64-token rows run from CUDA "
                         "graphs, all captured at start-up; larger steps run eagerly")
    ap.add_argument("--max-stride", type=int, default=int(env("CDE_MAX_STRIDE", limits.MAX_STRIDE)),
                    help="causal models: the largest decode.isd_stride served")
    ap.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false",
                    default=not _flag("CDE_NO_PREFIX_CACHING"),
                    help="prefill every prompt in full (default: requests reuse the K/V of cached prompt "
                         "prefixes, whole 64-token blocks; outputs are the same either way)")
    ap.add_argument("--threads", type=int, default=int(env("CDE_TORCH_THREADS", 0)),
                    help="CPU: torch intra-op threads (0 = torch's default, one per core; several workers "
                         "on one machine should split the cores or they slow each other down badly)")
    ap.add_argument("--drain-timeout", type=float, default=float(env("CDE_DRAIN_TIMEOUT", 60)),
                    help="on SIGTERM/SIGINT: seconds the running requests get to finish while no new ones "
                         "are taken (the rest resume on another worker); keep it below Kubernetes' "
                         "terminationGracePeriodSeconds")
    ap.add_argument("--grace", type=float, default=5.0,
                    help="after the drain: seconds the calls still open get before they are cut off")
    ap.add_argument("--random-weights", type=int, default=None, metavar="SEED",
                    help="BENCHMARK ONLY: random weights from SEED instead of a checkpoint; the model directory "
                         "must be a benchmark one (config + concept tables, cde.steerling.random_weights) and a "
                         "directory with trained weights is refused")
    ap.add_argument("--tensor-parallel", type=int, default=int(env("CDE_TENSOR_PARALLEL", 1)), metavar="N",
                    help="split the model over N ranks (cde/tp.py): this process is rank 0 and starts ranks 1..N-1, "
                         "in lockstep; CUDA: ranks on cuda:0..N-1 of the visible devices over NCCL; CPU: gloo "
                         "(each rank with --threads threads). Heads, KV heads and the MLP width must divide by N")
    ap.add_argument("--tp-rank", type=int, default=0, help=argparse.SUPPRESS)   # set by rank 0 for its followers
    ap.add_argument("--tp-port", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.tensor_parallel < 1:
        ap.error("--tensor-parallel must be >= 1")
    if args.tp_rank and not 0 < args.tp_rank < args.tensor_parallel:
        ap.error("--tp-rank is set by a tensor-parallel worker for its own ranks")
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if not args.model_dir:
        ap.error("--model-dir (or CDE_MODEL_DIR) is required")
    if not args.worker_id:
        args.worker_id = f"{socket.gethostname()}-{args.port}"
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.tp_rank:   # a follower rank of a tensor-parallel worker: no server of its own
        import logging

        from worker_svc.service import options_from_args, run_follower
        logging.basicConfig(level=os.environ.get("CDE_LOG_LEVEL", "INFO"),
                            format=f"%(asctime)s tp-rank{args.tp_rank} %(levelname)s %(name)s: %(message)s")
        run_follower(options_from_args(args), args.tp_rank, args.tp_port)
        return
    run_main(serve, args)


if __name__ == "__main__":
    main()
