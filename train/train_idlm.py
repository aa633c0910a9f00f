"""Train idlm-small in one command: AR base -> I-DLM conversion (LoRA) -> R-ISD adapter -> bundle.

    python -m train.train_idlm --out $OUT/idlm-small --time-budget-s 540          # one H200
    python -m train.train_idlm --device cpu --tiny --out /tmp/idlm-tiny-run        # CPU smoke (~1-2 min)

Phases share the time left after the data is ready (``--shares``, default 55/30/15 %); each
phase runs until its time is spent (learning rates follow the phase's elapsed fraction, so
the schedule fits whatever throughput the machine has), then the next starts:

1. **AR base**: a Qwen3-layout causal LM (``cde.qwen3``), next-token loss on packed windows.
2. **Conversion** (I-DLM recipe, ``train/idlm_objective.py``): [x_t | x_0] with x_t all
   [MASK], causal inside each noisy block and to earlier clean positions, logit shift,
   L = L_mask + s * L_clean with s = L_mask / L_clean detached, stride curriculum N = 2, 3, 4.
   Trained as an *ungated LoRA* on the frozen base: the bundle holds the base once plus
   two small adapters, so the base can be about twice as large within the 20 MB bundle
   limit than with a full fine-tune (which would need a second full copy of the weights for
   R-ISD). At load the adapter is merged (``cde_merge_adapters`` in config.json), so the
   served model is an ordinary dense checkpoint.
3. **R-ISD adapter**: a LoRA gated to [MASK] positions on the same frozen base (initialized
   from the conversion adapter, truncated to its rank), trained on L_mask only: clean and
   verify positions keep the base weights, so lossless ISD follows the base AR model.

The bundle (``--out``; at most 8 files, so it comes back from the GPU machine in one piece):
``config.json`` (SDAR, mask id, ``cde_merge_adapters: ["conversion"]``), ``model.safetensors``
(the base, bf16), ``tokenizer.json``, ``conversion/`` and ``risd/`` (PEFT adapters, bf16),
``training.json`` (sizes, losses, timings). ``python -m train.eval_idlm`` measures the rest
and writes the model card ``README.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from cde.qwen3.config import Qwen3Config
from cde.qwen3.lora import detach_lora, read_adapter
from cde.qwen3.loading import load_qwen3, save_qwen3
from cde.qwen3.model import PROJECTIONS, Qwen3Model
from train.idlm_data import ENDOFTEXT, IM_END, MASK, Corpus, load_corpus
from train.idlm_lora import TrainableLora, adapter_bytes
from train.idlm_objective import causal_lm_loss, consistency_batch, consistency_loss

BUNDLE_LIMIT_BYTES = 20_000_000
FILE_LIMIT_BYTES = 16 * 1024 * 1024     # what one file from the GPU machine may be
CONVERSION_DIR, RISD_DIR = "conversion", "risd"


@dataclass(frozen=True)
class Recipe:
    """Sizes and optimizer settings of one run."""

    hidden: int = 256
    layers: int = 8
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    intermediate: int = 640
    seq_len: int = 256
    batch: int = 128
    conv_batch: int = 64
    base_lr: float = 2e-3
    lora_lr: float = 2e-3
    conv_rank: int = 32
    risd_rank: int = 16
    max_stride: int = 4
    curriculum: tuple[float, ...] = (0.2, 0.2, 0.6)   # time shares of strides 2, 3, 4
    log_every_s: float = 10.0


SMALL = Recipe()
TINY = Recipe(hidden=64, layers=2, heads=2, kv_heads=1, head_dim=32, intermediate=128, seq_len=64, batch=16,
              conv_batch=8, base_lr=3e-3, lora_lr=3e-3, conv_rank=8, risd_rank=4, log_every_s=5.0)


@dataclass
class PhaseLog:
    name: str
    budget_s: float
    seconds: float = 0.0
    steps: int = 0
    tokens: int = 0
    losses: list[dict] = field(default_factory=list)   # periodic {t, step, loss, ...}


def log(msg: str) -> None:
    print(msg, flush=True)


def model_config(recipe: Recipe, corpus: Corpus) -> Qwen3Config:
    vocab = -(-corpus.vocab_size // 64) * 64   # padded embedding table; ids past the tokenizer are never targets
    return Qwen3Config(n_layers=recipe.layers, hidden=recipe.hidden, n_heads=recipe.heads, n_kv_heads=recipe.kv_heads,
                       head_dim=recipe.head_dim, intermediate=recipe.intermediate, vocab_size=vocab,
                       rope_theta=10_000.0, max_positions=2048, tie_word_embeddings=True,
                       mask_token_id=corpus.special_ids[MASK], bos_token_id=corpus.special_ids[ENDOFTEXT],
                       eos_token_ids=corpus.eos_ids)


def bundle_estimate(model: Qwen3Model, recipe: Recipe, tokenizer_file: Path) -> dict[str, int]:
    weights = sum(p.numel() for p in model.parameters()) * 2
    conv = adapter_bytes(model, recipe.conv_rank)
    risd = adapter_bytes(model, recipe.risd_rank)
    total = weights + conv + risd + tokenizer_file.stat().st_size + 20_000
    return {"weights": weights, "conversion": conv, "risd": risd, "total": total}


class Windows:
    """Random training windows from a token stream kept on the device."""

    def __init__(self, tokens: np.ndarray, length: int, device: torch.device, seed: int):
        self.stream = torch.from_numpy(tokens.astype(np.int64)).to(device)
        self.length = length
        self.gen = torch.Generator(device="cpu").manual_seed(seed)
        if len(tokens) <= length + 1:
            raise ValueError(f"corpus of {len(tokens)} tokens is shorter than one window of {length + 1}")

    def batch(self, b: int) -> torch.Tensor:
        starts = torch.randint(0, len(self.stream) - self.length - 1, (b,), generator=self.gen)
        idx = starts.to(self.stream.device)[:, None] + torch.arange(self.length + 1, device=self.stream.device)
        return self.stream[idx]


def lr_at(frac: float, peak: float, warmup: float = 0.03, floor: float = 0.1) -> float:
    """Linear warm-up, then cosine to floor * peak, over the phase's elapsed-time fraction."""
    if frac < warmup:
        return peak * max(frac / warmup, 0.02)
    x = min((frac - warmup) / (1 - warmup), 1.0)
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * x)))


