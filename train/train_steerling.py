"""Train steerling-small: the Steerling architecture at small size, on the training corpus.

    python -m train.train_steerling --out OUT/steerling-small --time-budget-s 540     # one H200
    python -m train.train_steerling --out /tmp/s --device cpu --tiny                  # smoke test

Time-bounded: the learning-rate schedule runs on the wall clock (warm-up, then cosine to 10 %
over the budget), so a run ends on time on any machine and its last step is the schedule's
end. Progress and losses are logged every few seconds (flushed). The bundle written to --out is
what the serving path loads: config.json, model.safetensors (bf16), tokenizer.json,
concept_labels.parquet, plus training_log.json. `--resume DIR` starts from a bundle's weights
(fresh optimizer, short warm-up): the second of two 10-minute commands.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from cde.steerling.config import SteerlingConfig
from cde.steerling.loading import load_model, save_model
from cde.steerling.model import SteerlingModel
from train import steerling_data
from train.prefetch import Prefetcher
from train.steerling_objective import Batch, LossWeights, flex_attend, noisy_clean_mask, training_loss


@dataclass(frozen=True)
class Shape:
    """Model and batch sizes. SMALL fits the 28 MB bundle in bf16 (~12.6M parameters)."""

    n_layers: int
    n_embd: int
    n_head: int
    n_kv_heads: int
    n_discovered: int
    factorize_rank: int
    topk_known: int
    topk_discovered: int
    seq_len: int
    batch_size: int
    lr: float


SMALL = Shape(n_layers=6, n_embd=320, n_head=5, n_kv_heads=1, n_discovered=2048, factorize_rank=32,
              topk_known=16, topk_discovered=32, seq_len=512, batch_size=64, lr=1.2e-3)
TINY = Shape(n_layers=2, n_embd=64, n_head=2, n_kv_heads=1, n_discovered=64, factorize_rank=8,
             topk_known=4, topk_discovered=8, seq_len=128, batch_size=4, lr=3e-3)


def model_config(shape: Shape, data: steerling_data.SteerlingData) -> SteerlingConfig:
    ids = data.special_ids
    return SteerlingConfig(
        n_layers=shape.n_layers, n_embd=shape.n_embd, n_head=shape.n_head, n_kv_heads=shape.n_kv_heads,
        vocab_size=((data.vocab_size + 63) // 64) * 64, block_size=1024,
        n_known=data.n_known, n_discovered=shape.n_discovered, factorize_rank=shape.factorize_rank,
        topk_known=shape.topk_known, topk_discovered=shape.topk_discovered, concept_chunk=4096,
        eos_id=ids["eos"], pad_id=ids["pad"], bos_id=ids["bos"], endofchunk_id=ids["endofchunk"],
        mask_id=ids["mask"], eot_id=ids["eot"], start_header_id=ids["start_header"],
        end_header_id=ids["end_header"], instruct=True, tokenizer=data.tokenizer_config,
    )


OBJECTIVES = {
    "v1": LossWeights(),
    # v2: the bottleneck carries the logit (known alone and known + discovered read the masked
    # tokens), steering asks for the concept's words somewhere in a block, not at every position
    "v2": LossWeights(steer_words=0.3, concept_lm=0.5, known_lm=0.5, steer_somewhere=True),
    # v3: v2 + the labelled concept ranks first in the served attribution (known_attr)
    "v3": LossWeights(steer_words=0.3, concept_lm=0.5, known_lm=0.5, steer_somewhere=True, known_attr=0.5),
    # v4: v3 with the ranking over the served record (top topk_known by logit) and the label's logit
    # pushed into it (known_attr_k = -1: the model's topk_known, 16 for steerling-small)
    "v4": LossWeights(steer_words=0.3, concept_lm=0.5, known_lm=0.5, steer_somewhere=True, known_attr=0.5,
                      known_attr_k=-1),
}
H200_BF16_PEAK = 989e12     # dense bf16 FLOP/s, for the MFU figure


def train_flops_per_sample(model: SteerlingModel, seq_len: int) -> float:
    """Forward + backward FLOPs of one [x_t | x_0] sample (2T positions): 6 x weights touched
    per position plus attention (QK^T and AV over the allowed half of the keys, x3 for backward)."""
    cfg = model.cfg
    dense = sum(p.numel() for n, p in model.named_parameters() if "tok_emb" not in n)
    dense += cfg.vocab_size * cfg.n_embd                       # the tied LM head, once per masked row (upper bound)
    positions = 2 * seq_len
    attn = 4 * positions * seq_len * cfg.n_embd * cfg.n_layers  # ~T keys per query on average
    return 6.0 * dense * positions + 3.0 * attn


def lr_at(progress: float, peak: float, warmup: float) -> float:
    """Linear warm-up over the first `warmup` share of the budget, then cosine to 10 % of peak."""
    if progress < warmup:
        return peak * max(progress / warmup, 0.01)
    x = min((progress - warmup) / max(1.0 - warmup, 1e-9), 1.0)
    return peak * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * x)))


def param_groups(model: SteerlingModel, weight_decay: float) -> list[dict]:
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (decay if p.ndim >= 2 and "norm" not in name and ".ln_" not in name else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def to_batch(raw: steerling_data.RawBatch, device: torch.device) -> Batch:
    return host_batch(raw, pin=False).to(device)


def host_batch(raw: steerling_data.RawBatch, pin: bool) -> Batch:
    """The batch as host tensors; pinned ones copy to the GPU without blocking the host."""
    def put(a: np.ndarray, dtype) -> torch.Tensor:
        t = torch.from_numpy(a.astype(dtype))
        return t.pin_memory() if pin else t
    return Batch(put(raw.tokens, np.int64), put(raw.chunk_labels, np.float32), put(raw.token_labels, np.int64),
                 put(raw.steer_concept, np.int64))


def log(msg: str) -> None:
    print(msg, flush=True)


def log_profile(profiler, steps: int, cuda: bool) -> None:
    """The profiled steps' top operators, by device time on CUDA (host time on the CPU)."""
    key = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    log(f"profile of {steps} steps, sorted by {key}:")
    log(profiler.key_averages().table(sort_by=key, row_limit=30, max_name_column_width=60))


