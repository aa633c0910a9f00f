"""Long contexts: decode ms/forward at 1K-4K tokens of context vs the floor at the same context,
and time to first block (alone, and 8 requests joining a running batch) vs the prefill floor.

    python -m bench.long_context --engine steerling --preset steerling-8b --out bench/results/long-context-steerling.json
    python -m bench.long_context --engine isd --preset idlm-8b --out bench/results/long-context-isd.json
    python -m bench.long_context --engine steerling --preset tiny --contexts 192,256 --ttfb-prompts 128,192 ...  # CPU

Both engines with random weights (bench.steerling / bench.isd build them), one JSON per call
(docs/BENCHMARKS.md, "Long contexts"). Three measurements, each after an untimed warm-up run of
the same shapes (so compiles and CUDA-graph captures stay out of the timed runs):

* decode: for every context C and concurrency c (`--concurrency`), c requests with a prompt of
  C - new_tokens tokens, so the sequences end at C tokens. Timed from the launch of the first step in which every
  request only decodes to the end of the first request: ms/forward = wall / forwards. The floor (bench.floor) is measured in the same run
  for the same batch, query tokens (Steerling 64; ISD 2N - 1: 7 at N = 4, 1 for AR) and context
  = the mean number of cached keys over the decode steps, with a K/V cache per layer (`kv="cached"`:
  the anchors' floor concatenates the context in every layer, a copy that outgrows the attention
  itself at 4K; it is recorded beside, `concat_ms_per_forward`).
* ttfb: one request alone with an L-token prompt (`--ttfb-prompts`); time from submit to its first
  block (Steerling) / first token (ISD), and `prefill_s`, submit to the launch of its first step
  that only decodes (once the device has finished the steps before it: a step launched ahead
  would otherwise start the decode clock while the prompt's step still runs). first_block_floor_s = prefill floor(L) + steps x decode floor(batch 1,
  context L), steps = the decode steps the first block needs (Steerling at one token per step:
  its masks; ISD: 0, t0 comes from the prefill's logits).
* joins: `--running` short requests decoding, then `--joins` requests of L prompt tokens submitted at
  once: their time to first block, and the running requests' step times (gaps between their step
  events) before the joins vs while the joiners prefill and decode their first block.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch

from bench.steerling import GcPauses, json_writer, run_record
from cde.blocks import BLOCK

_DECODE_KINDS = ("cold", "verify", "overlapped")   # isd_engine.RowKind values of decode windows


@dataclass
class EngineSide:
    """What differs between the engines for this benchmark; everything else is shared."""

    name: str
    engine: object
    vocab: int
    max_context: int
    floor_sizes: tuple[int, int, int, int, int, int]   # layers, hidden, heads, kv_heads, ffn, vocab
    variants: list[int | None]         # ISD strides; [None] for Steerling
    block: int                         # granularity of the cached keys a decode step attends
    submit: Callable                   # (request_id, prompt, new_tokens, variant, seed) -> handle
    decodes: Callable                  # row -> (request_id, whether the row decodes)
    is_step: Callable                  # event -> True for a decode step's event
    is_first_output: Callable          # event -> True for the first output (block / token)
    first_block_tokens: Callable       # prompt_len -> new tokens the first output needs
    first_block_steps: Callable        # prompt_len -> decode steps before the first output
    head_tokens: int                   # LM-head tokens of the prefill (sampled from it)

    def queries(self, variant) -> int:
        return BLOCK if variant is None else 2 * variant - 1

    def label(self, variant) -> str:
        return "block" if variant is None else ("ar" if variant == 1 else f"isd{variant}")


def prefill_rows(args) -> dict:
    """The engine's max_prefill_rows when --max-prefill-rows overrides its default."""
    return {} if args.max_prefill_rows is None else {"max_prefill_rows": args.max_prefill_rows}


