"""Benchmark through the services beside the in-process engine, in one run.

    python -m bench.services --out bench/results/services-steerling-8b-h200.json      # GPU host
    python -m bench.services --preset tiny --device cpu --concurrency 1,2 --duration 3 \
        --new-tokens 64 --engine-repeats 1 --out /tmp/services-tiny.json             # CPU smoke run

1. Writes a benchmark model directory (config.json of the preset, random concept tables, the
   tokenizer file) in a temporary directory (cde.steerling.random_weights).
2. Starts the whole stack with cde.launch.Stack on loopback: Redis, steering, attribution,
   scheduler, one worker (`--random-weights SEED`; on CUDA bf16, --compile, --cuda-graphs),
   gateway (--gateway-processes, 4); warms every concurrency up through the gateway (full-length
   requests). --trace: the services stamp each request (cde.trace), the JSON gets the hops.
3. For each C: locust headless (bench/locust_sse.py; one process per 4 users, at most 8), C
   users streaming POST /v1/completions (SSE, prompt of random token ids) in a closed loop for
   --duration s; every request's block arrival times go to a JSON-lines file. tok/s counts the
   blocks that arrive while all C users are running (from the C-th request's start to the last
   request's start). The client's time to first block is split with the services' own
   counters (the worker's Info, the scheduler's Stats, the gateway's /metrics) and each
   process's CPU per request.
4. Stops the stack, then runs the engine in this process (bench.steerling.run_once, the same
   model sizes, prompt length and new tokens, steering/attribution off like the requests) at
   the same concurrencies, the median of --engine-repeats runs after warm-up; then the same
   engine under the services' traffic shape ("engine-closed-loop": C users resubmitting as soon
   as a request finishes, for --duration s), with the CUDA graphs it had to capture.
5. Writes one JSON (docs/BENCHMARKS.md): runs with `path` "services" | "engine" |
   "engine-closed-loop", and per C the ratios services/engine of tok/s and inter-block latency,
   the time to first block the services add, and the same against the closed-loop engine
   the services add.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from bench.steerling import GpuTimer, build_model, floor_record, json_writer, run_once, run_record
from cde import trace
from cde.launch import ROOT, Stack, child_pids
from cde.steerling.config import SteerlingConfig, preset
from cde.steerling.random_weights import write_benchmark_model_dir
from cde.steerling.tokenizer import BPE_ENV_VAR
from cde.options import DecodeOptions
from cde.steerling.sampling import SamplingParams
from worker_svc.engine.job import Job
from worker_svc.engine.steerling_engine import BlockEvent, FinishEvent, SteerlingEngine

LOCUSTFILE = ROOT / "bench" / "locust_sse.py"
BPE_FILE = "cl100k_base.tiktoken"
# Aims of the issue (reported beside the figures, never asserted here).
AIMS = {"tok_per_s_ratio_min": 0.95, "ttfb_added_max_s": 0.020}


def tokenizer_file(cfg: SteerlingConfig) -> Path | None:
    """The BPE file a cl100k model directory needs: $CDE_CL100K_BPE, else .whl/ (bench/wheels.sh
    puts it there for the GPU host). A byte-tokenizer model (tiny) needs none."""
    if cfg.tokenizer.get("kind") != "cl100k":
        return None
    for cand in (os.environ.get(BPE_ENV_VAR), ROOT / ".whl" / BPE_FILE):
        if cand and Path(cand).is_file():
            return Path(cand)
    raise SystemExit(f"{cfg.tokenizer}: set {BPE_ENV_VAR} to {BPE_FILE} or run bench/wheels.sh (puts it in .whl/)")


def prompt_token_bound(cfg: SteerlingConfig) -> int:
    """Prompts are random ids below every special id (and the BPE's first 100,000)."""
    return min(100_000, cfg.eos_id, cfg.pad_id, cfg.bos_id, cfg.endofchunk_id, cfg.mask_id)


def post_json(url: str, body: dict, timeout: float) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def warm_services(base_url: str, concurrency: int, prompt_tokens: int, new_tokens: int, bound: int) -> None:
    """C full-length requests at once: the worker compiles / captures that batch size untimed."""
    body = {"prompt": [i % bound for i in range(prompt_tokens)], "max_tokens": new_tokens, "seed": 1}
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(lambda i: post_json(f"{base_url}/v1/completions", dict(body, seed=i), 900),
                      range(concurrency)))