def train(args: argparse.Namespace) -> Path:
    device = torch.device(args.device)
    shape = TINY if args.tiny else SMALL
    if args.batch_size:
        shape = Shape(**{**asdict(shape), "batch_size": args.batch_size})
    torch.manual_seed(args.seed)
    started = time.monotonic()
    data = steerling_data.open_data(args.data, tiny=args.tiny, seed=args.seed, log=log,
                                    time_budget_s=args.data_budget_s, story_grammar=args.story_grammar)
    log(f"data ready in {time.monotonic() - started:.1f}s: {data.describe()}")
    cfg = model_config(shape, data)
    if args.resume:
        model = load_model(args.resume, dtype=torch.float32, device=device).train()
        if model.cfg != cfg:
            raise SystemExit(f"--resume {args.resume}: its config differs from this run's")
    else:
        model = SteerlingModel(cfg).init_random(args.seed, std=0.02).to(device)
    log(f"model: {model.num_parameters() / 1e6:.2f}M parameters, {cfg.n_known} known / {cfg.n_discovered} "
        f"discovered concepts, device {device}")
    if args.compile:
        from cde.steerling.kernels import compiled
        model.use_kernels(compiled())

    opt = torch.optim.AdamW(param_groups(model, 0.1), lr=shape.lr, betas=(0.9, 0.95), eps=1e-8,
                            fused=device.type == "cuda")
    words, word_mask = data.concept_word_table()
    words, word_mask = torch.from_numpy(words).to(device), torch.from_numpy(word_mask).to(device)
    attention = args.attention or ("flex" if device.type == "cuda" else "sdpa")
    attend_mask = (flex_attend(shape.seq_len, cfg.diff_block_size, device) if attention == "flex"
                   else noisy_clean_mask(shape.seq_len, cfg.diff_block_size, device))
    gen = torch.Generator(device=device).manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    weights = OBJECTIVES[args.objective]
    if args.loss_weight:
        over = {}
        for item in args.loss_weight:
            name, _, value = item.partition("=")
            if name not in asdict(weights) or not value:
                raise SystemExit(f"--loss-weight {item!r}: expected NAME=VALUE with NAME one of {sorted(asdict(weights))}")
            kind = type(asdict(weights)[name])
            over[name] = (value.lower() in ("1", "true")) if kind is bool else kind(value)
        weights = LossWeights(**{**asdict(weights), **over})
    if weights.known_attr_k < 0:   # v4: rank over what the served record holds
        weights = LossWeights(**{**asdict(weights), "known_attr_k": cfg.topk_known})
    budget = args.time_budget_s - (time.monotonic() - started) - args.reserve_s
    if budget <= 0:
        raise SystemExit("no time left to train after loading the data")
    warmup = 0.02 if args.resume else 0.05
    # a schedule over several commands (--total-train-s): this command's share starts where the
    # checkpoint left off; weights, optimizer and the step count resume from --checkpoint
    total_s = args.total_train_s or budget
    done_s, step, tokens_seen, history = 0.0, 0, 0, []
    ckpt = Path(args.checkpoint) if args.checkpoint else None
    if ckpt and (ckpt / "state.pt").exists():
        state = torch.load(ckpt / "state.pt", map_location=device, weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        done_s, step, tokens_seen = float(state["train_seconds"]), int(state["step"]), int(state["tokens"])
        history = json.loads((ckpt / "history.json").read_text())
        warmup = 0.05
        log(f"resumed {ckpt}: step {step}, {tokens_seen / 1e6:.1f}M tokens, {done_s:.0f} of {total_s:.0f} s")
    flops_per_sample = train_flops_per_sample(model, shape.seq_len)
    log(f"objective {args.objective} {asdict(weights)}, attention {attention}, batch {shape.batch_size} x "
        f"{shape.seq_len}, {flops_per_sample / 1e9:.1f} GFLOP per sample")
    pin = device.type == "cuda"
    make = lambda: host_batch(data.batch("train", shape.batch_size, shape.seq_len, rng), pin)  # noqa: E731
    batches = Prefetcher(make, depth=4) if args.prefetch else None
    profiler = None
    data_s = 0.0                 # host seconds spent waiting for batches (inline: making them)
    t0 = time.monotonic()
    stop_at = min(budget, total_s - done_s)
    last_log, last_ckpt, skipped, window = t0, t0, 0, (t0, step)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else torch.autocast(
        "cpu", enabled=False)
    while True:
        elapsed = time.monotonic() - t0
        progress = (done_s + elapsed) / total_s
        if elapsed >= stop_at or progress >= 1.0 or (args.max_steps and step >= args.max_steps):
            break
        lr = lr_at(progress, shape.lr, warmup)
        for group in opt.param_groups:
            group["lr"] = lr
        if args.profile_steps and profiler is None and step == args.profile_after:
            profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]
                                              + ([torch.profiler.ProfilerActivity.CUDA] if pin else []))
            profiler.__enter__()
            profile_end = step + args.profile_steps
        t_data = time.monotonic()
        batch = (batches.next() if batches else make()).to(device, non_blocking=pin)
        data_s += time.monotonic() - t_data
        with autocast:
            out = training_loss(model, batch, gen, weights, words, word_mask, attend_mask)
        opt.zero_grad(set_to_none=True)
        out.total.backward()
        grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
        if not math.isfinite(grad_norm):
            # an inf gradient would turn into NaN weights through the clipping: drop the step
            opt.zero_grad(set_to_none=True)
            skipped += 1
            if skipped > 200:
                raise SystemExit(f"{skipped} steps with non-finite gradients; last losses {out.parts}")
            continue
        opt.step()
        step += 1
        tokens_seen += batch.tokens.numel()
        if profiler is not None and step == profile_end:
            profiler.__exit__(None, None, None)
            log_profile(profiler, args.profile_steps, pin)
            profiler = False
        now = time.monotonic()
        if now - last_log >= args.log_every_s or step == 1:
            last_log = now
            w_t, w_steps = window
            rate = (step - w_steps) * shape.batch_size / max(now - w_t, 1e-9)   # samples/s since the last line
            window = (now, step)
            row = {"skipped": skipped, "step": step, "elapsed_s": round(done_s + now - t0, 1), "lr": lr,
                   "loss": float(out.total.detach()), "grad_norm": grad_norm, "tokens": tokens_seen,
                   "tok_per_s": round(rate * shape.seq_len), "mfu": round(rate * flops_per_sample / H200_BF16_PEAK, 4),
                   "data_share": round(data_s / max(now - t0, 1e-9), 3), **out.parts}
            history.append(row)
            log(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
        if ckpt and args.checkpoint_every_s and now - last_ckpt >= args.checkpoint_every_s:
            last_ckpt = now
            save_checkpoint(ckpt, model, opt, done_s + now - t0, step, tokens_seen, history)
    train_s = time.monotonic() - t0
    if batches:
        batches.close()
    log(f"trained {step} steps, {tokens_seen / 1e6:.1f}M tokens in {train_s:.0f}s this command "
        f"({tokens_seen / max(done_s + train_s, 1e-9) / 1e6:.2f}M tok/s overall, {done_s + train_s:.0f} of {total_s:.0f} s)")
    if ckpt:
        save_checkpoint(ckpt, model, opt, done_s + train_s, step, tokens_seen, history)

    held = evaluate_masked_loss(model, data, shape, weights, words, word_mask, attend_mask, device, args.seed)
    log(f"held-out masked-token loss {held:.4f}")
    out_dir = Path(args.out)
    write_bundle(model, data, out_dir, {
        "steps": step, "tokens": tokens_seen, "train_seconds": round(done_s + train_s, 1), "shape": asdict(shape),
        "objective": args.objective, "loss_weights": asdict(weights), "attention": attention,
        "story_grammar": args.story_grammar,
        "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu", "seed": args.seed,
        "heldout_masked_loss": held, "skipped_steps": skipped, "history": history, "resumed_from": args.resume,
        "command": " ".join(["python -m train.train_steerling"] + sys.argv[1:])})
    log(f"bundle written to {out_dir} ({sum(f.stat().st_size for f in out_dir.iterdir()) / 1e6:.1f} MB) "
        f"in {time.monotonic() - started:.0f}s total")
    return out_dir


@torch.no_grad()
def evaluate_masked_loss(model, data, shape: Shape, weights: LossWeights, words, word_mask, attend_mask,
                         device, seed: int, batches: int = 8) -> float:
    """Mean masked-token CE on held-out text (no steering), same noise law as training."""
    model.eval()
    rng = np.random.default_rng(seed + 1)
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    no_steer = LossWeights(**{**asdict(weights), "steer_share": 0.0})
    total = 0.0
    for _ in range(batches):
        batch = to_batch(data.batch("heldout", shape.batch_size, shape.seq_len, rng), device)
        with (torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda"
              else torch.autocast("cpu", enabled=False)):
            total += training_loss(model, batch, gen, no_steer, words, word_mask, attend_mask).parts["mdm"]
    model.train()
    return total / batches


def save_checkpoint(ckpt: Path, model, opt, train_s: float, step: int, tokens: int, history: list) -> None:
    """Weights (fp32) + optimizer + progress, for the next command (torch.save of tensors only;
    read back with weights_only=True)."""
    ckpt.mkdir(parents=True, exist_ok=True)
    tmp = ckpt / "state.pt.tmp"
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "train_seconds": train_s,
                "step": step, "tokens": tokens}, tmp)
    tmp.replace(ckpt / "state.pt")
    (ckpt / "history.json").write_text(json.dumps(history))


