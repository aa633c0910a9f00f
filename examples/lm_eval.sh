#!/usr/bin/env bash
# lm-eval (EleutherAI's harness) as a client of a running stack, on the repository's own small task
# (bench/lm_eval/story_next.yaml: a held-out story's next sentence of four; no download).
#   causal model (e.g. models/idlm-small):         CDE_FAMILY=causal bash examples/lm_eval.sh
#   block-diffusion model (e.g. steerling-small):  bash examples/lm_eval.sh
# CDE_BASE_URL (default http://127.0.0.1:8000), CDE_MODEL, CDE_LIMIT (items, default all 100).
set -euo pipefail
cd "$(dirname "$0")/.."
base="${CDE_BASE_URL:-http://127.0.0.1:8000}"
python="${PYTHON:-.venv/bin/python}"
limit=(); [ -n "${CDE_LIMIT:-}" ] && limit=(--limit "$CDE_LIMIT")
export HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1   # the task's data is a local file
if [ "${CDE_FAMILY:-steerling}" = causal ]; then
  "$python" -m lm_eval --model local-completions --include_path bench/lm_eval --tasks cde_story_next "${limit[@]}" \
    --model_args "base_url=$base/v1/completions,model=${CDE_MODEL:-idlm-small},tokenizer_backend=remote"
else
  "$python" -m cde.lm_eval_client --model cde-completions --include_path bench/lm_eval --tasks cde_story_next \
    "${limit[@]}" --model_args "base_url=$base/v1/completions,model=${CDE_MODEL:-steerling-small}"
fi
