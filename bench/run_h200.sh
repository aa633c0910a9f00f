#!/usr/bin/env bash
# Build-check-bench on a GPU host with an H200, from a checkout: one stage per call, each < 10 minutes.
# What the figures mean and how to report them: docs/BENCHMARKS.md.
#
#   bash bench/run_h200.sh gpu-tests   # the `gpu` tests: engines (eager + graphs), Triton verify
#   bash bench/run_h200.sh steerling   # Steerling-8B sweep C=1..64, on/off, kernel profile at 1 and 32
#   bash bench/run_h200.sh steerling-quick # Steerling-8B at C=1, 32 (on) with kernel profiles: a check between sweeps
#   bash bench/run_h200.sh steerling-fp8 # Steerling-8B with --weights fp8 at C=1, 32, 64 vs the FP8 floor (+ the bf16 floor)
#   bash bench/run_h200.sh isd-fp8     # I-DLM-8B with --weights fp8: ISD N=4 and AR at C=1, 32, 64 vs the FP8 floors (+ the bf16 ones)
#   bash bench/run_h200.sh fp8-faithfulness # FP8 vs bf16 on the same weights: both bundled small models, then both 8B presets (random)
#   bash bench/run_h200.sh long        # Steerling-8B, 64 requests x 1,024 new tokens (pages, peak memory)
#   bash bench/run_h200.sh multi-token # Steerling-8B at C=1, 32: k = 1, 2, 4 tokens per step and thresholds 0.9 / 0.7
#   bash bench/run_h200.sh ablation    # Steerling-8B at C=1, 16 without overlapped steps (what overlap saves)
#   bash bench/run_h200.sh isd         # I-DLM-8B: ISD N=4 and AR at C=1, 32, 64 vs the 7- and 1-query floors (greedy)
#   bash bench/run_h200.sh isd-quick   # I-DLM-8B: ISD N=4 and AR at C=1, 32 (greedy), no profile: a check between sweeps
#   bash bench/run_h200.sh isd-sampled # the same at C=1, 64 with sampled requests (T = 1: draws, verify kernel)
#   bash bench/run_h200.sh isd-ablation # I-DLM-8B at C=1, 32 without overlapped steps (what overlap saves)
#   bash bench/run_h200.sh long-context # both engines at 1K/2K/4K context, C=1, 8 vs the floor there; time to first
#                                       block (1K, 4K prompt) alone and 8 joining 8 running (long-context-steerling / -isd: one each)
#   bash bench/run_h200.sh isd-prefill-rows # I-DLM-8B time to first token alone and joining, 32 vs 64 prompt rows a step
#   bash bench/run_h200.sh isd-ttfb    # I-DLM-8B time to first token (1K, 4K) alone and joining, at the engine's defaults
#   bash bench/run_h200.sh input-attribution # Steerling-8B dims: seconds per attributed token at n_steps 32, alone and beside 16 decoding requests (decode slowdown)
#   bash bench/run_h200.sh services-x2 # nvidia-h200-x2: the stack at C = 32, 64 with one worker, then one worker per GPU (--devices 0,1): aim >= 1.9x
#   bash bench/run_h200.sh services-tp-x2 # nvidia-h200-x2: the stack at C = 32 with one worker of --tensor-parallel 2 (both GPUs) vs one GPU
#   bash bench/run_h200.sh tp-x2       # nvidia-h200-x2: Qwen3-32B dims tensor parallel over 2 GPUs (NCCL, NVLS off), ms per forward vs each GPU's own work
#   bash bench/run_h200.sh prefix-cache # both engines: time to first block/token of C = 1, 32 requests sharing a 2K-token system prompt, prefix cache off vs on
#   bash bench/run_h200.sh train-steerling # train + evaluate steerling-small (one command, < 10 minutes)
#   bash bench/run_h200.sh train-steerling-v2 # steerling-small v2, resumable across commands (TOTAL_TRAIN_S, EVAL=quick|full, RESUME, PROBE=0: no v1 probe)
#   bash bench/run_h200.sh eval-steerling # evaluate the bundle the last train-steerling-v2 of this lease wrote (QUICK=1)
#   bash bench/run_h200.sh train-throughput # steerling-small trainer: tok/s + MFU of today's recipe vs prefetch / compile / batch 256, and a profile
#   bash bench/run_h200.sh train-all       # both bundled models (idlm-small beside steerling-small + its eval)
#   bash bench/run_h200.sh eval-idlm       # idlm-8b ISD bench, then idlm-small's full evaluation with H200 speed
#   bash bench/run_h200.sh kernels-micro # qkv prep (compiled vs Triton) and block attention (splits 1 vs default) at 8B dims
#   bash bench/run_h200.sh anchor      # the public reference (bench/anchor_steerling_ref.py)
#   bash bench/run_h200.sh services    # the whole stack under locust at C=1, 8, 32 ($DURATION s each, 40) beside the engine (wheels: bench/wheels.sh; carry .whl); $SERVICES_ARGS go to bench.services, $TAG ends the file names
#
# `gpu-tests` needs llguidance (structured output): installed, or its wheel in .whl/
# (`pip download llguidance==1.9.1 --no-deps --only-binary=:all: --python-version 3.12 -d .whl`).
# `anchor` needs the public `steerling` 0.2.0 package: installed, or its wheel and pydantic's
# wheels (for the host's CPython) in .whl/ (do not commit them) on a host without a package registry.
# Results go to $OUT (default: a new temporary directory, printed first); commit them under
# bench/results/ with the command that made them. CDE_COMMIT names the commit the results are
# filed under (default: git rev-parse HEAD; set it where the copy has no .git). Merge an anchor
# log into an engine JSON with
#   python -m bench.steerling --merge-reference <log> --out bench/results/<engine>.json
set -euo pipefail
stage="${1:?stage: gpu-tests | steerling | long | ablation | isd | isd-sampled | isd-ablation | anchor}"
OUT="${OUT:-$(mktemp -d "${TMPDIR:-/tmp}/cde-bench-XXXXXX")}"
mkdir -p "$OUT"
echo "results in $OUT"
commit="${CDE_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}"
short="${commit:0:7}"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --ignore-requires-python \
    --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1 || true
