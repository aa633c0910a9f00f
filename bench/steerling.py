"""Benchmark the engine: tok/s, ms/forward, time to first/last block, GPU idle, vs the floor.

    python -m bench.steerling --preset steerling-8b --out bench/results/engine-h200.json
    python -m bench.steerling --preset tiny --concurrency 1,4 --new-tokens 64   # CPU smoke run

steerling-8b uses random bf16 weights on the GPU (compiled + CUDA graphs); the floor
(bench.floor, method in docs/BENCHMARKS.md) is measured in the same run with
the preset's own sizes. Each run submits C requests at once (prompt 128 random tokens, 256 new
tokens, one token per step) and runs the engine until all finish. "on" = every request steered
(fixed schedule, so injection stays on) and its raw concept records copied to the host; "off"
= neither. Writes one JSON (fields of docs/BENCHMARKS.md) after every run, so a run cut
short still leaves its figures.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from cde.steerling.config import preset
from cde.steerling.model import SteerlingModel
from cde.steerling.random_weights import random_model, tie_embeddings
from cde.options import DecodeOptions
from cde.steerling.sampling import SamplingParams
from cde.steerling.steering import SteeringSpec, prepare
from worker_svc.engine.job import Job
from worker_svc.engine.steerling_engine import BlockEvent, SteerlingEngine


def build_model(name: str, device: str, dtype: torch.dtype, seed: int = 0) -> SteerlingModel:
    cfg = preset(name)
    return random_model(lambda: SteerlingModel(cfg), device, dtype, seed, tie_embeddings)


def git_commit() -> str:
    """The commit that ran: CDE_COMMIT when set (bench/run_h200.sh sets it: the device's copy of
    the tree can carry a stale .git, whose HEAD JSONs before 47bff51 recorded), else git's HEAD."""
    env = os.environ.get("CDE_COMMIT", "")
    if env and env != "unknown":
        return env
    try:
        return subprocess.check_output(["git", "rev-parse", "HEAD"], text=True, stderr=subprocess.DEVNULL).strip()
    except Exception:
        return "unknown"


def floor_record(cfg, batches: list[int], weights: str = "dense") -> dict:
    """The floor (bench.floor) of a Steerling step at these batch sizes, as a result's `floor`:
    64 query tokens over a 512-token context, with the engine's weights (dense or fp8)."""
    from bench.floor import measure_floor

    floor = measure_floor(cfg.n_layers, cfg.n_embd, cfg.n_head, cfg.n_kv_heads, cfg.intermediate_size,
                          cfg.vocab_size, batches, weights=weights)
    return {"ms_per_forward": {str(b): round(v, 3) for b, v in floor.items()}, "query_tokens": 64, "context": 512,
            "weights": weights}


def run_record(module: str, preset_name: str, decoder: str, cuda: bool, dtype: torch.dtype, **extra) -> dict:
    """The fields every bench JSON starts with (docs/BENCHMARKS.md): what ran, where, how."""
    return {"commit": git_commit(), "gpu": torch.cuda.get_device_name() if cuda else platform.processor() or "cpu",
            "preset": preset_name, "decoder": decoder,
            "command": " ".join([sys.executable, "-m", module] + sys.argv[1:]),
            "torch": torch.__version__, "dtype": str(dtype), **extra}


def json_writer(path: str | None, result: dict):
    """save(): rewrite the JSON at `path` (nothing when None), after every run."""
    out = Path(path) if path else None

    def save() -> None:
        if out is not None:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(result, indent=2) + "\n")
    return save


class GcPauses:
    """The garbage collector's pauses from construction on (`gc.callbacks`): seconds summed and
    full (generation 2) collections counted; a full collection can stall a step for milliseconds."""

    def __init__(self) -> None:
        self._started = 0.0
        self.reset()
        gc.callbacks.append(self._on_gc)

    def reset(self) -> None:
        self.seconds = 0.0
        self.full = 0

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._started
            self.full += info.get("generation") == 2


