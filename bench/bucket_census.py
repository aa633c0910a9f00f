"""Which CUDA-graph buckets a Steerling step uses, under two traffic shapes (CPU is enough: the
buckets are host-side decisions).

    python -m bench.bucket_census --concurrency 8 --steps 400 --out /tmp/census.json

1. Lockstep: C requests submitted together and run to the end (what bench.steerling and the
   services bench's warm-up do).
2. Closed loop: C users whose first requests arrive a few steps apart, each submitting its
   next request the step its last one finishes (what locust's users do through the services),
   for --steps steps.
Prints and writes the distinct CUDA-graph keys of each (`steerling_graphs.graph_keys`: the
trunk's (rows, pages) and the heads and sampler's (rows, tokens per step, head rows)), the
closed-loop keys the lockstep run never used, and those the warm-up's `capture_plan` lacks:
with CUDA graphs each of those would be a capture while serving.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

from cde.steerling.config import TINY
from cde.steerling.model import SteerlingModel
from cde.options import DecodeOptions
from cde.steerling.sampling import SamplingParams
from worker_svc.engine.job import Job
from worker_svc.engine.steerling_engine import FinishEvent, SteerlingEngine
from worker_svc.engine.steerling_graphs import graph_keys


def census(concurrency: int, steps: int, prompt_tokens: int = 128, new_tokens: int = 256, seed: int = 0) -> dict:
    model = SteerlingModel(TINY).init_random(seed).eval()
    engine = SteerlingEngine(model, tokenizer_vocab_size=264, n_pages=16 * concurrency + 64)
    keys: list[tuple] = []
    launched = [0]
    strategy = engine.strategy
    execute = strategy.device_step

    def recording(rb, pb, hb, layout, fwd, smp):
        launched[0] += 1
        keys.extend(graph_keys(rb, pb, layout.tokens_per_step, hb, strategy.capture_rows))
        return execute(rb, pb, hb, layout, fwd, smp)

    strategy.device_step = recording
    rng = random.Random(seed)
    n = 0

    def submit():
        nonlocal n
        n += 1
        return engine.submit(Job(f"r{n}", [rng.randrange(256) for _ in range(prompt_tokens)],
                                 DecodeOptions(new_tokens, SamplingParams(), tokens_per_step=1,
                                               confidence_threshold=None, seed=rng.randrange(1 << 30), stop_ids=())))

    for _ in range(concurrency):
        submit()
    engine.run_until_idle()
    lockstep = set(keys)
    keys.clear()
    launched[0] = 0
    live = {}
    for user in range(concurrency):
        live[user] = submit()
        for _ in range(rng.randrange(1, 6)):
            engine.step()
    for _ in range(steps):
        engine.step()
        for user, handle in list(live.items()):
            if any(isinstance(e, FinishEvent) for e in handle.events):
                live[user] = submit()
    closed = set(keys)
    unseen = sorted(closed - lockstep)
    plan = set(strategy.capture_plan())
    uncaptured = sorted(k for k in closed | lockstep if k[0] != "eager" and k not in plan)
    return {"concurrency": concurrency, "closed_loop_steps": launched[0], "lockstep_keys": sorted(lockstep),
            "closed_loop_keys": sorted(closed), "closed_loop_keys_not_in_lockstep": unseen,
            "closed_loop_graph_replays_on_those_keys": sum(k in set(unseen) for k in keys),
            "capture_rows": strategy.capture_rows, "capture_plan_keys": len(plan),
            "keys_not_in_capture_plan": uncaptured}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", default="8,32")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    results = [census(int(c), args.steps) for c in args.concurrency.split(",") if c]
    for r in results:
        print(f"C={r['concurrency']}: lockstep {len(r['lockstep_keys'])} keys; closed loop {len(r['closed_loop_keys'])} "
              f"keys over {r['closed_loop_steps']} steps, {len(r['closed_loop_keys_not_in_lockstep'])} never used in "
              f"lockstep ({r['closed_loop_graph_replays_on_those_keys']} replays); "
              f"{len(r['keys_not_in_capture_plan'])} not in the warm-up's capture plan "
              f"({r['capture_plan_keys']} keys up to {r['capture_rows']} rows)", flush=True)
    if args.out:
        command = "python -m bench.bucket_census " + " ".join(argv if argv is not None else sys.argv[1:])
        Path(args.out).write_text(json.dumps({"command": command, "device": "cpu", "preset": "tiny", "runs": results},
                                             indent=1))


if __name__ == "__main__":
    main()
