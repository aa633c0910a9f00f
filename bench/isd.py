"""Benchmark the causal engine: ISD (stride N) vs plain AR, ms/forward vs the floor, verify time.

    python -m bench.isd --preset idlm-8b --out bench/results/isd-idlm-8b-h200.json
    python -m bench.isd --preset tiny --concurrency 1,4 --new-tokens 32   # CPU smoke run

idlm-8b uses random bf16 weights on the GPU (regional compile + CUDA graphs by default). The
floor (bench.floor, method in docs/BENCHMARKS.md) is measured in the same run with the preset's sizes for a
2N-1-query window (7 queries at N = 4) and for 1 query (AR). Each run submits C requests at
once (prompt 128 random tokens, `--new-tokens` each, greedy unless `--temperature`) and steps
the engine until all finish; ms/forward = wall time / engine steps (decode steps; the prefill is timed apart).
Random weights make the acceptance meaningless (reported anyway); the forward latency is the
figure that counts. The verify kernel is timed alone on the step's shapes (CUDA events).

Where a decode step's time goes (per run, `StepClock`): `host_ms_per_step` is the host time from
`step()` until the device step is launched (scheduling and input building), `apply_ms_per_step`
the host time applying its results; `gpu_ms_per_forward` is the device step's GPU busy time
(CUDA events, bench.steerling's GpuTimer) and `gpu_idle_frac` = 1 - busy / wall. In steady decoding
the engine launches the next step before applying this one (`overlapped_steps`), so host time
shows as idle only where it exceeds the GPU's; `--no-overlap` measures what that saves.
`gc_pause_ms` / `gc_full_collections`: garbage-collector pauses inside the measured stretch
(the heap alive after warm-up is frozen out of the collector's view, as the worker does). `--profile 1,32`
runs warm decode steps eagerly (no CUDA graphs) under torch.profiler at those concurrencies and
records the top kernels (on the CPU: operators, self time) with calls per step.
Writes one JSON after every run (fields of docs/BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from cde.qwen3.config import preset
from cde.qwen3.model import Qwen3Model
from bench.steerling import GcPauses, GpuTimer, json_writer, run_record
from cde.steerling.random_weights import random_model
from cde.options import IsdOptions
from worker_svc.engine.isd_engine import IsdEngine, IsdFinishEvent
from worker_svc.engine.job import Job


def build_model(name: str, device: str, dtype: torch.dtype, seed: int = 0) -> Qwen3Model:
    cfg = preset(name)
    return random_model(lambda: Qwen3Model(cfg), device, dtype, seed)


class StepClock:
    """Splits the engine's steps into host time before the launch, GPU busy time of the device
    step (CUDA events) and host time applying the results, by wrapping the engine's `step` and its
    strategy's `device_step` and `apply`. `reset()` before a measured stretch, `report()` after it."""

    def __init__(self, engine: IsdEngine, cuda: bool):
        self.gpu = GpuTimer(cuda)
        self.gc = GcPauses()   # the collector's pauses inside the measured stretch
        self.reset()
        strategy = engine.strategy
        step, device_step, apply = engine.step, self.gpu.wrap(strategy.device_step), strategy.apply
        started = [0.0]

        def timed_step() -> None:
            started[0] = time.perf_counter()
            step()

        def timed_device_step(*args):
            self.host_s += time.perf_counter() - started[0]
            self.launches += 1
            return device_step(*args)

        def timed_apply(*args) -> None:
            t = time.perf_counter()
            apply(*args)
            self.apply_s += time.perf_counter() - t

        engine.step, strategy.device_step, strategy.apply = timed_step, timed_device_step, timed_apply

    def reset(self) -> None:
        self.gpu.pairs.clear()
        self.host_s = self.apply_s = 0.0
        self.launches = 0
        self.gc.reset()

    def report(self, wall: float) -> dict:
        busy = self.gpu.busy_s() if self.gpu.enabled else None
        n = max(self.launches, 1)
        return {"host_ms_per_step": self.host_s / n * 1e3, "apply_ms_per_step": self.apply_s / n * 1e3,
                "gc_pause_ms": self.gc.seconds * 1e3, "gc_full_collections": self.gc.full,
                "gpu_ms_per_forward": busy / n * 1e3 if busy is not None else None,
                "gpu_idle_frac": max(0.0, 1 - busy / wall) if busy is not None else None}