def steerling_side(args, cuda: bool, dtype) -> EngineSide:
    from bench.steerling import build_model
    from cde.steerling.config import preset
    from cde.options import DecodeOptions
    from cde.steerling.sampling import SamplingParams
    from worker_svc.engine.job import Job
    from worker_svc.engine.steerling_engine import BlockEvent, SteerlingEngine, StepEvent

    cfg = preset(args.preset)
    model = build_model(args.preset, args.device, dtype)
    slots = max(args.concurrency + [args.running + args.joins])
    engine = SteerlingEngine(model, tokenizer_vocab_size=None, max_slots=slots, n_pages=args.max_pages,
                             compile=cuda and not args.no_compile, cuda_graphs=cuda and not args.no_cuda_graphs,
                             **prefill_rows(args))
    engine.strategy.want_records = False

    def submit(rid, prompt, new_tokens, _variant, seed):
        return engine.submit(Job(rid, prompt, DecodeOptions(new_tokens, SamplingParams(), seed=seed,
                                                            tokens_per_step=args.tokens_per_step,
                                                            confidence_threshold=None, stop_ids=())))

    return EngineSide("steerling", engine, min(cfg.vocab_size, 100_000), cfg.block_size,
                      (cfg.n_layers, cfg.n_embd, cfg.n_head, cfg.n_kv_heads, cfg.intermediate_size, cfg.vocab_size),
                      [None], BLOCK, submit, lambda row: (row.req.request_id, row.is_decode),
                      lambda ev: isinstance(ev, StepEvent), lambda ev: isinstance(ev, BlockEvent),
                      lambda p: BLOCK - p % BLOCK, lambda p: -(-(BLOCK - p % BLOCK) // args.tokens_per_step), 0)


def isd_side(args, cuda: bool, dtype) -> EngineSide:
    from bench.isd import build_model
    from cde.qwen3.config import preset
    from cde.options import IsdOptions
    from worker_svc.engine.isd_engine import IsdCommitEvent, IsdEngine
    from worker_svc.engine.job import Job

    cfg = preset(args.preset)
    strides = [int(n) for n in args.strides.split(",") if n]
    model = build_model(args.preset, args.device, dtype)
    slots = max(args.concurrency + [args.running + args.joins])
    engine = IsdEngine(model, max_slots=slots, n_pages=args.max_pages, max_stride=max(strides),
                       cuda_graphs=cuda and not args.no_cuda_graphs, compile=cuda and not args.no_compile,
                       **prefill_rows(args))

    def submit(rid, prompt, new_tokens, stride, seed):
        return engine.submit(Job(rid, prompt, IsdOptions(new_tokens, stride=stride, temperature=0.0, top_k=0,
                                                         top_p=1.0, seed=seed, proposal="sample", lora_gated=True,
                                                         stop_ids=())))

    first = lambda ev: isinstance(ev, IsdCommitEvent)   # noqa: E731 (t0 is the first commit)
    return EngineSide("isd", engine, min(cfg.vocab_size, 150_000), cfg.max_positions,
                      (cfg.n_layers, cfg.hidden, cfg.n_heads, cfg.n_kv_heads, cfg.intermediate, cfg.vocab_size),
                      strides, 1, submit, lambda row: (row.req.request_id, row.kind in _DECODE_KINDS),
                      first, first, lambda p: 1, lambda p: 0, 1)


def mean_cached_keys(prompt_len: int, new_tokens: int, block: int) -> int:
    """Cached keys a decode step attends, averaged over the generated positions: the keys of
    the whole blocks (Steerling) / tokens (ISD) before each position."""
    return round(statistics.fmean((p // block) * block for p in range(prompt_len, prompt_len + new_tokens)))


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class Tracker:
    """Per request: when its first decode-only step was launched (its prompt is in the cache),
    when its first output and each decode step's events reached the host. Wraps the strategy's
    `execute` (the step loop calls it through the instance)."""

    def __init__(self, side: EngineSide):
        self.side = side
        self.decode_launch: dict[str, float] = {}
        self.decode_launch_forward: dict[str, int] = {}   # the engine's forward count at that launch
        self.first_output: dict[str, float] = {}
        self.step_times: dict[str, list[float]] = {}
        self.handles: list = []
        self.launch_rows: list[int] = []   # rows of every step launched, in order
        self.gc = GcPauses()               # the collector's pauses, summed
        strategy = side.engine.strategy
        execute = strategy.execute

        def tracked_execute(plan):
            rows = plan.rows
            self.launch_rows.append(len(rows))
            now = time.perf_counter()
            decodes: dict[str, bool] = {}
            for row in rows:
                rid, dec = side.decodes(row)
                decodes[rid] = decodes.get(rid, True) and dec
            first = [rid for rid, only_decode in decodes.items() if only_decode and rid not in self.decode_launch]
            if first:
                # a step launched ahead is queued behind the prompt's step still running on the
                # device: the clock starts when the device is free (else it times prefill as decode)
                sync()
                now = time.perf_counter()
            for rid in first:
                self.decode_launch[rid] = now
                self.decode_launch_forward[rid] = strategy.forwards
            return execute(plan)

        strategy.execute = tracked_execute

    def submit(self, tag: str, n: int, prompt_len: int, new_tokens: int, variant, seed: int) -> list:
        gen = torch.Generator().manual_seed(seed)
        handles = [self.side.submit(f"{tag}-{seed}-{i}", torch.randint(0, self.side.vocab, (prompt_len,),
                                                                       generator=gen).tolist(), new_tokens, variant,
                                    seed * 1000 + i)
                   for i in range(n)]
        self.handles += handles
        return handles

    def step(self) -> None:
        self.side.engine.step()
        now = time.perf_counter()
        for h in self.handles:
            for ev in self.side.engine.drain(h):
                if self.side.is_first_output(ev):
                    self.first_output.setdefault(h.request_id, now)
                if self.side.is_step(ev):
                    self.step_times.setdefault(h.request_id, []).append(now)

    def step_until(self, done: Callable[[], bool]) -> None:
        while not done() and self.side.engine.has_work():
            self.step()

    def finish(self) -> None:
        """Cancel what still runs, step the engine idle, forget every request (ids come again)."""
        for h in self.handles:
            self.side.engine.cancel(h.request_id)
        self.step_until(lambda: False)
        for h in self.handles:
            for times in (self.decode_launch, self.decode_launch_forward, self.first_output, self.step_times):
                times.pop(h.request_id, None)
        self.handles.clear()


def decode_run(tracker: Tracker, c: int, context: int, new_tokens: int, variant, seed: int) -> dict:
    eng = tracker.side.engine
    prompt_len = context - new_tokens
    handles = tracker.submit("dec", c, prompt_len, new_tokens, variant, seed)
    t0 = time.perf_counter()
    c0, g0 = eng.strategy.compiles, eng.stats().graphs
    tracker.step_until(lambda: all(h.request_id in tracker.decode_launch for h in handles))
    # timed from the launch of the first step in which every request only decodes
    last = max(handles, key=lambda h: tracker.decode_launch[h.request_id]).request_id
    t, f0 = tracker.decode_launch[last], tracker.decode_launch_forward[last]
    prefill_s = t - t0
    # until the first request ends: long prompts enter the cache a few steps apart, so the
    # last steps of a run would have fewer than c rows
    tracker.step_until(lambda: any(h.finished for h in handles))
    sync()
    wall = time.perf_counter() - t
    forwards = eng.strategy.forwards - f0
    tracker.finish()
    return {"kind": "decode", "decoder": tracker.side.label(variant), "stride": variant, "concurrency": c,
            "context": context, "prompt_tokens": prompt_len, "new_tokens": new_tokens, "prefill_s": prefill_s,
            "forwards": forwards, "wall_s": wall, "ms_per_forward": wall / max(forwards, 1) * 1e3,
            "recompiles": eng.strategy.compiles - c0, "graph_captures_while_timed": eng.stats().graphs - g0}


def _summary(xs: list[float]) -> dict | None:
    return {"median": statistics.median(xs), "max": max(xs), "n": len(xs)} if xs else None


def ttfb_run(tracker: Tracker, prompt_len: int, variant, joins: int, running: int, running_prompt: int,
             before_steps: int, seed: int) -> dict:
    """joins requests of prompt_len tokens; with running > 0 they join that many decoding requests."""
    side, eng = tracker.side, tracker.side.engine
    runners = []
    if running:
        runners = tracker.submit("run", running, running_prompt,
                                 min(side.max_context - running_prompt - 2 * BLOCK, 4096), variant, seed)
        tracker.step_until(lambda: all(len(tracker.step_times.get(h.request_id, ())) >= before_steps or h.finished
                                       for h in runners))
    g0 = eng.stats().graphs
    launched0, gc0 = len(tracker.launch_rows), tracker.gc.seconds
    t0 = time.perf_counter()
    joiners = tracker.submit("join", joins, prompt_len, side.first_block_tokens(prompt_len), variant, seed + 1)
    tracker.step_until(lambda: all(h.request_id in tracker.first_output for h in joiners))
    t_end = time.perf_counter()
    captures = eng.stats().graphs - g0
    # the steps launched until the last first output (a step launched ahead is counted too) and
    # the collector's pauses meanwhile: what a repeat slower than the others spent its time on
    step_rows, gc_ms = tracker.launch_rows[launched0:], 1e3 * (tracker.gc.seconds - gc0)
    alive = sum(1 for h in runners if not h.finished)   # a runner that ended early stops counting
    before, during = [], []
    for h in runners:
        ts = tracker.step_times.get(h.request_id, [])
        for a, b in zip(ts, ts[1:]):
            if b <= t0:
                before.append((b - a) * 1e3)
            elif b <= t_end:
                during.append((b - a) * 1e3)
    ttfb = [tracker.first_output[h.request_id] - t0 for h in joiners]
    prefill = [tracker.decode_launch[h.request_id] - t0 for h in joiners if h.request_id in tracker.decode_launch]
    tracker.finish()
    return {"kind": "ttfb" if not running else "joins", "decoder": side.label(variant), "stride": variant,
            "prompt_tokens": prompt_len, "requests": joins, "running": running, "running_alive": alive,
            "ttfb_s": statistics.median(ttfb), "ttfb_max_s": max(ttfb),
            "prefill_s": statistics.median(prefill) if prefill else None,
            "running_step_ms_before": _summary(before), "running_step_ms_during": _summary(during),
            "stall_ratio": (max(during) / statistics.median(before)) if before and during else None,
            "graph_captures_while_timed": captures, "steps_launched": len(step_rows), "rows_per_step": step_rows,
            "gc_pause_ms": gc_ms}


def measured(fn, repeats: int, warmup: bool = True, engine=None):
    """An untimed warm-up call of fn(seed) (compiles, graph captures; then the heap is frozen, as
    the worker's warm-up does: `EngineRuntime.freeze_heap`), then the repeat whose headline
    figure is the median. `repeats` in run order; `repeat_details` each repeat's steps and GC."""
    if warmup:
        fn(999)
        if engine is not None:
            engine.freeze_heap()
    runs = [fn(i + 1) for i in range(repeats)]
    key = "ms_per_forward" if "ms_per_forward" in runs[0] else "ttfb_s"
    order = sorted(range(len(runs)), key=lambda i: runs[i][key])
    best = dict(runs[order[len(runs) // 2]])
    best["repeats"] = [r[key] for r in runs]
    if "steps_launched" in best:
        best["repeat_details"] = [{key: r[key], "steps_launched": r["steps_launched"], "gc_pause_ms": r["gc_pause_ms"]}
                                  for r in runs]
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", choices=("steerling", "isd"), required=True)
    ap.add_argument("--preset", required=True)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--contexts", default="1024,2048,4096", help="tokens of context at the end of a decode run")
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--strides", default="4,1", help="ISD only: N per set of runs (1 = AR)")
    ap.add_argument("--tokens-per-step", type=int, default=1, help="Steerling only: tokens unmasked per step")
    ap.add_argument("--ttfb-prompts", default="1024,4096",
                    help="prompt lengths for time to first block (cut to fit the first block in the context)")
    ap.add_argument("--joins", type=int, default=8, help="requests joining the running batch at once")
    ap.add_argument("--running", type=int, default=8, help="requests decoding when they join")
    ap.add_argument("--running-prompt", type=int, default=128)
    ap.add_argument("--before-steps", type=int, default=72, help="running steps before the joins (> one block)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-warmup", action="store_true", help="skip the untimed run before each measurement (CPU smoke runs)")
    ap.add_argument("--max-pages", type=int, default=2048)
    ap.add_argument("--max-prefill-rows", type=int, default=None,
                    help="prompt rows (64 tokens each) a step takes (default: the engine's)")
    ap.add_argument("--no-floor", action="store_true")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--no-cuda-graphs", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    args.concurrency = [int(c) for c in args.concurrency.split(",") if c]
    contexts = [int(c) for c in args.contexts.split(",") if c]
    cuda = args.device.startswith("cuda")
    dtype = torch.bfloat16 if cuda else torch.float32

    t = time.perf_counter()
    side = (steerling_side if args.engine == "steerling" else isd_side)(args, cuda, dtype)
    for ctx in contexts:
        if not args.new_tokens < ctx <= side.max_context:
            ap.error(f"--contexts: {ctx} must be in ({args.new_tokens}, {side.max_context}]")
    # a prompt as long as the context is cut so that a whole first block still fits after it (4096 -> 4032)
    ttfb_prompts = [min(int(p), side.max_context - side.first_block_tokens(0)) for p in args.ttfb_prompts.split(",") if p]
    result = run_record("bench.long_context", args.preset, side.name, cuda, dtype, engine=args.engine,
                        new_tokens=args.new_tokens, tokens_per_step=args.tokens_per_step if args.engine == "steerling" else None,
                        max_prefill_rows=side.engine.strategy.max_prefill_rows, floor=[], prefill_floor=[], runs=[],
                        ttfb=[], joins=[])
    save = json_writer(args.out, result)
    print(f"model + engine ready in {time.perf_counter() - t:.0f} s; pages {side.engine.kv.pool.usable}", flush=True)

    # floors first (the engine's KV pool is already reserved; the floor's weights are freed after)
    decode_floor: dict[tuple, float] = {}
    prefill_floor: dict[tuple, float] = {}
    if not args.no_floor:
        from bench.floor import FloorModel

        t = time.perf_counter()
        fm = FloorModel(*side.floor_sizes, device=args.device)
        shapes = {(side.queries(v), mean_cached_keys(ctx - args.new_tokens, args.new_tokens, side.block))
                  for ctx in contexts for v in side.variants}
        shapes |= {(side.queries(side.variants[0]), p) for p in ttfb_prompts if side.first_block_steps(p)}
        for q, k in sorted(shapes):
            # ratios against a K/V cache per layer; the anchors' concatenating floor beside it
            ms = {c: fm.decode_ms(c, q, k, kv="cached") for c in sorted(set(args.concurrency + [1]))}
            concat = {c: fm.decode_ms(c, q, k) for c in sorted(set(args.concurrency + [1]))}
            decode_floor.update({(q, k, c): v for c, v in ms.items()})
            result["floor"].append({"ms_per_forward": {str(c): round(v, 3) for c, v in ms.items()},
                                    "concat_ms_per_forward": {str(c): round(v, 3) for c, v in concat.items()},
                                    "kv": "a cache per layer, new K/V written in place", "context": k,
                                    "query_tokens": q})
        for p in ttfb_prompts:
            ms = {b: fm.prefill_ms(b, p, side.head_tokens) for b in sorted({1, args.joins})}
            prefill_floor.update({(p, b): v for b, v in ms.items()})
            result["prefill_floor"].append({"ms_per_forward": {str(b): round(v, 3) for b, v in ms.items()},
                                            "prompt_tokens": p, "lm_head_tokens": side.head_tokens,
                                            "mask": "causal (lower bound for block-causal)"})
        fm.free()
        print(f"floors ({time.perf_counter() - t:.0f} s): decode {result['floor']}\n  prefill {result['prefill_floor']}",
              flush=True)
        save()

    tracker = Tracker(side)
    for ctx in contexts:
        for v in side.variants:
            for c in args.concurrency:
                r = measured(lambda seed: decode_run(tracker, c, ctx, args.new_tokens, v, seed), args.repeats, not args.no_warmup, side.engine)
                key = (side.queries(v), mean_cached_keys(r["prompt_tokens"], args.new_tokens, side.block), c)
                if key in decode_floor:
                    r["floor"] = {"ms_per_forward": round(decode_floor[key], 3), "context": key[1], "query_tokens": key[0]}
                    r["floor_ms_per_forward"] = decode_floor[key]
                    r["ratio_to_floor"] = r["ms_per_forward"] / decode_floor[key]
                result["runs"].append(r)
                save()
                print(f"decode {r['decoder']} C={c} context {ctx}: {r['ms_per_forward']:.2f} ms/fwd "
                      f"(floor {r.get('floor_ms_per_forward', 0):.2f}, ratio {r.get('ratio_to_floor', 0):.3f})", flush=True)

    v = side.variants[0]
    for p in ttfb_prompts:
        alone = measured(lambda seed: ttfb_run(tracker, p, v, 1, 0, 0, 0, seed), args.repeats, not args.no_warmup, side.engine)
        steps = side.first_block_steps(p)
        if (p, 1) in prefill_floor:
            pf = prefill_floor[(p, 1)] / 1e3
            df = decode_floor.get((side.queries(v), p, 1), 0.0) / 1e3
            alone.update(prefill_floor_s=pf, decode_floor_ms=df * 1e3, first_block_steps=steps,
                         first_block_floor_s=pf + steps * df, ratio_to_first_block_floor=alone["ttfb_s"] / (pf + steps * df),
                         prefill_ratio_to_floor=alone["prefill_s"] / pf if alone["prefill_s"] else None)
        result["ttfb"].append(alone)
        save()
        print(f"ttfb {alone['decoder']} prompt {p} alone: {alone['ttfb_s']:.3f} s (prefill {alone['prefill_s']} s;"
              f" floor {alone.get('first_block_floor_s', 0):.3f} s, ratio {alone.get('ratio_to_first_block_floor', 0):.3f});"
              f" repeats {alone.get('repeat_details')}", flush=True)
        if args.joins and args.running:
            j = measured(lambda seed: ttfb_run(tracker, p, v, args.joins, args.running, args.running_prompt,
                                               args.before_steps, seed), args.repeats, not args.no_warmup, side.engine)
            j["ttfb_over_alone"] = j["ttfb_s"] / alone["ttfb_s"]
            if (p, args.joins) in prefill_floor:
                j["prefill_floor_s"] = prefill_floor[(p, args.joins)] / 1e3
            result["joins"].append(j)
            save()
            b, d = j["running_step_ms_before"] or {}, j["running_step_ms_during"] or {}
            print(f"joins {j['decoder']} {args.joins} x prompt {p} into {args.running} running: ttfb {j['ttfb_s']:.3f} s "
                  f"(max {j['ttfb_max_s']:.3f}); running step ms before {b.get('median', 0):.2f} / max {b.get('max', 0):.2f},"
                  f" during {d.get('median', 0):.2f} / max {d.get('max', 0):.2f}; alive {j['running_alive']}", flush=True)
    save()


if __name__ == "__main__":
    main()