def summarize_load(lines: list[dict], concurrency: int) -> dict:
    """Figures of one locust run from its per-request lines (bench/locust_sse.py)."""
    ok = [r for r in lines if r["ok"]]
    errors = [r["error"] for r in lines if not r["ok"]]
    if len(ok) < concurrency:
        raise RuntimeError(f"C={concurrency}: {len(ok)} requests finished (errors: {errors[:3]})")
    starts = sorted(r["start"] for r in ok)
    t_full, t_last = starts[concurrency - 1], starts[-1]   # all C users running in between
    window = t_last - t_full
    in_window = sum(n for r in ok for t, n in r["blocks"] if t_full < t <= t_last)
    tokens = sum(r["tokens"] for r in ok)
    wall = max(r["end"] for r in ok) - starts[0]
    gaps = [g for r in ok for g in r["gaps_s"]]
    # after a request's last block: the stream's end (usage chunk, [DONE]) as the client sees it
    tails = [r["end"] - r["blocks"][-1][0] for r in ok if r["blocks"]]
    return {"tok_per_s": in_window / window if window > 0 else tokens / wall,
            "steady_window_s": window, "tok_per_s_wall": tokens / wall, "wall_s": wall,
            "requests": len(ok), "errors": len(errors), "generated_tokens": tokens,
            "ttfb_s": statistics.median(r["ttfb_s"] for r in ok),
            "ttfb_p90_s": sorted(r["ttfb_s"] for r in ok)[int(0.9 * (len(ok) - 1))],
            "ttfb_mean_s": statistics.fmean(r["ttfb_s"] for r in ok),
            # a closed-loop user's whole cycle: tok/s at C = 1 is tokens / this
            "request_s_mean": statistics.fmean(r["end"] - r["start"] for r in ok),
            "inter_block_s": statistics.median(gaps) if gaps else None,
            "stream_tail_s": statistics.median(tails) if tails else None}


def _internal_call(port: int, call, metadata=None):
    """call(channel, metadata) on a loopback channel to an internal service, its token sent:
    ``metadata`` (a launcher Stack's ``internal_metadata``), else $CDE_INTERNAL_TOKEN_FILE's."""
    import grpc

    from cde.rpc.internal_auth import token_metadata

    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        return call(ch, token_metadata() if metadata is None else metadata)


def worker_status(port: int, metadata=None):
    """The worker's Info (steps, compiles, CUDA graphs captured so far, its timing sums)."""
    from cde.rpc.v1 import worker_pb2, worker_pb2_grpc

    return _internal_call(port, lambda ch, md: worker_pb2_grpc.WorkerStub(ch).Info(
        worker_pb2.WorkerStatusRequest(), timeout=10, metadata=md), metadata)


def scheduler_stats(port: int, metadata=None):
    """The scheduler's Stats (its relay timing so far)."""
    from cde.rpc.v1 import scheduler_pb2, scheduler_pb2_grpc

    return _internal_call(port, lambda ch, md: scheduler_pb2_grpc.SchedulerStub(ch).Stats(
        scheduler_pb2.StatsRequest(), timeout=10, metadata=md), metadata)


def scheduler_timing(before, after) -> dict:
    """The scheduler's means over the run: Submit received -> Worker.Submit issued, and a first
    block read from the worker -> published to the request's streams."""
    placed, firsts = after.placed - before.placed, after.first_blocks - before.first_blocks
    return {"scheduler_submit_ms_mean": 1e3 * (after.submit_to_worker_seconds_sum - before.submit_to_worker_seconds_sum)
            / placed if placed else None,
            "scheduler_first_block_relay_ms_mean": 1e3 * (after.first_block_relay_seconds_sum
                                                          - before.first_block_relay_seconds_sum) / firsts
            if firsts else None}


