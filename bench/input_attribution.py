"""Input attribution speed: seconds per attributed token (integrated gradients, `n_steps` points,
the targets of one denoising step batched), alone and beside decode load, and how much that load's
decode slows down while attribution shares the GPU.

    python -m bench.input_attribution --preset steerling-8b --out bench/results/input-attribution-8b.json
    python -m bench.input_attribution --preset tiny --prompt-tokens 32 --targets 4 --n-steps 4   # CPU smoke

The model is the benchmark one (random weights at the preset's dims, as bench.steerling's); the
snapshots follow a left-to-right commit order, `--per-step` targets a step, in the block after a
`--prompt-tokens` prompt (what the service does for a finished request after its replay).
"Beside decode load": an engine decodes `--load` requests in a thread while the attribution runs;
its tok/s then, against the same load alone, is the decode slowdown.
"""

from __future__ import annotations

import argparse
import threading
import time

import torch

from bench.steerling import build_model, json_writer, run_record
from cde.options import DecodeOptions
from cde.steerling.config import preset
from cde.steerling.input_attribution import CommitGroup, attribute
from cde.steerling.sampling import SamplingParams
from worker_svc.engine.job import Job
from worker_svc.engine.steerling_engine import SteerlingEngine


def groups_for(prompt_len: int, targets: int, per_step: int, vocab: int, seed: int) -> list[CommitGroup]:
    gen = torch.Generator().manual_seed(seed)
    out, p = [], prompt_len
    while sum(len(g.positions) for g in out) < targets:
        pos = tuple(range(p, p + per_step))
        out.append(CommitGroup(len(out), pos, tuple(torch.randint(0, vocab, (per_step,), generator=gen).tolist())))
        p += per_step
    return out


def time_attribution(model, prompt: list[int], groups, n_steps: int) -> float:
    sync()
    t0 = time.perf_counter()
    attribute(model, prompt, len(prompt) + sum(len(g.positions) for g in groups), groups, n_steps)
    sync()
    return time.perf_counter() - t0


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def decode_load(engine: SteerlingEngine, n: int, new_tokens: int, vocab: int, seed: int, stop: threading.Event,
                counts: list[int]) -> None:
    """Keep `n` requests decoding until `stop`; counts[0] += tokens committed."""
    gen = torch.Generator().manual_seed(seed)
    i = 0
    while not stop.is_set():
        handles = []
        for _ in range(n):
            prompt = torch.randint(0, vocab, (64,), generator=gen).tolist()
            handles.append(engine.submit(Job(f"load-{seed}-{i}", prompt, DecodeOptions(
                new_tokens, SamplingParams(), 1, None, i, ()), stream_steps=False, records=False)))
            i += 1
        while engine.has_work() and not stop.is_set():
            engine.step()
        counts[0] += sum(h.committed for h in handles)


def load_tok_per_s(engine, n: int, new_tokens: int, vocab: int, seconds: float, seed: int, during=None) -> float:
    stop, counts = threading.Event(), [0]
    th = threading.Thread(target=decode_load, args=(engine, n, new_tokens, vocab, seed, stop, counts))
    t0 = time.perf_counter()
    th.start()
    if during is not None:
        during()
    else:
        time.sleep(seconds)
    stop.set()
    th.join()
    return counts[0] / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="steerling-8b")
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--targets", type=int, default=8)
    ap.add_argument("--per-step", type=int, default=1)
    ap.add_argument("--n-steps", type=int, default=32)
    ap.add_argument("--load", type=int, default=16, help="decode requests beside the attribution (0: none)")
    ap.add_argument("--out")
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    dtype = torch.bfloat16 if cuda else torch.float32
    cfg = preset(args.preset)
    model = build_model(args.preset, "cuda" if cuda else "cpu", dtype)
    vocab = min(cfg.vocab_size, 100_000)
    prompt = torch.randint(0, vocab, (args.prompt_tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    groups = groups_for(len(prompt), args.targets, args.per_step, vocab, 1)
    result = run_record("bench.input_attribution", args.preset, "steerling", cuda, dtype,
                        settings={"prompt_tokens": args.prompt_tokens, "targets": args.targets,
                                  "per_step": args.per_step, "n_steps": args.n_steps, "load": args.load})
    save = json_writer(args.out, result)
    time_attribution(model, prompt, groups[:1], 2)   # warm-up (allocator, kernels)
    alone = time_attribution(model, prompt, groups, args.n_steps)
    result["alone"] = {"s_per_target": alone / args.targets, "wall_s": alone}
    print(f"alone: {alone / args.targets:.3f} s per target ({args.targets} targets, n_steps {args.n_steps})")
    save()
    if args.load:
        # a KV pool the load needs (8 pages a request) rather than 85 % of what is free: the
        # attribution beside it needs its activations' memory back
        engine = SteerlingEngine(model, tokenizer_vocab_size=vocab, cuda_graphs=cuda, max_slots=max(args.load, 4),
                                 n_pages=max(args.load, 4) * 8 + 16)
        engine.warmup(4)
        base = load_tok_per_s(engine, args.load, 128, vocab, max(alone, 5.0), 2)
        timing = {}

        def attribute_now() -> None:
            timing["wall_s"] = time_attribution(model, prompt, groups, args.n_steps)
        loaded = load_tok_per_s(engine, args.load, 128, vocab, 0, 3, during=attribute_now)
        result["beside_decode"] = {"s_per_target": timing["wall_s"] / args.targets, "wall_s": timing["wall_s"],
                                   "decode_tok_per_s_alone": base, "decode_tok_per_s_during": loaded,
                                   "decode_slowdown": base / loaded if loaded else None}
        print(f"beside {args.load} decoding: {timing['wall_s'] / args.targets:.3f} s per target; "
              f"decode {base:.1f} -> {loaded:.1f} tok/s")
        save()


if __name__ == "__main__":
    main()