def submit_requests(engine: IsdEngine, cfg, concurrency: int, prompt_len: int, new_tokens: int, stride: int,
                    temperature: float, seed: int, tag: str = "isd") -> list:
    gen = torch.Generator().manual_seed(seed)
    vocab = min(cfg.vocab_size, 150_000)
    opts = [IsdOptions(new_tokens, stride=stride, temperature=temperature, top_k=0, top_p=1.0, seed=i,
                       proposal="sample", lora_gated=True, stop_ids=()) for i in range(concurrency)]
    return [engine.submit(Job(f"{tag}-{seed}-{i}", torch.randint(0, vocab, (prompt_len,), generator=gen).tolist(), o))
            for i, o in enumerate(opts)]


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def prefill(engine: IsdEngine, handles: list) -> None:
    """Step until every request has its first token: the prompt chunks are not decode steps."""
    while any(not h.out for h in handles) and engine.has_work():
        engine.step()
    sync()


def run_once(engine: IsdEngine, cfg, concurrency: int, prompt_len: int, new_tokens: int, stride: int,
             seed: int, clock: StepClock, temperature: float = 0.0) -> dict:
    handles = submit_requests(engine, cfg, concurrency, prompt_len, new_tokens, stride, temperature, seed)
    # prefill (and the first token) apart: the figure is the steady decode forward
    t0 = time.perf_counter()
    prefill(engine, handles)
    prefill_s = time.perf_counter() - t0
    s0, c0, o0 = engine.steps, engine.strategy.compiles, engine.overlapped_steps
    tokens0 = sum(len(h.out) for h in handles)
    g0 = engine.stats().graphs
    clock.reset()
    t = time.perf_counter()
    while engine.has_work():
        engine.step()
    sync()
    wall = time.perf_counter() - t
    steps = engine.steps - s0
    fins = [e for h in handles for e in engine.drain(h) if isinstance(e, IsdFinishEvent)]
    generated = sum(f.completion_tokens for f in fins) - tokens0
    proposed = sum(f.stats.proposed for f in fins)
    accepted = sum(f.stats.accepted for f in fins)
    return {"concurrency": concurrency, "stride": stride, "temperature": temperature, "attribution": False,
            "steering": False, "prompt_tokens": prompt_len, "new_tokens": new_tokens, "decode_steps": steps,
            "ms_per_forward": wall / max(steps, 1) * 1e3, "overlapped_steps": engine.overlapped_steps - o0,
            **clock.report(wall),
            "tok_per_s": generated / wall if wall else None,
            "tokens_per_forward_per_request": generated / max(steps, 1) / concurrency,
            "acceptance": accepted / proposed if proposed else None, "prefill_s": prefill_s,
            "peak_mem_gb": torch.cuda.max_memory_allocated() / 1e9 if torch.cuda.is_available() else None,
            "pages_total": engine.kv.pool.usable, "recompiles": engine.strategy.compiles - c0,
            "graphs": engine.stats().graphs, "graphs_captured_in_run": engine.stats().graphs - g0}


def op_table(prof, steps: int, cuda: bool, top: int = 40) -> dict:
    """Profiler events by name, per step: GPU kernels (device time) on CUDA, else CPU operators
    (self time, so nested operators are not counted twice)."""
    kind = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU
    by_name: dict[str, list[float]] = {}
    for ev in prof.events():
        if ev.device_type == kind:
            us = ev.device_time_total if cuda else ev.self_cpu_time_total
            by_name.setdefault(ev.name, []).append(us / 1e3)
    rows = sorted(((sum(v) / steps, len(v) / steps, k) for k, v in by_name.items()), reverse=True)
    return {"unit": "gpu kernel" if cuda else "cpu operator (self time)",
            "kernel_ms_per_step": sum(r[0] for r in rows), "kernels_per_step": sum(r[1] for r in rows),
            "top": [{"ms_per_step": round(ms, 4), "calls_per_step": n, "kernel": k[:160]} for ms, n, k in rows[:top]]}