def run_phase(name: str, budget_s: float, params: list[torch.nn.Parameter], peak_lr: float,
              step_fn: Callable[[float], tuple[torch.Tensor, dict, int]], log_every_s: float,
              weight_decay: float = 0.0, max_steps: int | None = None) -> PhaseLog:
    """Optimize until ``budget_s`` seconds have passed. step_fn(frac) -> (loss, metrics, tokens).
    Weight decay applies to matrices only (not norms)."""
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW([g for g in groups if g["params"]], lr=peak_lr, betas=(0.9, 0.95), eps=1e-8)
    plog = PhaseLog(name, budget_s)
    start = last = time.monotonic()
    tokens_at_last = 0
    log(f"[{name}] budget {budget_s:.0f} s, {sum(p.numel() for p in params):,} trainable parameters")
    step_s = 0.0   # the last step's duration: stop when the next one would overrun the budget
    while True:
        t_step = time.monotonic()
        elapsed = t_step - start
        if elapsed + step_s >= budget_s or (max_steps is not None and plog.steps >= max_steps):
            break
        frac = elapsed / budget_s
        for g in opt.param_groups:
            g["lr"] = lr_at(frac, peak_lr)
        loss, metrics, n_tok = step_fn(frac)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        loss = loss.detach()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        plog.steps += 1
        plog.tokens += n_tok
        now = time.monotonic()
        step_s = now - t_step if plog.steps > 2 else 0.0   # the first steps include warm-up
        if now - last >= log_every_s or plog.steps == 1:
            rate = (plog.tokens - tokens_at_last) / max(now - last, 1e-9)
            entry = {"t": round(now - start, 1), "step": plog.steps, "loss": round(float(loss), 4),
                     "lr": opt.param_groups[0]["lr"], **{k: round(float(v), 4) for k, v in metrics.items()}}
            plog.losses.append(entry)
            extra = " ".join(f"{k} {float(v):.4f}" for k, v in metrics.items())
            log(f"[{name}] {now - start:6.1f}s step {plog.steps:6d} loss {float(loss):.4f} {extra} "
                f"lr {entry['lr']:.2e} {rate / 1e3:8.1f}k tok/s")
            last, tokens_at_last = now, plog.tokens
    plog.seconds = time.monotonic() - start
    log(f"[{name}] done: {plog.steps} steps, {plog.tokens / 1e6:.1f}M tokens in {plog.seconds:.0f} s")
    return plog


def autocast(device: torch.device):
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def stride_at(frac: float, recipe: Recipe) -> int:
    """The curriculum: stride 2 first, then 3, ... up to max_stride."""
    strides = list(range(2, recipe.max_stride + 1))
    shares = list(recipe.curriculum)[:len(strides)]
    if len(strides) > len(shares):   # the last share is split evenly over the strides past the list
        rest = len(strides) - len(shares) + 1
        shares = shares[:-1] + [shares[-1] / rest] * rest
    acc = 0.0
    for s, share in zip(strides, shares):
        acc += share / sum(shares)
        if frac < acc:
            return s
    return strides[-1]