class GpuTimer:
    """Accumulates GPU busy time per step with CUDA events (idle = wall - busy)."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.pairs: list[tuple] = []

    def wrap(self, fn):
        if not self.enabled:
            return fn

        def timed(*a, **k):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            out = fn(*a, **k)
            e.record()
            self.pairs.append((s, e))
            return out
        return timed

    def busy_s(self) -> float:
        torch.cuda.synchronize()
        return sum(s.elapsed_time(e) for s, e in self.pairs) / 1e3


def run_once(engine: SteerlingEngine, model, concurrency: int, prompt_len: int, new_tokens: int, on: bool,
             seed: int, vocab: int, timer: GpuTimer, tokens_per_step: int = 1,
             threshold: float | None = None) -> dict:
    cfg = model.cfg
    gen = torch.Generator().manual_seed(seed)
    steering = None
    if on:
        spec = SteeringSpec(concept_ids=(1, 2), target=4.0, normalize=True, inject_layer=cfg.n_layers // 4,
                            schedule="fixed")
        steering = prepare(spec, model.known_head.embeddings(torch.tensor([1, 2], device=model.rope_cos.device)),
                           model.transformer.lm_head.weight, cfg.n_layers)
    engine.strategy.want_records = on
    handles = []
    for i in range(concurrency):
        prompt = torch.randint(0, vocab, (prompt_len,), generator=gen).tolist()
        opts = DecodeOptions(new_tokens, SamplingParams(), tokens_per_step=tokens_per_step,
                             confidence_threshold=threshold, seed=seed * 1000 + i, stop_ids=())
        handles.append(engine.submit(Job(f"bench-{seed}-{i}", prompt, opts, steering=steering)))
    timer.pairs.clear()
    f0, s0, c0, o0 = engine.strategy.forwards, engine.steps, engine.strategy.compiles, engine.overlapped_steps
    peak_pages = 0
    t0 = time.perf_counter()
    first_block: dict[str, float] = {}
    block_times: dict[str, list[float]] = {}
    while engine.has_work():
        engine.step()
        now = time.perf_counter()
        peak_pages = max(peak_pages, engine.stats().pages_used)
        for h in handles:
            for ev in engine.drain(h):
                if isinstance(ev, BlockEvent):
                    first_block.setdefault(h.request_id, now - t0)
                    block_times.setdefault(h.request_id, []).append(now - t0)
    wall = time.perf_counter() - t0
    generated = sum(len([t for t in h.seq[len(h.prompt):] if t != cfg.mask_id]) for h in handles)
    gaps = [b - a for ts in block_times.values() for a, b in zip(ts, ts[1:])]
    forwards = engine.strategy.forwards - f0
    busy = timer.busy_s() if timer.enabled else None
    return {
        "concurrency": concurrency, "attribution": on, "steering": on, "stride": None,
        "tokens_per_step": tokens_per_step, "threshold": threshold,
        "tokens_per_step_per_request": generated / max(forwards, 1) / concurrency,
        "prompt_tokens": prompt_len, "new_tokens": new_tokens,
        "tok_per_s": generated / wall, "generated_tokens": generated, "wall_s": wall,
        "forwards": forwards, "ms_per_forward": wall / max(forwards, 1) * 1e3,
        "gpu_ms_per_forward": (busy / max(forwards, 1) * 1e3) if busy is not None else None,
        "ttfb_s": statistics.median(first_block.values()) if first_block else None,
        "inter_block_s": statistics.median(gaps) if gaps else None,
        "ttlb_s": wall,
        "gpu_idle_frac": (max(0.0, 1 - busy / wall)) if busy is not None else None,
        "peak_mem_gb": torch.cuda.max_memory_allocated() / 1e9 if torch.cuda.is_available() else None,
        "peak_pages_used": peak_pages, "pages_total": engine.kv.pool.usable,
        "recompiles": engine.strategy.compiles - c0, "steps": engine.steps - s0,
        "overlapped_steps": engine.overlapped_steps - o0,
    }


def profile_steps(model, concurrency: int, prompt_len: int, vocab: int, compile_: bool, steps: int = 6) -> dict:
    """Kernel-level breakdown of steady decode steps (no CUDA graphs, so every kernel shows):
    GPU time per step by kernel name, the kernel count, and the step's wall time."""
    from torch.profiler import ProfilerActivity, profile

    eng = SteerlingEngine(model, tokenizer_vocab_size=None, max_slots=max(concurrency, 4), n_pages=concurrency * 8 + 8,
                 compile=compile_, cuda_graphs=False)
    gen = torch.Generator().manual_seed(7)
    for i in range(concurrency):
        prompt = torch.randint(0, vocab, (prompt_len,), generator=gen).tolist()
        opts = DecodeOptions(256, SamplingParams(), tokens_per_step=1, confidence_threshold=None, seed=i, stop_ids=())
        eng.submit(Job(f"prof-{i}", prompt, opts))
    for _ in range(4):   # prefill, commit and the first decode steps, compiles
        eng.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        t = time.perf_counter()
        for _ in range(steps):
            eng.step()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t) / steps
    by_name: dict[str, list[float]] = {}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            by_name.setdefault(ev.name, []).append(ev.device_time_total / 1e3)
    rows = sorted(((sum(v) / steps, len(v) / steps, k) for k, v in by_name.items()), reverse=True)
    total = sum(r[0] for r in rows)
    return {"concurrency": concurrency, "compiled": compile_, "step_wall_ms": wall * 1e3, "kernel_ms_per_step": total,
            "kernels_per_step": sum(r[1] for r in rows),
            "top": [{"ms_per_step": round(ms, 4), "calls_per_step": n, "kernel": k[:160]} for ms, n, k in rows[:40]]}