SHARD_BYTES = 14 * 2**20   # each returned file of a GPU command is at most 16 MiB


def write_bundle(model: SteerlingModel, data, out_dir: Path, log_record: dict) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    bf16 = SteerlingModel(model.cfg)
    bf16.load_state_dict({k: v.detach().cpu() for k, v in model.state_dict().items()})
    bf16 = bf16.to(torch.bfloat16)
    save_model(bf16, out_dir, max_shard_bytes=SHARD_BYTES)
    data.write_model_files(out_dir)        # tokenizer.json, concept_labels.parquet
    (out_dir / "training_log.json").write_text(json.dumps(log_record, indent=1) + "\n")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="bundle directory to write")
    ap.add_argument("--data", default=None, help="corpus directory: used when it holds shards, else built there "
                    "(default: a temporary directory)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true", help="tiny sizes and data: a CPU smoke test")
    ap.add_argument("--time-budget-s", type=float, default=540.0, help="wall clock for the whole command")
    ap.add_argument("--data-budget-s", type=float, default=90.0, help="at most this much of it for data")
    ap.add_argument("--story-grammar", type=int, choices=(1, 2), default=1,
                    help="story grammar of a corpus built now (train/stories.py; 2 varies the narration: "
                         "70 %% of sentences distinct over 20,000 stories, grammar 1 36 %%)")
    ap.add_argument("--reserve-s", type=float, default=25.0, help="kept for evaluation and writing")
    ap.add_argument("--max-steps", type=int, default=0, help="stop after this many steps (0: by time)")
    ap.add_argument("--batch-size", type=int, default=0)
    ap.add_argument("--log-every-s", type=float, default=10.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--compile", action="store_true", help="regionally compile the layers' pointwise parts")
    ap.add_argument("--no-prefetch", dest="prefetch", action="store_false",
                    help="make each batch inline instead of on a background thread")
    ap.add_argument("--profile-steps", type=int, default=0, help="log a torch.profiler table of this many steps")
    ap.add_argument("--profile-after", type=int, default=10, help="... starting after this many steps")
    ap.add_argument("--resume", default=None, help="start from this bundle's weights")
    ap.add_argument("--objective", choices=sorted(OBJECTIVES), default="v2")
    ap.add_argument("--loss-weight", action="append", default=[], metavar="NAME=VALUE",
                    help="override one of the objective's LossWeights (repeatable), e.g. steer_words=0.6")
    ap.add_argument("--attention", choices=["sdpa", "flex"], default=None,
                    help="sdpa with a dense mask, or compiled FlexAttention (default on CUDA)")
    ap.add_argument("--checkpoint", default=None, help="directory: resume from its state.pt when present, "
                    "save to it while training and at the end (weights + optimizer)")
    ap.add_argument("--checkpoint-every-s", type=float, default=120.0)
    ap.add_argument("--total-train-s", type=float, default=0.0,
                    help="training seconds over all commands (the LR schedule's length; 0: this command's)")
    args = ap.parse_args(argv)
    if args.device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    train(args)


if __name__ == "__main__":
    main()