@torch.no_grad()
def heldout_losses(model: Qwen3Model, heldout: np.ndarray, recipe: Recipe, device: torch.device, *,
                   stride: int, lora_gated: bool, n_windows: int = 64) -> dict[str, float]:
    """Held-out AR loss (plain causal forward), and L_mask / L_clean of the consistency layout."""
    length = min(recipe.seq_len, len(heldout) // 2 - 1)
    starts = np.linspace(0, len(heldout) - length - 2, n_windows).astype(np.int64)
    rows = torch.from_numpy(np.stack([heldout[s:s + length + 1].astype(np.int64) for s in starts])).to(device)
    model.eval()
    ar, lm, lc = [], [], []
    for chunk in rows.split(16):
        with autocast(device):
            ar.append(float(causal_lm_loss(model, chunk)))
            losses = consistency_loss(model, consistency_batch(chunk[:, :-1], stride - 1, model.cfg.mask_token_id),
                                      lora_gated=lora_gated)
        lm.append(float(losses.mask))
        lc.append(float(losses.clean))
    model.train()
    return {"ar_loss": float(np.mean(ar)), "mask_loss": float(np.mean(lm)), "clean_loss": float(np.mean(lc))}


def truncated(adapter_modules: dict, rank: int) -> dict:
    """Each module's delta B A cut to ``rank`` by SVD (factors with the scaling folded in)."""
    out = {}
    for name, (a, b, scaling) in adapter_modules.items():
        u, s, vh = torch.linalg.svd(b.float() @ a.float() * scaling, full_matrices=False)
        root = s[:rank].sqrt()
        out[name] = ((root[:, None] * vh[:rank]), (u[:, :rank] * root[None, :]), 1.0)
    return out


def write_base(out: Path, base: Qwen3Model, corpus: Corpus, training: dict) -> list[Path]:
    """The directory (replaced if present) with the AR base alone: config.json, bf16
    model.safetensors, tokenizer.json, training.json. Written right after phase 1 too, so a
    failure later still returns a base that ``--base-from`` resumes from."""
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    bf16 = Qwen3Model(base.cfg)
    bf16.load_state_dict({k: v.detach().cpu() for k, v in base.state_dict().items()})
    files = [out / "config.json", *save_qwen3(bf16.to(torch.bfloat16), out)]
    shutil.copyfile(corpus.tokenizer_file, out / "tokenizer.json")
    (out / "training.json").write_text(json.dumps(training, indent=2) + "\n")
    return files + [out / "tokenizer.json", out / "training.json"]


def write_bundle(out: Path, base: Qwen3Model, corpus: Corpus, conv: TrainableLora, risd: TrainableLora,
                 training: dict) -> list[Path]:
    """The bundle directory (replaced if present): at most 8 files, bf16 weights."""
    detach_lora(base)
    files = write_base(out, base, corpus, training)
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["cde_merge_adapters"] = [CONVERSION_DIR]
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")
    return files + [*conv.save(out / CONVERSION_DIR), *risd.save(out / RISD_DIR)]


def train(args: argparse.Namespace) -> dict:
    t_start = time.monotonic()
    recipe = TINY if args.tiny else SMALL
    overrides = {k: getattr(args, k) for k in ("conv_rank", "risd_rank", "base_lr", "lora_lr", "max_stride")
                 if getattr(args, k) is not None}
    recipe = dataclasses.replace(recipe, **overrides)
    device = torch.device(args.device)
    if device.type == "cpu" and args.threads > 0:
        torch.set_num_threads(args.threads)   # a shared small CPU: more threads spin and stall
    torch.manual_seed(args.seed)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    out = Path(args.out)
    # scratch (the corpus tokenizer) outside --out: $OUT returns at most 8 files, the bundle's
    work = Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="idlm-data-"))
    work.mkdir(parents=True, exist_ok=True)

    corpus = load_corpus(args.data, work, tiny=args.tiny, seed=args.seed, docs=args.corpus_docs)
    t_data = time.monotonic() - t_start
    log(f"[data] {corpus.source}: {len(corpus.train) / 1e6:.1f}M train tokens, {len(corpus.heldout) / 1e3:.0f}K "
        f"held out, vocab {corpus.vocab_size}, {len(corpus.prompts)} prompts, {t_data:.1f} s")

    cfg = model_config(recipe, corpus)
    if args.base_from:
        base = load_qwen3(args.base_from, merge_adapters=False)
        theirs = json.loads((Path(args.base_from) / "tokenizer.json").read_text())
        if theirs != json.loads(corpus.tokenizer_file.read_text()) or base.cfg != cfg:
            raise SystemExit(f"--base-from {args.base_from}: its tokenizer or config differs from this run's")
        model = base.float().to(device)
    else:
        model = Qwen3Model(cfg).init_random(args.seed, std=0.02).to(device)
    est = bundle_estimate(model, recipe, corpus.tokenizer_file)
    log(f"[model] {model.num_parameters():,} parameters; bundle estimate {est['total'] / 1e6:.2f} MB "
        f"(weights {est['weights'] / 1e6:.2f}, conversion {est['conversion'] / 1e6:.2f}, R-ISD {est['risd'] / 1e6:.2f})")
    if est["total"] > BUNDLE_LIMIT_BYTES or est["weights"] > FILE_LIMIT_BYTES:
        raise SystemExit(f"bundle would be {est['total']} bytes (limit {BUNDLE_LIMIT_BYTES}), weights "
                         f"{est['weights']} (limit {FILE_LIMIT_BYTES}): choose smaller sizes")

    reserve = 10.0 if args.tiny else 25.0    # held-out losses and writing the bundle
    left = max(args.time_budget_s - (time.monotonic() - t_start) - reserve, 3.0)
    shares = [float(x) for x in args.shares.split(",")]
    if len(shares) != 3 or min(shares) < 0 or sum(shares) <= 0:
        raise SystemExit("--shares needs three non-negative numbers (base, conversion, adapter)")
    if args.base_from:
        shares[0] = 0.0
    budgets = [left * s / sum(shares) for s in shares]
    train_w = Windows(corpus.train, recipe.seq_len, device, args.seed)
    mask_id = cfg.mask_token_id
    phases: list[PhaseLog] = []
    model.train()

    # 1. AR base
    if budgets[0] > 0:
        # --compile: the AR phase's loss through torch.compile (its compile time counts in the
        # budget); the LoRA phases stay eager (their factors are re-bound every step)
        base_loss = torch.compile(causal_lm_loss) if args.compile else causal_lm_loss

        def base_step(_frac: float):
            rows = train_w.batch(recipe.batch)
            with autocast(device):
                loss = base_loss(model, rows)
            return loss, {}, rows.numel()

        phases.append(run_phase("base", budgets[0], list(model.parameters()), recipe.base_lr, base_step,
                                recipe.log_every_s, weight_decay=0.1, max_steps=args.max_steps))
    for p in model.parameters():
        p.requires_grad_(False)
    n_win = 8 if args.tiny else 64
    base_eval = heldout_losses(model, corpus.heldout, recipe, device, stride=recipe.max_stride, lora_gated=False,
                               n_windows=n_win)
    log(f"[eval] base: held-out AR loss {base_eval['ar_loss']:.4f}; untrained masks {base_eval['mask_loss']:.4f}")
    if not args.base_from:   # checkpoint: the base alone, replaced by the full bundle at the end
        write_base(out, model, corpus, {"partial": "AR base only (conversion and R-ISD not finished)",
                                        "phases": [asdict(p) for p in phases], "heldout": {"base": base_eval}})
        log(f"[checkpoint] AR base written to {out} (resume with --base-from)")

    # 2. conversion: ungated LoRA, L_mask + s * L_clean, stride curriculum
    conv = TrainableLora(model, recipe.conv_rank, 2.0 * recipe.conv_rank, PROJECTIONS, seed=args.seed + 1)

    def conv_step(frac: float):
        stride = stride_at(frac, recipe)
        x0 = train_w.batch(recipe.conv_batch)[:, :-1]
        conv.bind(model)
        with autocast(device):
            losses = consistency_loss(model, consistency_batch(x0, stride - 1, mask_id), lora_gated=False)
        return losses.total, {"mask": losses.mask, "clean": losses.clean, "N": stride}, x0.numel() * 2

    phases.append(run_phase("conversion", budgets[1], list(conv.parameters()), recipe.lora_lr, conv_step,
                            recipe.log_every_s, max_steps=args.max_steps))
    conv.bind(model)
    conv_eval = heldout_losses(model, corpus.heldout, recipe, device, stride=recipe.max_stride, lora_gated=False,
                               n_windows=n_win)
    log(f"[eval] converted: AR loss {conv_eval['ar_loss']:.4f} (base {base_eval['ar_loss']:.4f}), "
        f"mask loss {conv_eval['mask_loss']:.4f} at N={recipe.max_stride}")

    # 3. R-ISD: LoRA gated to the masks, from the conversion adapter truncated to its rank
    risd = TrainableLora(model, recipe.risd_rank, 2.0 * recipe.risd_rank, PROJECTIONS, seed=args.seed + 2)
    risd.load_modules(truncated(conv.modules(), recipe.risd_rank))

    def risd_step(frac: float):
        stride = stride_at(max(frac, 0.999), recipe)   # the final stride throughout
        x0 = train_w.batch(recipe.conv_batch)[:, :-1]
        risd.bind(model)
        with autocast(device):
            losses = consistency_loss(model, consistency_batch(x0, stride - 1, mask_id), lora_gated=True)
        return losses.total, {"mask": losses.mask, "N": stride}, x0.numel() * 2

    phases.append(run_phase("risd", budgets[2], list(risd.parameters()), recipe.lora_lr, risd_step,
                            recipe.log_every_s, max_steps=args.max_steps))
    risd.bind(model)
    risd_eval = heldout_losses(model, corpus.heldout, recipe, device, stride=recipe.max_stride, lora_gated=True,
                               n_windows=n_win)
    log(f"[eval] R-ISD: mask loss {risd_eval['mask_loss']:.4f}, clean loss {risd_eval['clean_loss']:.4f} "
        f"(= base {base_eval['ar_loss']:.4f} up to the window edge)")

    training = {
        "recipe": asdict(recipe), "source": corpus.source, "seed": args.seed, "device": str(device),
        "torch": torch.__version__, "time_budget_s": args.time_budget_s,
        "data": {"train_tokens": int(len(corpus.train)), "heldout_tokens": int(len(corpus.heldout)),
                 "vocab": corpus.vocab_size, "seconds": round(t_data, 1)},
        "parameters": model.num_parameters(), "bundle_estimate_bytes": est,
        "phases": [asdict(p) for p in phases],
        "heldout": {"base": base_eval, "converted": conv_eval, "risd": risd_eval, "stride": recipe.max_stride},
        "prompts": corpus.prompts, "prompt_texts": corpus.prompt_texts,
        # held-out tokens for train.eval_idlm (documents the training never saw)
        "heldout_sample": corpus.heldout[:4096 if args.tiny else 32768].tolist(),
        "base_from": str(args.base_from) if args.base_from else None,
    }
    files = write_bundle(out, model, corpus, conv, risd, training)
    total = sum(f.stat().st_size for f in files)
    training["seconds_total"] = round(time.monotonic() - t_start, 1)
    (out / "training.json").write_text(json.dumps(training, indent=2) + "\n")
    log(f"[bundle] {out}: {len(files)} files, {total / 1e6:.2f} MB, total {training['seconds_total']} s")
    for f in files:
        log(f"  {f.relative_to(out)}  {f.stat().st_size:,}")
    return training


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="bundle directory to write (replaced)")
    ap.add_argument("--time-budget-s", type=float, default=540.0, help="wall-clock budget for everything")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true", help="tiny sizes and corpus (CPU smoke run)")
    ap.add_argument("--data", default="standin", choices=("standin",),
                    help="corpus source (train/idlm_data.py): generated stories + chat pairs")
    ap.add_argument("--shares", default="0.55,0.30,0.15", help="time shares: base, conversion, R-ISD adapter")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--work-dir", default="", help="corpus/tokenizer scratch (default: a temporary directory)")
    ap.add_argument("--base-from", default="", help="reuse a bundle's AR base (skip phase 1; resume)")
    ap.add_argument("--corpus-docs", type=int, default=None, help="stand-in training documents (default 400K; "
                    "tiny 3K)")
    ap.add_argument("--conv-rank", type=int, default=None, help="conversion LoRA rank (default 32; tiny 8)")
    ap.add_argument("--risd-rank", type=int, default=None, help="R-ISD LoRA rank (default 16; tiny 4)")
    ap.add_argument("--base-lr", type=float, default=None)
    ap.add_argument("--lora-lr", type=float, default=None)
    ap.add_argument("--max-stride", type=int, default=None, help="the curriculum's last stride (default 4)")
    ap.add_argument("--threads", type=int, default=1, help="CPU: torch threads (0: torch's default)")
    ap.add_argument("--compile", action="store_true", help="torch.compile the AR base phase's step")
    ap.add_argument("--max-steps", type=int, default=None, help="cap each phase's steps (tests)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("--device cuda: no CUDA device here (use --device cpu)")
    train(args)


if __name__ == "__main__":
    main()