def merge_reference(out: Path, log: Path) -> None:
    """Add the public reference's tok/s (measured right after the engine run) and our speedup."""
    import re

    result = json.loads(out.read_text())
    ref: dict[str, float] = {}
    for line in log.read_text().splitlines():
        m = re.search(r"bsz=(\d+) attribution_cb=(\w+).*?([\d.]+) tok/s", line)
        if m:
            key = m.group(1) + ("_attribution_cb" if m.group(2) == "True" else "")
            ref[key] = float(m.group(3))
    result["reference"] = {"tok_per_s": ref, "script": "bench/anchor_steerling_ref.py", "new_tokens": 128}
    ours = {r["concurrency"]: r["tok_per_s"] for r in result["runs"] if r["attribution"] and r["new_tokens"] == 256}
    result["speedup_vs_reference"] = {
        str(c): ours[c] / ref[str(c)] for c in (1, 4) if c in ours and str(c) in ref}
    if 1 in ours and "1_attribution_cb" in ref:
        result["speedup_vs_reference"]["1_attribution_cb"] = ours[1] / ref["1_attribution_cb"]
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({"reference": result["reference"], "speedup": result["speedup_vs_reference"]}, indent=2))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="steerling-8b")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--concurrency", default="1,2,4,8,16,32,64")
    ap.add_argument("--off-concurrency", default="1,16,32", help="concurrencies also run with attribution+steering off")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--long-run", default="64x1024", help="CxN run for memory (empty to skip)")
    ap.add_argument("--max-pages", type=int, default=4096)
    ap.add_argument("--no-floor", action="store_true")
    ap.add_argument("--weights", default="dense", choices=("dense", "fp8"),
                    help="fp8: the trunk's projections in e4m3 (cde/fp8.py), against the FP8 floor; the dense "
                         "(bf16) floor is measured too, as `floor_dense`")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--no-overlap", action="store_true", help="launch each step only after the previous one's "
                    "results are applied (measures what overlapping saves)")
    ap.add_argument("--tokens-per-step", default="1",
                    help="multi-token unmasking: tokens committed per step, each value a set of runs (e.g. 1,2,4)")
    ap.add_argument("--thresholds", default="",
                    help="confidence thresholds, each run at the largest --tokens-per-step (e.g. 0.9,0.7)")
    ap.add_argument("--profile", default="", help="concurrencies to profile kernel by kernel (e.g. 1,32)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--merge-reference", default=None, metavar="LOG",
                    help="merge bench/anchor_steerling_ref.py output into --out and exit")
    args = ap.parse_args()
    if args.merge_reference:
        merge_reference(Path(args.out), Path(args.merge_reference))
        return

    cuda = args.device.startswith("cuda")
    dtype = torch.bfloat16 if cuda else torch.float32
    cfg = preset(args.preset)
    concs = [int(c) for c in args.concurrency.split(",") if c]
    offs = [int(c) for c in args.off_concurrency.split(",") if c]
    steps_k = [int(k) for k in args.tokens_per_step.split(",") if k] or [1]
    thresholds = [float(t) for t in args.thresholds.split(",") if t]
    # (tokens per step, threshold) of every measured set of runs
    settings = [(k, None) for k in steps_k] + [(max(steps_k), t) for t in thresholds]
    result = run_record("bench.steerling", args.preset, "block", cuda, dtype,
                        tokens_per_step=steps_k[0] if len(settings) == 1 else [list(x) for x in settings],
                        overlap=not args.no_overlap, floor=None, reference=None, runs=[], weights=args.weights)
    save = json_writer(args.out, result)

    if cuda and not args.no_floor:
        t = time.perf_counter()
        result["floor"] = floor_record(cfg, sorted(set(concs + offs)), args.weights)
        print(f"floor ({args.weights}, {time.perf_counter() - t:.0f} s): {result['floor']['ms_per_forward']}", flush=True)
        if args.weights != "dense":
            result["floor_dense"] = floor_record(cfg, sorted(set(concs + offs)))
            print(f"floor (dense): {result['floor_dense']['ms_per_forward']}", flush=True)
        save()

    t = time.perf_counter()
    model = build_model(args.preset, args.device, dtype)
    if args.weights == "fp8":
        from cde.fp8 import to_fp8
        to_fp8(model)
        if cuda:
            torch.cuda.empty_cache()
    vocab = min(cfg.vocab_size, 100_000)
    timer = GpuTimer(cuda)

    def make_engine(compile_: bool) -> SteerlingEngine:
        eng = SteerlingEngine(model, tokenizer_vocab_size=None, max_slots=max(concs + [64]), n_pages=args.max_pages,
                     compile=compile_, cuda_graphs=cuda, overlap=not args.no_overlap)
        eng.strategy.device_step = timer.wrap(eng.strategy.device_step)
        return eng

    compiled = cuda and not args.no_compile
    engine = make_engine(compiled)
    print(f"model + engine ready in {time.perf_counter() - t:.0f} s; pages {engine.kv.pool.usable}", flush=True)

    long_run = tuple(int(x) for x in args.long_run.split("x")) if args.long_run else None
    warm = sorted(set(concs + offs + ([long_run[0]] if long_run else [])))
    # warm-up: compile and capture the graphs every measured run will use
    t = time.perf_counter()
    # Full length, so the page buckets the runs grow into are captured here and not while timed.
    warm_len = {c: args.new_tokens for c in concs + offs}
    if long_run:
        warm_len[long_run[0]] = max(warm_len.get(long_run[0], 0), 2)
    try:
        for c in warm:
            for k, thr in settings:   # every tokens-per-step bucket the runs use
                run_once(engine, model, c, args.prompt_tokens, warm_len[c], True, 999, vocab, timer, k, thr)
            print(f"  warm C={c} at {time.perf_counter() - t:.0f} s, compiles {engine.strategy.compiles}, "
                  f"graphs {engine.stats().graphs}", flush=True)
    except Exception as exc:  # keep measuring: eager + CUDA graphs
        import traceback
        traceback.print_exc()
        result["compile_error"] = f"{type(exc).__name__}: {exc}"[:2000]
        compiled = False
        del engine
        torch.cuda.empty_cache()
        engine = make_engine(False)
        for c in warm:
            for k, thr in settings:
                run_once(engine, model, c, args.prompt_tokens, warm_len[c], True, 999, vocab, timer, k, thr)
    result["compiled"] = compiled
    result["warmup_s"] = time.perf_counter() - t
    result["compiles_after_warmup"] = engine.strategy.compiles
    print(f"warm-up {result['warmup_s']:.0f} s, compiles {engine.strategy.compiles}, graphs {engine.stats().graphs}",
          flush=True)

    plan = [(c, True, args.new_tokens, k, thr) for k, thr in settings for c in concs]
    plan += [(c, False, args.new_tokens, k, thr) for k, thr in settings for c in offs]
    if long_run:
        plan.append((long_run[0], True, long_run[1], steps_k[0], None))
    for i, (c, on, n, k, thr) in enumerate(plan):
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        g0 = engine.stats().graphs
        r = run_once(engine, model, c, args.prompt_tokens, n, on, i + 1, vocab, timer, k, thr)
        r["graphs"] = engine.stats().graphs
        r["graph_captures_while_timed"] = r["graphs"] - g0
        if result["floor"] and str(c) in result["floor"]["ms_per_forward"]:
            r["floor_ms_per_forward"] = result["floor"]["ms_per_forward"][str(c)]
            r["ratio_to_floor"] = r["ms_per_forward"] / r["floor_ms_per_forward"]
        result["runs"].append(r)
        save()
        mt = f" k={k}" + (f" thr={thr:g}" if thr is not None else "") if len(settings) > 1 else ""
        print(f"C={c:3d} {'on ' if on else 'off'} new={n}{mt}: {r['tok_per_s']:8.1f} tok/s  {r['ms_per_forward']:7.2f} ms/fwd"
              f"  gpu {r['gpu_ms_per_forward'] or 0:7.2f} ms  idle {r['gpu_idle_frac'] or 0:5.3f}"
              f"  ratio {r.get('ratio_to_floor', 0):5.3f}  ttfb {r['ttfb_s'] or 0:6.3f}s  inter-block {r['inter_block_s'] or 0:6.3f}s"
              f"  pages {r['peak_pages_used']}  mem {r['peak_mem_gb'] or 0:6.1f} GB  recompiles {r['recompiles']}", flush=True)
    save()
    if cuda and args.profile:
        del engine
        torch.cuda.empty_cache()
        result["profile"] = []
        for c in (int(x) for x in args.profile.split(",") if x):
            prof = profile_steps(model, c, args.prompt_tokens, vocab, compiled)
            result["profile"].append(prof)
            save()
            print(f"profile C={c}: step {prof['step_wall_ms']:.2f} ms wall (no graphs), kernels {prof['kernel_ms_per_step']:.2f} ms"
                  f" in {prof['kernels_per_step']:.0f} launches", flush=True)
            for row in prof["top"][:25]:
                print(f"   {row['ms_per_step']:8.3f} ms  x{row['calls_per_step']:6.1f}  {row['kernel'][:110]}", flush=True)


if __name__ == "__main__":
    main()
