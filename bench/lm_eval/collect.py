"""One bench/results/ JSON from an lm-eval run of cde_story_next (its --output_path directory):
the task's metrics, the commands that served and evaluated, the commit and the data's digest.

    .venv/bin/python -m bench.lm_eval.collect --results-dir /tmp/lme-s --model steerling-small \\
        --serve "python -m cde.launch --model-dir models/steerling-small" --command "<the lm-eval command>"
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DATA = Path(__file__).with_name("story_next.jsonl")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--results-dir", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--serve", required=True, help="the command that served the model")
    ap.add_argument("--command", required=True, help="the lm-eval command")
    ap.add_argument("--commit", default=None, help="the commit the stack ran (default: HEAD)")
    args = ap.parse_args()
    found = sorted(Path(args.results_dir).rglob("results_*.json"))
    if not found:
        raise SystemExit(f"no results_*.json under {args.results_dir}")
    lm = json.loads(found[-1].read_text())
    commit = args.commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                           text=True, check=True).stdout.strip()
    out = {"commit": commit, "gpu": None, "device": "cpu", "task": "cde_story_next", "model": args.model,
           "command": args.command, "served_by": args.serve,
           "items": lm["n-samples"]["cde_story_next"]["effective"], "chance": 0.25,
           "metrics": {k.split(",")[0]: v for k, v in lm["results"]["cde_story_next"].items() if "," in k},
           "lm_eval_version": lm.get("lm_eval_version") or lm.get("config", {}).get("lm_eval_version"),
           "data_sha256": hashlib.sha256(DATA.read_bytes()).hexdigest()}
    path = ROOT / "bench" / "results" / f"lm-eval-story-next-{args.model}-{commit}.json"
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out["metrics"]), "->", path.relative_to(ROOT))


if __name__ == "__main__":
    main()