fi
export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}" CDE_COMMIT="$commit"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
case "$stage" in
  gpu-tests)
    python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_engine_gpu.py tests/test_structured_output_isd.py tests/test_isd_engine.py tests/test_isd.py tests/test_paged_attention.py tests/test_block_attention.py tests/test_confidence_kernel.py tests/test_fused_swiglu.py tests/test_qkv_prep_kernel.py \
      2>&1 | tee "$OUT/gpu-tests-$short.txt" ;;
  steerling)
    python3 -m bench.steerling --preset steerling-8b --long-run "" --profile 1,32 \
      --out "$OUT/engine-steerling-8b-h200-$short.json" 2>&1 | grep -v Warning | tee "$OUT/engine-steerling-8b-h200-$short.txt" ;;
  kernels-micro)
    python3 -m bench.kernels_micro --out "$OUT/kernels-micro-h200-$short.json" 2>&1 | grep -v Warning | tee "$OUT/kernels-micro-h200-$short.txt" ;;
  steerling-quick)
    # C = 1 and 32 with attribution + steering on, kernel profiles at both: a check between full sweeps
    python3 -m bench.steerling --preset steerling-8b --concurrency 1,32 --off-concurrency "" --long-run "" --profile 1,32 \
      --out "$OUT/engine-steerling-8b-h200-$short-quick.json" 2>&1 | grep -v Warning | tee "$OUT/engine-steerling-8b-h200-$short-quick.txt" ;;
  steerling-fp8)
    # FP8 (e4m3) trunk weights vs the FP8 floor (and the bf16 floor) at C = 1, 32, 64, attribution + steering on
    python3 -m bench.steerling --preset steerling-8b --weights fp8 --concurrency 1,32,64 --off-concurrency "" \
      --long-run "" --out "$OUT/engine-steerling-8b-fp8-h200-$short.json" 2>&1 | grep -v Warning \
      | tee "$OUT/engine-steerling-8b-fp8-h200-$short.txt" ;;
  isd-fp8)
    python3 -m bench.isd --preset idlm-8b --weights fp8 --concurrency 1,32,64 \
      --out "$OUT/engine-isd-8b-fp8-h200-$short.json" 2>&1 | grep -v Warning | tee "$OUT/engine-isd-8b-fp8-h200-$short.txt" ;;
  fp8-faithfulness)
    for src in "--model-dir models/steerling-small" "--model-dir models/idlm-small" \
               "--preset steerling-8b --prompts 4" "--preset idlm-8b --tokenizer-dir models/idlm-small --prompts 4"; do
      name=$(echo "$src" | awk '{print $2}' | sed 's#models/##')
      python3 -m bench.fp8_faithfulness $src --out "$OUT/fp8-faithfulness-$name-h200-$short.json" 2>&1 \
        | grep -v Warning | tee -a "$OUT/fp8-faithfulness-h200-$short.txt"
    done ;;
  input-attribution)
    python3 -m bench.input_attribution --preset steerling-8b --n-steps 32 --targets 8 --load 16 \
      --out "$OUT/input-attribution-8b-h200-$short.json" 2>&1 | grep -v Warning | tee "$OUT/input-attribution-8b-h200-$short.txt" ;;
  services-tp-x2)
    for tp in 1 2; do
      python3 -m bench.services --kv-pages 8192 --concurrency 1,32 --duration "${DURATION:-40}" --no-engine \
        --tensor-parallel $tp --out "$OUT/services-steerling-8b-h200-x2-$short-tp$tp.json" \
        2>&1 | grep -v Warning | tee -a "$OUT/services-steerling-8b-h200-x2-$short-tp.txt"
    done ;;
  services-x2)
    for devices in "" "0,1"; do
      python3 -m bench.services --kv-pages 8192 --concurrency 32,64 --duration "${DURATION:-40}" --no-engine \
        ${devices:+--devices $devices} --out "$OUT/services-steerling-8b-h200-x2-$short-workers${devices:+-$devices}.json" \
        2>&1 | grep -v Warning | tee -a "$OUT/services-steerling-8b-h200-x2-$short.txt"
    done ;;
  tp-x2)
    NCCL_NVLS_ENABLE=0 torchrun --nproc_per_node 2 -m bench.tp_forward --dims 32b --batches 1,8,32 \
      --out "$OUT/tp-forward-32b-h200-x2-$short.json" 2>&1 | grep -v Warning | tee "$OUT/tp-forward-32b-h200-x2-$short.txt" ;;
  long)
    python3 -m bench.steerling --preset steerling-8b --concurrency "" --off-concurrency "" --long-run 64x1024 \
      --out "$OUT/engine-steerling-8b-h200-$short-long.json" 2>&1 | grep -v Warning ;;
  multi-token)
    # speed of multi-token unmasking (random weights: a threshold commits its minimum of one token
    # per step here, so those runs time the threshold path; quality comes from steerling-small's eval)
    python3 -m bench.steerling --preset steerling-8b --concurrency 1,32 --off-concurrency "" --long-run "" \
      --tokens-per-step 1,2,4 --thresholds 0.9,0.7 \
      --out "$OUT/engine-steerling-8b-h200-$short-multi-token.json" 2>&1 | grep -v Warning | tee "$OUT/engine-steerling-8b-h200-$short-multi-token.txt" ;;
  ablation)
    python3 -m bench.steerling --preset steerling-8b --concurrency 1,16 --off-concurrency "" --long-run "" \
      --no-overlap --out "$OUT/engine-steerling-8b-h200-$short-no-overlap.json" 2>&1 | grep -v Warning ;;
  isd)
    python3 -m bench.isd --preset idlm-8b --concurrency 1,32,64 --strides 4,1 --profile 1,64 \
      --out "$OUT/isd-idlm-8b-h200-$short.json" 2>&1 | grep -v Warning | tee "$OUT/isd-idlm-8b-h200-$short.txt" ;;
  isd-quick)
    # ISD N=4 and AR at C = 1 and 32 (greedy), no profile: a check between full sweeps
    python3 -m bench.isd --preset idlm-8b --concurrency 1,32 --strides 4,1 \
      --out "$OUT/isd-idlm-8b-h200-$short-quick.json" 2>&1 | grep -v Warning | tee "$OUT/isd-idlm-8b-h200-$short-quick.txt" ;;
  isd-sampled)
    python3 -m bench.isd --preset idlm-8b --concurrency 1,64 --strides 4,1 --temperature 1.0 --profile 1,64 \
      --out "$OUT/isd-idlm-8b-h200-$short-sampled.json" 2>&1 | grep -v Warning ;;
  isd-ablation)
    python3 -m bench.isd --preset idlm-8b --concurrency 1,32 --strides 4,1 --no-overlap \
      --out "$OUT/isd-idlm-8b-h200-$short-no-overlap.json" 2>&1 | grep -v Warning ;;
  long-context|long-context-steerling|long-context-isd)
    # bench.long_context per engine: ~1-2 min build + compile each, then short runs (128 new tokens)
    if [ "$stage" != long-context-isd ]; then
      python3 -m bench.long_context --engine steerling --preset steerling-8b \
        --out "$OUT/long-context-steerling-8b-h200-$short.json" 2>&1 | grep -v Warning | tee "$OUT/long-context-steerling-8b-h200-$short.txt"
    fi
    if [ "$stage" != long-context-steerling ]; then
      python3 -m bench.long_context --engine isd --preset idlm-8b \
        --out "$OUT/long-context-idlm-8b-h200-$short.json" 2>&1 | grep -v Warning | tee "$OUT/long-context-idlm-8b-h200-$short.txt"
    fi ;;
  isd-prefill-rows)
    # I-DLM-8B time to first token (1K, 4K prompts; 8 joining 8 running) at 32 and 64 prompt rows a step
    for rows in 32 64; do
      python3 -m bench.long_context --engine isd --preset idlm-8b --contexts "" --max-prefill-rows "$rows" \
        --out "$OUT/long-context-idlm-8b-h200-$short-prefill$rows.json" 2>&1 | grep -v Warning \
        | tee "$OUT/long-context-idlm-8b-h200-$short-prefill$rows.txt"
    done ;;
  isd-ttfb)
    # I-DLM-8B time to first token (1K, 4K prompts; 8 joining 8 running) at the engine's defaults, no
    # decode runs; each repeat's steps, rows per step and GC pauses are in the JSON
    python3 -m bench.long_context --engine isd --preset idlm-8b --contexts "" \
      --out "$OUT/long-context-idlm-8b-h200-$short-ttfb.json" 2>&1 | grep -v Warning \
      | tee "$OUT/long-context-idlm-8b-h200-$short-ttfb.txt" ;;
  prefix-cache|prefix-cache-steerling|prefix-cache-isd)
    # bench.prefix_cache per engine (2,048 shared + 64 own prompt tokens, C = 1 and 32, off then on)
    if [ "$stage" != prefix-cache-isd ]; then
      python3 -m bench.prefix_cache --engine steerling --preset steerling-8b \
        --out "$OUT/prefix-cache-steerling-8b-h200-$short.json" 2>&1 | grep -v Warning | tee "$OUT/prefix-cache-steerling-8b-h200-$short.txt"
    fi
    if [ "$stage" != prefix-cache-steerling ]; then
      python3 -m bench.prefix_cache --engine isd --preset idlm-8b \
        --out "$OUT/prefix-cache-idlm-8b-h200-$short.json" 2>&1 | grep -v Warning | tee "$OUT/prefix-cache-idlm-8b-h200-$short.txt"
    fi ;;
  train-steerling)
    # steerling-small: corpus (stories generated here + the committed prose), training, held-out
    # evaluation, in one command of < 10 minutes. Returns the sharded bf16 weights, config,
    # training log and the eval JSON (tokenizer.json / concept_labels.parquet come from train/artifacts).
    data=/tmp/steerling-data
    python3 -u -m train.train_steerling --out "$OUT/steerling-small" --data "$data" \
      --time-budget-s "${TRAIN_BUDGET_S:-420}" --data-budget-s 60 2>&1 | grep -v Warning > "$OUT/train-steerling-small-$short.log"
    python3 -u -m train.eval_steerling --model-dir "$OUT/steerling-small" --data "$data" \
      --out "$OUT/eval-steerling-small-h200-$short.json" 2>&1 | grep -v Warning | tee -a "$OUT/train-steerling-small-$short.log" || true
    rm -f "$OUT/steerling-small/tokenizer.json" "$OUT/steerling-small/concept_labels.parquet" ;;
  train-steerling-v2)
    # steerling-small v2 over several commands in one lease, TOTAL_TRAIN_S seconds of training in
    # all (the LR schedule's length). The first command builds the corpus and times today's recipe
    # (objective v1, SDPA, batch 64) for 40 steps: the same-run throughput baseline. Every command
    # resumes /tmp/steerling-ckpt (weights + optimizer) while the machine is still warm, else the
    # bundle named by RESUME (weights only). EVAL=quick|full evaluates the bundle it returns;
    # LOSS_WEIGHTS="--loss-weight steer_words=0.6 ..." overrides the objective's weights.
    # STORY_GRAMMAR=2: the corpus's stories vary their narration (train/stories.py); its own data dir
    grammar="${STORY_GRAMMAR:-1}"; data=/tmp/steerling-data; [ "$grammar" = 1 ] || data="/tmp/steerling-data-g$grammar"
    ckpt=/tmp/steerling-ckpt
    if [ ! -e "$ckpt/state.pt" ] && [ -z "${RESUME:-}" ] && [ "${PROBE:-1}" = 1 ]; then
      python3 -u -m train.train_steerling --out /tmp/probe-v1 --data "$data" --objective v1 --attention sdpa \
        --batch-size 64 --max-steps 40 --log-every-s 2 --time-budget-s 300 --data-budget-s 60 --story-grammar "$grammar" 2>&1 \
        | grep -v Warning > "$OUT/probe-v1-$short.log" || true
    fi
    python3 -u -m train.train_steerling --out "$OUT/steerling-small" --data "$data" --checkpoint "$ckpt" \
      --total-train-s "${TOTAL_TRAIN_S:-900}" --batch-size "${BATCH:-128}" --time-budget-s "${TRAIN_BUDGET_S:-400}" \
      --data-budget-s 60 --story-grammar "$grammar" --objective "${OBJECTIVE:-v2}" ${COMPILE:+--compile} ${RESUME:+--resume "$RESUME"} ${LOSS_WEIGHTS:-} 2>&1 | grep -v Warning \
      > "$OUT/train-steerling-small-$short.log" || true
    tail -n 4 "$OUT/train-steerling-small-$short.log"
    rm -rf /tmp/steerling-bundle-last && cp -r "$OUT/steerling-small" /tmp/steerling-bundle-last   # for eval-steerling
    echo "$data" > /tmp/steerling-data-last
    case "${EVAL:-}" in
      quick) eval_args="--prompts 24 --concepts 6 --detect-batches 4" ;;
      full) eval_args="" ;;
      *) eval_args=skip ;;
    esac
    if [ "$eval_args" != skip ]; then
      python3 -u -m train.eval_steerling --model-dir "$OUT/steerling-small" --data "$data" $eval_args \
        --out "$OUT/eval-steerling-small-h200-$short.json" 2>&1 | grep -v Warning >> "$OUT/train-steerling-small-$short.log" || true
      grep -E "meaning|logit mass|clean steering|detection|lift:" "$OUT/train-steerling-small-$short.log" | cut -c1-600
    fi
    rm -f "$OUT/steerling-small/tokenizer.json" "$OUT/steerling-small/concept_labels.parquet" ;;
  eval-steerling)
    # evaluate the bundle the last train-steerling-v2 command of this lease wrote (MODEL_DIR= another)
    python3 -u -m train.eval_steerling --model-dir "${MODEL_DIR:-/tmp/steerling-bundle-last}" \
      --data "$(cat /tmp/steerling-data-last 2>/dev/null || echo /tmp/steerling-data)" \
      ${QUICK:+--prompts 24 --concepts 6 --detect-batches 4} --out "$OUT/eval-steerling-small-h200-$short.json" 2>&1 \
      | grep -v Warning > "$OUT/eval-steerling-small-$short.log" || true
    grep -E "meaning|logit mass|clean steering|detection|lift:" "$OUT/eval-steerling-small-$short.log" | cut -c1-600 ;;
  train-throughput)
    # 30 steps of each variant on one corpus (built once): the v1 recipe (SDPA, batch 64: the
    # issue's baseline), v2 at batch 128 inline, + the prefetch thread, + --compile, at batch 256;
    # then a torch.profiler table of 5 steps of the last. The tok/s of the last log line is the figure.
    data=/tmp/steerling-data
    run() { name=$1; shift
      python3 -u -m train.train_steerling --out "/tmp/tp-$name" --data "$data" --max-steps 30 --log-every-s 1 \
        --time-budget-s 400 --data-budget-s 60 --reserve-s 5 "$@" 2>&1 | grep -v Warning > "$OUT/train-throughput-$name-$short.log" || true
      echo "$name: $(grep -E '^skipped=' "$OUT/train-throughput-$name-$short.log" | tail -n 1 | grep -oE '(step|tok_per_s|mfu|data_share)=[0-9.e+-]+' | tr '\n' ' ')"
    }
    run v1-b64 --objective v1 --attention sdpa --batch-size 64 --no-prefetch
    run v2-b128-inline --objective v2 --batch-size 128 --no-prefetch
    run v2-b128 --objective v2 --batch-size 128
    run v2-b128-compile --objective v2 --batch-size 128 --compile
    run v3-b256-compile --objective v3 --batch-size 256 --compile --profile-steps 5 --profile-after 20
    sed -n '/^profile of/,/^Self CUDA time total/p' "$OUT/train-throughput-v3-b256-compile-$short.log" | cut -c1-200 ;;
  train-all)
    # Both bundled models in one command of < 10 minutes on one GPU: idlm-small in the background
    # (train.train_idlm, its own time budget) beside steerling-small's training + evaluation (the two
    # small models leave the GPU mostly idle alone). The bundles come back as one tar split into
    # 15 MiB parts (at most 8 files of 16 MiB return): cat $OUT/bundles.tar.part-* | tar x
    data=/tmp/steerling-data
    python3 -u -m train.train_idlm --out "$OUT/idlm-small" --time-budget-s "${IDLM_BUDGET_S:-520}" \
      > "$OUT/train-idlm-small-$short.log" 2>&1 &
    idlm=$!
    python3 -u -m train.train_steerling --out "$OUT/steerling-small" --data "$data" \
      --time-budget-s "${TRAIN_BUDGET_S:-400}" --data-budget-s 45 2>&1 | grep -v Warning > "$OUT/train-steerling-small-$short.log" || true
    python3 -u -m train.eval_steerling --model-dir "$OUT/steerling-small" --data "$data" \
      --out "$OUT/eval-steerling-small-h200-$short.json" 2>&1 | grep -v Warning >> "$OUT/train-steerling-small-$short.log" || true
    wait "$idlm" || echo "train_idlm exited with $?" >> "$OUT/train-idlm-small-$short.log"
    rm -f "$OUT/steerling-small/tokenizer.json" "$OUT/steerling-small/concept_labels.parquet"
    (cd "$OUT" && tar cf - steerling-small idlm-small | split -b 15M - bundles.tar.part- && rm -rf steerling-small idlm-small)
    tail -n 5 "$OUT/train-steerling-small-$short.log" "$OUT/train-idlm-small-$short.log"; ls -la "$OUT" ;;
  eval-idlm)
    # idlm-small's evaluation on the GPU (losses, alpha, TPF tables, greedy equality, R-ISD
    # distribution test, tok/s at C = 1, 32, 64) with its 8B projection taken from the idlm-8b
    # bench of this same run.
    python3 -m bench.isd --preset idlm-8b --concurrency 1,32,64 --strides 4,1 \
      --out "$OUT/isd-idlm-8b-h200-$short.json" 2>&1 | grep -v Warning > "$OUT/isd-idlm-8b-h200-$short.txt"
    python3 -u -m train.eval_idlm --model-dir models/idlm-small --device cuda --speed --seed "${EVAL_SEED:-4242}" \
      --bench-8b "$OUT/isd-idlm-8b-h200-$short.json" --out "$OUT/eval-idlm-small-h200-$short.json" \
      --card-out "$OUT/README.md" 2>&1 | grep -v Warning | tee "$OUT/eval-idlm-small-h200-$short.log" ;;
  services)
    # Redis, steering, attribution, scheduler, one worker (random 8B-dims weights, bf16, compiled, CUDA
    # graphs), gateway; locust streams POST /v1/completions at C = 1, 8, 32, then the in-process engine
    # 8,192 KV pages for worker and engine alike (the load needs ~200): sized from free memory the
    # worker's pool left too little for its CUDA-graph warm-up at dd20102 (OOM at start-up)
    python3 -m bench.services --kv-pages 8192 --duration "${DURATION:-40}" ${SERVICES_ARGS:-} \
      --out "$OUT/services-steerling-8b-h200-$short${TAG:+-$TAG}.json" 2>&1 | grep -v Warning \
      | tee "$OUT/services-steerling-8b-h200-$short${TAG:+-$TAG}.txt" ;;
  anchor)
    python3 bench/anchor_steerling_ref.py 2>&1 | tee "$OUT/anchor-steerling-ref-h200-$short.txt" ;;
  *) echo "unknown stage $stage" >&2; exit 2 ;;
esac
