"""Prefix caching: time to first block (Steerling) / first token (ISD) of requests that share a
long system prompt, with the prefix cache on and off, in one engine.

    python -m bench.prefix_cache --engine steerling --preset steerling-8b --out bench/results/prefix-cache-steerling.json
    python -m bench.prefix_cache --engine isd --preset idlm-8b --out bench/results/prefix-cache-isd.json
    python -m bench.prefix_cache --engine steerling --preset tiny --system-tokens 128 --concurrency 1,4 --no-floor  # CPU

Every request's prompt is the same `--system-tokens` tokens (random ids, fixed) followed by
`--suffix-tokens` of its own (fresh per request and repeat). A run submits `c` such requests at
once and times each from the submit to its first output; the headline is the median over the c
requests, median over `--repeats` runs, each setting after an untimed warm-up run of its shapes.
Cache off runs first, with the cache detached (nothing looked up or published), then cache on: its
warm-up leaves the system prompt cached, the state a server with a shared system prompt is in.
Outputs are the same either way (tests/test_prefix_cache.py). The prefill floor of the whole
prompt (bench.floor, batch 1 and c) is measured in the same run: what a cache-off request must at
least spend before its first decode step.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench.long_context import Tracker, isd_side, steerling_side, sync
from bench.steerling import json_writer, run_record


def shared_prompt_run(tracker: Tracker, system: list[int], suffix_tokens: int, c: int, variant, seed: int) -> dict:
    side, eng = tracker.side, tracker.side.engine
    gen = torch.Generator().manual_seed(seed * 1000 + c)   # suffixes unlike every other run's
    stats0 = eng.stats()
    sync()
    t0 = time.perf_counter()
    handles = [side.submit(f"pc-{seed}-{i}", system + torch.randint(0, side.vocab, (suffix_tokens,), generator=gen).tolist(),
                           side.first_block_tokens(len(system) + suffix_tokens), variant, seed * 1000 + i)
               for i in range(c)]
    tracker.handles += handles
    tracker.step_until(lambda: all(h.request_id in tracker.first_output for h in handles))
    ttfb = [tracker.first_output[h.request_id] - t0 for h in handles]
    stats1 = eng.stats()
    tracker.finish()
    return {"concurrency": c, "ttfb_s": statistics.median(ttfb), "ttfb_max_s": max(ttfb),
            "prefix_cache_queries": stats1.prefix_cache_queries - stats0.prefix_cache_queries,
            "prefix_cache_hits": stats1.prefix_cache_hits - stats0.prefix_cache_hits,
            "forwards": stats1.forwards - stats0.forwards}


def measured(fn, repeats: int, warmup: bool) -> dict:
    if warmup:
        fn(999)
    runs = [fn(i + 1) for i in range(repeats)]
    order = sorted(range(len(runs)), key=lambda i: runs[i]["ttfb_s"])
    best = dict(runs[order[len(runs) // 2]])
    best["repeats"] = [r["ttfb_s"] for r in runs]
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", choices=("steerling", "isd"), required=True)
    ap.add_argument("--preset", required=True)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--system-tokens", type=int, default=2048, help="the shared prefix (whole 64-token blocks are cached)")
    ap.add_argument("--suffix-tokens", type=int, default=64, help="each request's own tokens after it")
    ap.add_argument("--concurrency", default="1,32")
    ap.add_argument("--stride", type=int, default=4, help="ISD only: N (1 = AR)")
    ap.add_argument("--tokens-per-step", type=int, default=1, help="Steerling only: tokens unmasked per step")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-warmup", action="store_true")
    ap.add_argument("--max-pages", type=int, default=2048)
    ap.add_argument("--max-prefill-rows", type=int, default=None)
    ap.add_argument("--no-floor", action="store_true")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--no-cuda-graphs", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    args.concurrency = [int(c) for c in args.concurrency.split(",") if c]
    # what bench.long_context's engine builders read
    args.running, args.joins, args.strides = 0, 0, str(args.stride)
    cuda = args.device.startswith("cuda")
    dtype = torch.bfloat16 if cuda else torch.float32

    t = time.perf_counter()
    side = (steerling_side if args.engine == "steerling" else isd_side)(args, cuda, dtype)
    prompt_len = args.system_tokens + args.suffix_tokens
    if prompt_len + side.first_block_tokens(prompt_len) > side.max_context:
        ap.error(f"--system-tokens + --suffix-tokens: {prompt_len} leaves no room for a first block")
    variant = side.variants[0]
    pool = side.engine.kv.pool
    if pool.cache is None:
        ap.error("the engine was built without a prefix cache")
    result = run_record("bench.prefix_cache", args.preset, side.name, cuda, dtype, engine=args.engine,
                        system_tokens=args.system_tokens, suffix_tokens=args.suffix_tokens,
                        stride=variant, tokens_per_step=args.tokens_per_step if args.engine == "steerling" else None,
                        max_prefill_rows=side.engine.strategy.max_prefill_rows, prefill_floor=None, runs=[])
    save = json_writer(args.out, result)
    print(f"model + engine ready in {time.perf_counter() - t:.0f} s; pages {pool.usable}", flush=True)

    floor: dict[int, float] = {}
    if not args.no_floor:
        from bench.floor import FloorModel

        fm = FloorModel(*side.floor_sizes, device=args.device)
        floor = {b: fm.prefill_ms(b, prompt_len, side.head_tokens) for b in sorted(set(args.concurrency))}
        fm.free()
        result["prefill_floor"] = {"prompt_tokens": prompt_len, "lm_head_tokens": side.head_tokens,
                                   "mask": "causal (lower bound for block-causal)",
                                   "ms_per_forward": {str(b): round(v, 3) for b, v in floor.items()}}
        print(f"prefill floor ({prompt_len} tokens): {result['prefill_floor']['ms_per_forward']} ms", flush=True)
        save()

    system = torch.randint(0, side.vocab, (args.system_tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    tracker = Tracker(side)
    cache = pool.cache
    by_setting: dict[tuple[bool, int], dict] = {}
    for on in (False, True):
        # off: detached while no request holds a page (nothing cached yet), so the pool's pages
        # are all on its free list; on: the warm-up run caches the system prompt
        pool.cache = cache if on else None
        for c in args.concurrency:
            r = measured(lambda seed: shared_prompt_run(tracker, system, args.suffix_tokens, c, variant, seed),
                         args.repeats, not args.no_warmup)
            r.update(prefix_caching=on, prompt_tokens=prompt_len)
            if c in floor:
                r["prefill_floor_s"] = floor[c] / 1e3
            off = by_setting.get((False, c))
            if on and off:
                r["speedup_over_off"] = off["ttfb_s"] / r["ttfb_s"]
            by_setting[(on, c)] = r
            result["runs"].append(r)
            save()
            print(f"prefix cache {'on ' if on else 'off'} C={c}: ttfb {r['ttfb_s']:.3f} s (max {r['ttfb_max_s']:.3f});"
                  f" hits {r['prefix_cache_hits']} / {r['prefix_cache_queries']} tokens; repeats {r['repeats']}"
                  + (f"; {r['speedup_over_off']:.2f}x off" if "speedup_over_off" in r else ""), flush=True)
    pool.cache = cache
    save()


if __name__ == "__main__":
    main()