def worker_timing(before, after, ttfb_mean_s: float) -> dict:
    """Where the time to first block goes, from two of the worker's Info (cumulative sums): the
    mean wait from Submit to joining a step, the mean time from Submit to the first block leaving
    the worker, and the rest of the client's mean (gateway, scheduler, Redis and back)."""
    admitted = after.admitted - before.admitted
    firsts = after.first_blocks - before.first_blocks
    queue_ms = 1e3 * (after.queue_seconds_sum - before.queue_seconds_sum) / admitted if admitted else None
    first_block = (after.first_block_seconds_sum - before.first_block_seconds_sum) / firsts if firsts else None
    return {"worker_queue_ms_mean": queue_ms, "worker_first_block_s_mean": first_block,
            "stack_ttfb_s": ttfb_mean_s - first_block if first_block is not None else None,
            # overlapped steps planned once the step in flight's trunk was done, and those launched late
            "worker_late_plans": after.late_plans - before.late_plans,
            "worker_late_plan_misses": after.late_plan_misses - before.late_plan_misses}


def gateway_ttfb(base_url: str) -> tuple[float, float]:
    """(sum of seconds, count) of the gateway's own time-to-first-block histogram (GET /metrics):
    from its handler taking the parsed request to the first block it translates."""
    text = urllib.request.urlopen(f"{base_url}/metrics", timeout=10).read().decode()
    total = {"_sum": 0.0, "_count": 0.0}
    for line in text.splitlines():
        for suffix in total:
            if line.startswith(f"cde:time_to_first_block_seconds{suffix}"):
                total[suffix] += float(line.rsplit(" ", 1)[1])
    return total["_sum"], total["_count"]


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds a live process has used (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def process_cpu(stack: Stack) -> dict[str, float]:
    """CPU seconds so far of every service process of the stack, Redis included, a service's
    child processes counted with it (Linux only)."""
    pids = {svc.name: svc.proc.pid for svc in stack.services if svc.proc is not None}
    if stack.redis is not None and stack.redis.pid is not None:
        pids["redis"] = stack.redis.pid
    try:
        return {name: cpu_seconds(pid) + sum(cpu_seconds(c) for c in child_pids(pid)) for name, pid in pids.items()}
    except OSError:   # no /proc (not Linux)
        return {}


def children_cpu() -> float:
    """CPU seconds of this process's waited-for children (the locust run) so far."""
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def stack_split(run: dict, gw_before: tuple[float, float], gw_after: tuple[float, float],
                cpu_before: dict[str, float], cpu_after: dict[str, float], client_cpu_s: float) -> dict:
    """Where the client's mean time to first block goes beyond the worker's (`worker_timing`):
    the gateway's own mean (handler -> first block), so the client side (the load client, HTTP
    parsing and validation before the handler, SSE writes) and the gateway + scheduler + Redis
    side; and the CPU each process spent per request (a burst of C requests queues behind it)."""
    n = gw_after[1] - gw_before[1]
    out: dict = {"gateway_ttfb_s_mean": (gw_after[0] - gw_before[0]) / n if n else None}
    if out["gateway_ttfb_s_mean"] is not None:
        out["client_side_ttfb_s"] = run["ttfb_mean_s"] - out["gateway_ttfb_s_mean"]
        if run.get("worker_first_block_s_mean") is not None:
            out["gateway_scheduler_ttfb_s"] = out["gateway_ttfb_s_mean"] - run["worker_first_block_s_mean"]
    requests = max(run["requests"], 1)
    cpu = {name: 1e3 * (cpu_after[name] - cpu_before[name]) / requests for name in cpu_after if name in cpu_before}
    cpu["load_client"] = 1e3 * client_cpu_s / requests
    out["cpu_ms_per_request"] = {k: round(v, 3) for k, v in cpu.items()}
    return out


# The hops of a request's way to its first block and back, between consecutive stamps (cde.trace):
# the load client's start and first block, the gateway's, the scheduler's and the worker's.
HOPS = (("client_to_gateway", "start", "gw_received"),          # HTTP, body parsing, keys, validation
        ("gateway_prepare", "gw_received", "gw_submit"),       # tokenize, resolve options, open the call
        ("gateway_to_scheduler", "gw_submit", "sch_submit"),    # gRPC
        ("scheduler_forward", "sch_submit", "sch_worker_submit"),   # admission, Redis create + claim, placement
        ("scheduler_to_worker", "sch_worker_submit", "wk_submit"),  # gRPC
        ("worker", "wk_submit", "wk_first_block"),             # queue, prefill, decoding the block
        ("worker_to_scheduler", "wk_first_block", "sch_first_read"),
        ("scheduler_relay", "sch_first_read", "sch_first_published"),   # Redis append, publish
        ("scheduler_to_gateway", "sch_first_published", "gw_first_read"),
        ("gateway_to_client", "gw_first_read", "first_block"))  # translate, SSE write, the client's parsing


def trace_stamps(trace_dir: Path) -> dict[str, dict]:
    """Every service's stamps (cde.trace) by request id."""
    stamps: dict[str, dict] = {}
    for f in trace_dir.glob("*.jsonl"):
        for x in f.read_text().splitlines():
            if x.strip():
                rec = json.loads(x)
                stamps.setdefault(rec.pop("rid"), {}).update(rec)
    return stamps


def trace_hops(lines: list[dict], stamps: dict[str, dict]) -> dict | None:
    """Mean ms of every hop over the run's requests that every service traced."""
    joined = []
    for r in lines:
        s = stamps.get(r.get("request_id") or "")
        if r["ok"] and r["blocks"] and s is not None:
            s = dict(s, start=r["start"], first_block=r["blocks"][0][0])
            if all(a in s and b in s for _, a, b in HOPS):
                joined.append(s)
    if not joined:
        return None
    return {"requests": len(joined),
            "ms_mean": {name: round(1e3 * statistics.fmean(s[b] - s[a] for s in joined), 3) for name, a, b in HOPS}}


def load_processes(concurrency: int, requested: int) -> int:
    """Locust processes for C users: `requested`, or (0) one per 4 users up to 8. One gevent
    process runs its users' sends and reads in turn, so at C = 32 a burst of requests that end
    together waits in the load client itself (the client-side share of the time to first block grew
    from 3 to 19 ms between C = 1 and 32 with one process, eea1fda; 9 to 12 ms with one per 8
    users, 2287b0d / 0fffaf6) unless the users are spread over processes, as real clients are."""
    return requested if requested > 0 else max(1, min(8, concurrency // 4))


def run_locust(base_url: str, concurrency: int, duration: float, events: Path, env: dict, stop_timeout: float,
               processes: int = 1) -> None:
    cmd = [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless", "-u", str(concurrency),
           "-r", str(concurrency), "-t", f"{duration:g}s", "--stop-timeout", f"{stop_timeout:g}",
           "--host", base_url, "--only-summary", "--loglevel", "WARNING"]
    if processes > 1:
        cmd += ["--processes", str(processes)]
    proc = subprocess.run(cmd, cwd=events.parent, env=dict(env, CDE_LOAD_EVENTS=str(events)), capture_output=True,
                          text=True, timeout=duration + stop_timeout + 120)
    # locust exits 1 when a request failed; summarize_load reports those failures by name
    if proc.returncode not in (0, 1) or not events.exists():
        raise RuntimeError(f"locust exited with {proc.returncode}:\n{(proc.stdout + proc.stderr)[-3000:]}")


def services_runs(args, cfg: SteerlingConfig, model_dir: Path, work: Path, concs: list[int], bound: int) -> list[dict]:
    cuda = args.device.startswith("cuda")
    worker_args = ["--random-weights", str(args.seed)]
    if cuda:
        worker_args += ["--dtype", "bfloat16", "--cuda-graphs"] + ([] if args.no_compile else ["--compile"])
    if args.kv_pages:
        worker_args += ["--kv-pages", str(args.kv_pages)]
    ns = argparse.Namespace(model_dir=str(model_dir), device="cuda" if cuda else "cpu", workers=1, host="127.0.0.1",
                            http_port=0, grpc_port=0, run_dir=str(work / "run"), timeout=args.startup_timeout,
                            worker_args=worker_args, gateway_processes=args.gateway_processes,
                            devices=args.devices or None, tensor_parallel=args.tensor_parallel)
    stack = Stack(ns)
    runs = []
    try:
        t = time.perf_counter()
        stack.start()
        print(f"stack healthy in {time.perf_counter() - t:.0f} s: {stack.base_url}", flush=True)
        t = time.perf_counter()
        try:
            for c in concs:
                warm_services(stack.base_url, c, args.prompt_tokens, args.new_tokens, bound)
        except Exception:   # a request failed: what the services logged says why
            for svc in stack.services:
                print(f"---- {svc.name} log tail\n{stack.log_tail(svc, 60)}", flush=True)
            raise
        print(f"services warm-up {time.perf_counter() - t:.0f} s", flush=True)
        env = dict(os.environ, PYTHONUNBUFFERED="1", CDE_LOAD_PROMPT_TOKENS=str(args.prompt_tokens),
                   CDE_LOAD_MAX_TOKENS=str(args.new_tokens), CDE_LOAD_TOKEN_BOUND=str(bound))
        worker_port = next(svc.grpc_port for svc in stack.services if svc.name.startswith("worker"))
        scheduler_port = next(svc.grpc_port for svc in stack.services if svc.name == "scheduler")
        md = stack.internal_metadata   # the stack's per-run internal token
        for c in concs:
            events = work / f"load-c{c}.jsonl"
            before, sched_before, gw_before, cpu_before, client0 = (
                worker_status(worker_port, md), scheduler_stats(scheduler_port, md), gateway_ttfb(stack.base_url),
                process_cpu(stack), children_cpu())
            processes = load_processes(c, args.load_processes)
            run_locust(stack.base_url, c, args.duration, events, env, args.stop_timeout, processes)
            after, sched_after, gw_after, cpu_after = (worker_status(worker_port, md),
                                                       scheduler_stats(scheduler_port, md),
                                                       gateway_ttfb(stack.base_url), process_cpu(stack))
            client_cpu = children_cpu() - client0
            lines = [json.loads(x) for x in events.read_text().splitlines() if x.strip()]
            stamps = trace_stamps(Path(os.environ[trace.ENV])) if args.trace else {}
            if args.out:   # the per-request lines beside the JSON (with their stamps), for looking into a figure later
                Path(args.out).parent.mkdir(parents=True, exist_ok=True)
                Path(args.out).with_suffix(f".c{c}.jsonl").write_text("".join(
                    json.dumps(dict(x, trace=stamps[x["request_id"]]) if x.get("request_id") in stamps else x) + "\n"
                    for x in lines))
            r = {"path": "services", "concurrency": c, "prompt_tokens": args.prompt_tokens,
                 "new_tokens": args.new_tokens, "attribution": False, "steering": False, "stride": None,
                 "duration_s": args.duration, "load_processes": processes,
                 "gateway_processes": args.gateway_processes, **summarize_load(lines, c),
                 # shape buckets the warm-up did not capture: each costs a capture inside the run
                 "worker_graph_captures": after.graphs - before.graphs,
                 "worker_recompiles": after.compiles - before.compiles, "worker_steps": after.steps - before.steps,
                 # steps launched before the previous one's results were read (the rest idle the GPU)
                 "worker_overlapped_steps": after.overlapped_steps - before.overlapped_steps}
            r.update(worker_timing(before, after, r["ttfb_mean_s"]))
            r.update(stack_split(r, gw_before, gw_after, cpu_before, cpu_after, client_cpu))
            r.update(scheduler_timing(sched_before, sched_after))
            if args.trace:
                r["trace_hops"] = trace_hops(lines, stamps)
            runs.append(r)
            print(f"services C={c:3d}: {r['tok_per_s']:8.1f} tok/s  ttfb {r['ttfb_s']:.3f}s  "
                  f"inter-block {r['inter_block_s'] or 0:.3f}s  tail {r['stream_tail_s'] or 0:.3f}s  requests {r['requests']}"
                  f"  worker graph captures {r['worker_graph_captures']} recompiles {r['worker_recompiles']}"
                  f"  overlapped {r['worker_overlapped_steps']}/{r['worker_steps']} steps"
                  f" (planned late {r['worker_late_plans']}, missed {r['worker_late_plan_misses']})"
                  f"  in the worker: queue {r['worker_queue_ms_mean'] or 0:.1f} ms, first block {r['worker_first_block_s_mean'] or 0:.3f}s;"
                  f" stack {1e3 * (r['stack_ttfb_s'] or 0):.1f} ms (client side {1e3 * (r.get('client_side_ttfb_s') or 0):.1f},"
                  f" gateway + scheduler {1e3 * (r.get('gateway_scheduler_ttfb_s') or 0):.1f}; in the scheduler:"
                  f" to the worker {r['scheduler_submit_ms_mean'] or 0:.1f} ms, first block relay"
                  f" {r['scheduler_first_block_relay_ms_mean'] or 0:.1f} ms);"
                  f" CPU ms/request {r['cpu_ms_per_request']}"
                  + (f"; hops (ms, mean of {r['trace_hops']['requests']}): {r['trace_hops']['ms_mean']}"
                     if r.get("trace_hops") else ""), flush=True)
    finally:
        stack.stop()
    return runs


def closed_loop(engine: SteerlingEngine, concurrency: int, duration: float, prompt_tokens: int, new_tokens: int,
                bound: int, seed: int) -> list[dict]:
    """The in-process engine under the services run's traffic shape: `concurrency` users, each
    submitting its next request the moment its last one finishes, for `duration` s (then the
    requests in flight finish). One line per request in bench/locust_sse.py's format, so
    `summarize_load` reads both the same way."""
    rng = torch.Generator().manual_seed(seed)
    lines: list[dict] = []
    live: dict[int, tuple] = {}
    n = 0

    def submit(user: int) -> None:
        nonlocal n
        prompt = torch.randint(0, bound, (prompt_tokens,), generator=rng).tolist()
        # no StepEvents, as the worker's requests that nobody watches denoise
        options = DecodeOptions(new_tokens, SamplingParams(), tokens_per_step=1, confidence_threshold=None,
                                seed=seed * 7919 + n, stop_ids=())
        handle = engine.submit(Job(f"loop-{seed}-{n}", prompt, options, stream_steps=False))
        live[user] = (handle, time.time(), time.perf_counter(), [])
        n += 1

    engine.strategy.want_records = False
    for u in range(concurrency):
        submit(u)
    end_at = time.perf_counter() + duration
    while live:
        engine.step()
        now = time.perf_counter()
        for u, (h, start, t0, blocks) in list(live.items()):
            for ev in engine.drain(h):
                if isinstance(ev, BlockEvent):
                    blocks.append((now, len(ev.tokens)))
                elif isinstance(ev, FinishEvent):
                    stamps = [t for t, _ in blocks]
                    lines.append({"start": start, "end": start + (now - t0),
                                  "ttfb_s": stamps[0] - t0 if stamps else None,
                                  "gaps_s": [b - a for a, b in zip(stamps, stamps[1:])],
                                  "blocks": [[start + (t - t0), k] for t, k in blocks],
                                  "tokens": sum(k for _, k in blocks), "ok": bool(stamps), "error": None})
                    del live[u]
                    if now < end_at:
                        submit(u)
    return lines


def engine_runs(args, cfg: SteerlingConfig, concs: list[int], bound: int, floor_ms: dict | None = None) -> list[dict]:
    cuda = args.device.startswith("cuda")
    dtype = torch.bfloat16 if cuda else torch.float32
    model = build_model(args.preset, args.device, dtype, seed=args.seed)
    engine = SteerlingEngine(model, tokenizer_vocab_size=None, max_slots=max(concs + [64]), n_pages=args.kv_pages or None,
                             compile=cuda and not args.no_compile, cuda_graphs=cuda)
    timer = GpuTimer(False)
    t = time.perf_counter()
    for c in concs:   # compile / capture every batch size and page bucket untimed
        run_once(engine, model, c, args.prompt_tokens, args.new_tokens, False, 999, bound, timer)
    if engine.cuda_graphs:   # as the worker's warm-up does: every graph up to capture_rows rows
        print(f"engine captured {engine.capture_graphs()} more CUDA graphs", flush=True)
    print(f"engine warm-up {time.perf_counter() - t:.0f} s", flush=True)
    runs = []
    for c in concs:
        reps = [run_once(engine, model, c, args.prompt_tokens, args.new_tokens, False, i + 1, bound, timer)
                for i in range(args.engine_repeats)]
        mid = sorted(reps, key=lambda r: r["tok_per_s"])[len(reps) // 2]
        r = {"path": "engine", **mid, "repeats": len(reps), "tok_per_s_all": [x["tok_per_s"] for x in reps]}
        if floor_ms and str(c) in floor_ms:
            r["floor_ms_per_forward"] = floor_ms[str(c)]
            r["ratio_to_floor"] = r["ms_per_forward"] / floor_ms[str(c)]
        runs.append(r)
        print(f"engine   C={c:3d}: {r['tok_per_s']:8.1f} tok/s  ttfb {r['ttfb_s'] or 0:.3f}s  "
              f"inter-block {r['inter_block_s'] or 0:.3f}s  ratio to floor {r.get('ratio_to_floor', 0):.3f}", flush=True)
    # the same engine under the services' closed-loop arrivals (requests out of phase: other row
    # and head buckets, some of which the lockstep runs above never captured)
    for c in concs:
        before = engine.stats()
        lines = closed_loop(engine, c, args.duration, args.prompt_tokens, args.new_tokens, bound, args.seed + c)
        after = engine.stats()
        r = {"path": "engine-closed-loop", "concurrency": c, "prompt_tokens": args.prompt_tokens,
             "new_tokens": args.new_tokens, "attribution": False, "steering": False, "stride": None,
             "duration_s": args.duration, **summarize_load(lines, c),
             "graph_captures": after.graphs - before.graphs, "recompiles": after.compiles - before.compiles,
             "steps": after.steps - before.steps, "overlapped_steps": after.overlapped_steps - before.overlapped_steps,
             "late_plans": after.late_plans - before.late_plans,
             "late_plan_misses": after.late_plan_misses - before.late_plan_misses,
             "queue_ms_mean": 1e3 * (after.queue_s_sum - before.queue_s_sum) / max(1, after.admitted - before.admitted)}
        runs.append(r)
        print(f"engine closed loop C={c:3d}: {r['tok_per_s']:8.1f} tok/s  ttfb {r['ttfb_s']:.3f}s  "
              f"inter-block {r['inter_block_s'] or 0:.3f}s  requests {r['requests']}  graph captures "
              f"{r['graph_captures']}  overlapped {r['overlapped_steps']}/{r['steps']} steps (planned late "
              f"{r['late_plans']}, missed {r['late_plan_misses']})  queue {r['queue_ms_mean']:.1f} ms", flush=True)
    return runs


def ratios(runs: list[dict]) -> dict:
    """Per concurrency: services / engine tok/s and inter-block latency, the added time to first block."""
    by = {(r["path"], r["concurrency"]): r for r in runs}
    out = {}
    for (path, c), s in by.items():
        e = by.get(("engine", c))
        if path != "services" or e is None:
            continue
        out[str(c)] = {"tok_per_s": s["tok_per_s"] / e["tok_per_s"],
                       "ttfb_added_s": s["ttfb_s"] - e["ttfb_s"],
                       "inter_block": (s["inter_block_s"] / e["inter_block_s"]
                                       if s["inter_block_s"] and e["inter_block_s"] else None)}
        loop = by.get(("engine-closed-loop", c))
        if loop is not None:   # the stack's own cost, the traffic shape being the same
            out[str(c)].update(tok_per_s_vs_closed_loop=s["tok_per_s"] / loop["tok_per_s"],
                               ttfb_added_vs_closed_loop_s=s["ttfb_s"] - loop["ttfb_s"])
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="steerling-8b", help="model sizes (cde.steerling.config presets)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--duration", type=float, default=40.0, help="seconds of load per concurrency")
    ap.add_argument("--stop-timeout", type=float, default=120.0, help="seconds locust lets open streams finish")
    ap.add_argument("--load-processes", type=int, default=0,
                    help="locust processes per run (0: one per 4 users, at most 8)")
    ap.add_argument("--gateway-processes", type=int, default=4,
                    help="gateway processes sharing its port (compose.yaml's GPU host runs 4)")
    ap.add_argument("--trace", action="store_true",
                    help="the services stamp each request's first block (cde.trace): mean ms per hop in the JSON")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0, help="random weights (worker and engine alike)")
    ap.add_argument("--engine-repeats", type=int, default=3)
    ap.add_argument("--kv-pages", type=int, default=0,
                    help="KV pages of the worker and the in-process engine alike (0 = each sizes its own from free memory)")
    ap.add_argument("--startup-timeout", type=float, default=480.0, help="seconds for the stack to get healthy")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--no-engine", action="store_true", help="only the services path")
    ap.add_argument("--no-floor", action="store_true", help="skip the floor (bench.floor) measured first on CUDA")
    ap.add_argument("--devices", default="",
                    help="one worker per GPU index (cde.launch --devices 0,1: data parallel through the scheduler)")
    ap.add_argument("--tensor-parallel", type=int, default=1,
                    help="the worker splits its model over N ranks (worker_svc --tensor-parallel; GPUs cuda:0..N-1)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    cuda = args.device.startswith("cuda")
    cfg = preset(args.preset)
    concs = [int(c) for c in args.concurrency.split(",") if c]
    bound = prompt_token_bound(cfg)
    result = run_record("bench.services", args.preset, "block", cuda, torch.bfloat16 if cuda else torch.float32,
                        tool="locust 2.47.0 (headless), bench/locust_sse.py", endpoint="POST /v1/completions stream=true",
                        compiled=cuda and not args.no_compile, cuda_graphs=cuda, seed=args.seed, aims=AIMS,
                        runs=[], ratios={})
    save = json_writer(args.out, result)
    t0 = time.perf_counter()
    if cuda and not args.no_floor:   # the same run's floor (docs/BENCHMARKS.md), before the stack takes the GPU
        result["floor"] = floor_record(cfg, concs)
        torch.cuda.empty_cache()
        print(f"floor ({time.perf_counter() - t0:.0f} s): {result['floor']['ms_per_forward']}", flush=True)
        save()
    with tempfile.TemporaryDirectory(prefix="cde-bench-services-") as tmp:
        work = Path(tmp)
        model_dir = write_benchmark_model_dir(work / f"{args.preset}-random", cfg, args.seed, tokenizer_file(cfg))
        print(f"benchmark model directory in {time.perf_counter() - t0:.0f} s", flush=True)
        if args.trace:   # the services started below inherit it
            (work / "trace").mkdir()
            os.environ[trace.ENV] = str(work / "trace")
        result["runs"] += services_runs(args, cfg, model_dir, work, concs, bound)
        save()
    if not args.no_engine:
        result["runs"] += engine_runs(args, cfg, concs, bound, (result.get("floor") or {}).get("ms_per_forward"))
        result["ratios"] = ratios(result["runs"])
    result["total_s"] = time.perf_counter() - t0
    save()
    print(json.dumps({"ratios": result["ratios"], "aims": AIMS, "total_s": round(result["total_s"])}, indent=2))


if __name__ == "__main__":
    main()