def profile_steps(engine: IsdEngine, cfg, concurrency: int, stride: int, prompt_len: int, new_tokens: int,
                  temperature: float = 0.0, steps: int = 1, warm: int = 2) -> dict:
    """Warm decode steps of C requests run eagerly (no CUDA graphs, so every kernel shows) under
    torch.profiler: kernels by time with calls per step, and the step's wall time."""
    from torch.profiler import ProfilerActivity, profile

    cuda = engine.device.type == "cuda"
    strategy = engine.strategy
    replay = strategy.device_step
    strategy.device_step = strategy.runner.step
    handles = submit_requests(engine, cfg, concurrency, prompt_len, new_tokens, stride, temperature, 4242, "prof")
    try:
        prefill(engine, handles)
        for _ in range(warm):
            engine.step()
        sync()
        rows = len(engine.running)
        with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
            t = time.perf_counter()
            for _ in range(steps):
                engine.step()
            sync()
            wall = (time.perf_counter() - t) / steps
    finally:
        strategy.device_step = replay
        for h in handles:
            engine.cancel(h.request_id)
        engine.run_until_idle()
        for h in handles:
            list(engine.drain(h))
    return {"concurrency": concurrency, "stride": stride, "temperature": temperature, "running_requests": rows,
            "steps": steps, "step_wall_ms": wall * 1e3, **op_table(prof, steps, cuda)}


def time_verify(cfg, rows: int, stride: int, iters: int = 50) -> float | None:
    """ms per call of the step's verify (Triton kernel) on (rows, N-1) drafts over the vocabulary."""
    if not torch.cuda.is_available():
        return None
    from cde.isd.verify_kernel import launch as verify_triton   # what the engine calls (no host checks)
    k, v = stride - 1, cfg.vocab_size
    g = torch.Generator(device="cuda").manual_seed(0)
    p = torch.randn(rows, k, v, device="cuda", generator=g, dtype=torch.float32)
    q = torch.randn(rows, k, v, device="cuda", generator=g, dtype=torch.float32)
    drafts = torch.randint(0, v, (rows, k), device="cuda", generator=g)
    temp = torch.full((rows,), 0.8, device="cuda")
    ua = torch.rand(rows, k, device="cuda", generator=g)
    ur = torch.rand(rows, k, device="cuda", generator=g)
    greedy = torch.zeros(rows, dtype=torch.bool, device="cuda")
    args = (p, q, drafts, temp, ua, ur, greedy)
    for _ in range(3):
        verify_triton(*args)
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(iters):
        verify_triton(*args)
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) / iters


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="idlm-8b")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--concurrency", default="1,32,64")
    ap.add_argument("--strides", default="4,1")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--max-pages", type=int, default=2048)
    ap.add_argument("--no-floor", action="store_true")
    ap.add_argument("--no-cuda-graphs", action="store_true")
    ap.add_argument("--no-overlap", action="store_true", help="launch each step only after the previous one's "
                    "results are applied (measures what overlapping saves)")
    ap.add_argument("--no-compile", action="store_true", help="eager layers (default on GPU: regional compile)")
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy requests (the greedy-only step)")
    ap.add_argument("--profile", default="", help="concurrencies whose warm decode steps are profiled (e.g. 1,32)")
    ap.add_argument("--profile-steps", type=int, default=1)
    ap.add_argument("--weights", default="dense", choices=("dense", "fp8"),
                    help="fp8: the trunk's projections in e4m3 (cde/fp8.py), against the FP8 floor; the dense "
                         "floor is measured beside it")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    cuda = args.device.startswith("cuda")
    dtype = torch.bfloat16 if cuda else torch.float32
    cfg = preset(args.preset)
    concs = [int(c) for c in args.concurrency.split(",") if c]
    strides = [int(n) for n in args.strides.split(",") if n]
    result = run_record("bench.isd", args.preset, "isd", cuda, dtype, floor=None, runs=[], verify_ms={},
                        weights=args.weights)
    save = json_writer(args.out, result)

    if cuda and not args.no_floor:
        from bench.floor import measure_floor
        # the floor of the run's weights; with fp8 also the dense one ("floor_dense")
        for key, weights in [("floor", args.weights)] + ([("floor_dense", "dense")] if args.weights != "dense" else []):
            result[key] = {}
            for n in sorted(set(strides)):
                q = 2 * n - 1
                f = measure_floor(cfg.n_layers, cfg.hidden, cfg.n_heads, cfg.n_kv_heads, cfg.intermediate,
                                  cfg.vocab_size, concs, queries=q, context=args.prompt_tokens + args.new_tokens // 2,
                                  weights=weights)
                result[key][f"{q}_query"] = {str(b): round(v, 3) for b, v in f.items()}
                print(f"{key} ({weights}) {q}-query: {result[key][f'{q}_query']}", flush=True)
        save()
    t = time.perf_counter()
    model = build_model(args.preset, args.device, dtype)
    if args.weights == "fp8":
        from cde.fp8 import to_fp8
        to_fp8(model)
    engine = IsdEngine(model, max_slots=max(concs + [4]), n_pages=args.max_pages, max_stride=max(strides + [1]),
                       cuda_graphs=cuda and not args.no_cuda_graphs, compile=cuda and not args.no_compile,
                       overlap=not args.no_overlap)
    result["compiled"], result["cuda_graphs"] = cuda and not args.no_compile, cuda and not args.no_cuda_graphs
    result["overlap"] = not args.no_overlap
    clock = StepClock(engine, cuda)
    print(f"model + engine ready in {time.perf_counter() - t:.0f} s; pages {engine.kv.pool.usable}", flush=True)
    t = time.perf_counter()
    # warm-up at full length: every shape (page buckets included) the measured runs use. Sampled
    # requests accept drafts at random, so one run may not reach every (rows, Q, K, pages, flags)
    # bucket: repeat with other seeds until a run captures no new graph (at most 4 runs)
    for c in concs:
        for n in strides:
            for seed in range(999, 995, -1):
                before = engine.stats().graphs
                run_once(engine, cfg, c, args.prompt_tokens, args.new_tokens, n, seed, clock, args.temperature)
                if engine.stats().graphs == before:
                    break
    result["warmup_s"] = time.perf_counter() - t
    result["compiles_after_warmup"] = engine.strategy.compiles
    engine.freeze_heap()   # as IsdEngine.warmup does before a worker serves
    # decode windows through the Triton paged attention (worker_svc/engine/attention.py)?
    runner = engine.strategy.runner
    result["paged_attention"] = runner.use_paged_attention and runner.paged_calls > 0
    print(f"warm-up {result['warmup_s']:.0f} s, compiles {engine.strategy.compiles}, "
          f"paged attention {result['paged_attention']}", flush=True)
    for i, c in enumerate(concs):
        for n in strides:
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            r = run_once(engine, cfg, c, args.prompt_tokens, args.new_tokens, n, i + 1, clock, args.temperature)
            floor = (result["floor"] or {}).get(f"{2 * n - 1}_query", {}).get(str(c))
            if floor:
                r["floor_ms_per_forward"] = floor
                r["ratio_to_floor"] = r["ms_per_forward"] / floor
            result["runs"].append(r)
            save()
            print(f"C={c:3d} N={n}: {r['ms_per_forward']:7.2f} ms/fwd (floor {floor or 0:6.2f}, ratio "
                  f"{r.get('ratio_to_floor', 0):5.2f})  {r['tok_per_s'] or 0:8.1f} tok/s  tokens/fwd/req "
                  f"{r['tokens_per_forward_per_request']:.2f}  acceptance {r['acceptance']}  host "
                  f"{r['host_ms_per_step']:.2f} + {r['apply_ms_per_step']:.2f} ms/step"
                  + (f"  gpu {r['gpu_ms_per_forward']:.2f} ms  idle {r['gpu_idle_frac']:.3f}"
                     if r["gpu_ms_per_forward"] is not None else "")
                  + f"  overlapped {r['overlapped_steps']}  gc {r['gc_pause_ms']:.1f} ms", flush=True)
        if cuda:
            for n in strides:
                if n > 1:
                    result["verify_ms"][f"C{c}_N{n}"] = time_verify(cfg, c, n)
            save()
    if args.profile:
        result["profile"] = []
        for c in (int(x) for x in args.profile.split(",") if x):
            for n in strides:
                prof = profile_steps(engine, cfg, c, n, args.prompt_tokens, args.new_tokens, args.temperature,
                                     args.profile_steps)
                result["profile"].append(prof)
                save()
                print(f"profile C={c} N={n}: step {prof['step_wall_ms']:.2f} ms wall (no graphs), "
                      f"{prof['unit']}: {prof['kernel_ms_per_step']:.2f} ms in {prof['kernels_per_step']:.0f} calls",
                      flush=True)
                for row in prof["top"][:25]:
                    print(f"   {row['ms_per_step']:8.3f} ms  x{row['calls_per_step']:6.1f}  {row['kernel'][:110]}",
                          flush=True)
    by = {(r["concurrency"], r["stride"]): r["ms_per_forward"] for r in result["runs"]}
    result["isd_over_ar_forward"] = {str(c): by[(c, n)] / by[(c, 1)] for c in concs for n in strides
                                     if n > 1 and (c, 1) in by and (c, n) in by}
    result["sglang_isd_over_ar_reference"] = {"1": 1.04, "64": 1.20}
    save()
    print(json.dumps({"isd_over_ar_forward": result["isd_over_ar_forward"], "verify_ms": result["verify_ms"]}),
          flush=True)


if __name__ == "__main__":
    main()
