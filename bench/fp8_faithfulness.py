"""FP8 (e4m3) weights against the dense model on the same weights: how much the answers change.

    python -m bench.fp8_faithfulness --model-dir models/steerling-small --out bench/results/fp8-faithfulness-...json
    python -m bench.fp8_faithfulness --model-dir models/idlm-small --out ...
    python -m bench.fp8_faithfulness --preset steerling-8b --device cuda --out ...   # random weights (benchmark)

One JSON (docs/BENCHMARKS.md fields). The dense model runs first, then the same module is converted in
place (cde/fp8.py `to_fp8`, what `worker_svc --weights fp8` does) and runs again on the same inputs:
- `logits`: relative error ||fp8 - dense|| / ||dense|| of the logits over held-out text (stories of
  seeds the trainer never generates, train/stories.py HELDOUT_STORY_SEED) read as one sequence each;
  Steerling reads it with its last 64-token block half masked, as the engine sees a block being
  decoded; the argmax agreement over those positions; beside it the same figure for bfloat16
  weights against float32 when the dense run is float32 (a yardstick: the error bf16 serving has);
- `greedy`: greedy generations of `--new-tokens` (256) tokens from held-out prompts by the reference
  decoders (cde/steerling/reference_decoder.py one token per step; cde/isd/decoder.py AR): tokens
  identical before the first difference, the share of prompts identical throughout (and, for a
  float32 dense run, the same for bfloat16 weights: greedy text flips at near-ties under any rounding);
- Steerling only, on the same inputs: `concept_topk_overlap` |top-k(fp8) & top-k(dense)| / k of each
  position's known and discovered head (the k the model records), and `attribution_topk_overlap`
  the same for the 8 largest |contributions| to the dense argmax token (both heads together);
  `attribution_identity`: the largest |sum of terms + residual - logit| / max(1, |logit|) over the
  fp8 greedy generations' tokens (the heads stay dense, so it stays at float rounding).
"""

from __future__ import annotations

import argparse
import copy
import time

import torch

from bench.steerling import json_writer, run_record
from cde.fp8 import to_fp8
from cde.model_family import CAUSAL, model_family

ATTR_TOP = 8


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30))


def held_out(n: int, seed: int) -> list[tuple[str, str]]:
    """(prompt, story text) of held-out stories."""
    from train.steerling_data import HELDOUT_STORY_SEED
    from train.stories import generate_story
    out = []
    for i in range(n):
        s = generate_story(HELDOUT_STORY_SEED + seed, i)
        out.append((s.prompt, s.text))
    return out


class Family:
    """What the bench needs of a model family: load, tokenize, read a sequence, decode greedily."""

    def __init__(self, args, device: str, dtype: torch.dtype):
        self.device, self.dtype = device, dtype
        src = args.model_dir or args.tokenizer_dir
        self.causal = model_family(src) == CAUSAL if args.model_dir else args.preset.startswith("idlm")
        if self.causal:
            from cde.qwen3.chat import load_chat_tokenizer
            from cde.qwen3.config import Qwen3Config
            if args.model_dir:
                from cde.qwen3.loading import load_qwen3
                self.model = load_qwen3(args.model_dir, dtype=dtype, device=device)
            else:
                from bench.isd import build_model
                self.model = build_model(args.preset, device, dtype, args.seed)
            self.tok = load_chat_tokenizer(src, Qwen3Config.load(src) if args.model_dir else None)
        else:
            from cde.steerling.tokenizer import load_model_tokenizer
            if args.model_dir:
                from cde.steerling.loading import load_model
                self.model = load_model(args.model_dir, dtype=dtype, device=device)
            else:
                from bench.steerling import build_model
                self.model = build_model(args.preset, device, dtype, args.seed)
            from cde.steerling.config import SteerlingConfig
            self.tok = load_model_tokenizer(SteerlingConfig.load(src), src)
        self.vocab = min(self.tok.vocab_size, self.model_vocab())

    def model_vocab(self) -> int:
        return self.model.cfg.vocab_size

    def chat(self, prompt: str) -> list[int]:
        return self.tok.apply_chat_template([{"role": "user", "content": prompt}])

    def sequence(self, prompt: str, text: str, max_len: int) -> list[int]:
        ids = self.chat(prompt) + self.tok.encode(text)
        return [min(t, self.vocab - 1) for t in ids[:max_len]]

    @torch.no_grad()
    def read(self, ids: list[int], seed: int, model=None):
        """Logits (T, V) float32 and, for Steerling, the heads' records and the attribution inputs."""
        model = model or self.model
        tokens = torch.tensor(ids, device=self.device)[None]
        if self.causal:
            return {"logits": model(tokens)[0].float()}
        cfg = self.model.cfg
        blk = cfg.diff_block_size
        t = tokens.shape[1] - tokens.shape[1] % blk
        tokens = tokens[:, :t].clone()
        g = torch.Generator().manual_seed(seed)
        masked = torch.rand(blk, generator=g) < 0.5
        tokens[0, t - blk:][masked.to(tokens.device)] = cfg.mask_id
        out = model(tokens)
        return {"logits": out.logits.float(), "known_idx": out.known_idx, "disc_idx": out.disc_idx,
                "known_logits": out.known_logits, "disc_logits": out.disc_logits, "tokens": tokens[0]}

    @torch.no_grad()
    def greedy(self, prompt_ids: list[int], new: int):
        """(tokens, the Steerling records of their committing steps or None)."""
        if self.causal:
            from cde.isd.decoder import generate_ar
            return generate_ar(self.model, prompt_ids, new, temperature=0.0, tokenizer_vocab_size=self.vocab).tokens, None
        from cde.options import DecodeOptions
        from cde.steerling.reference_decoder import generate
        from cde.steerling.sampling import SamplingParams
        opts = DecodeOptions(max_new_tokens=new, sampling=SamplingParams(use_entropy_sampling=False, temperature=0.0),
                             tokens_per_step=1, confidence_threshold=None, seed=0, stop_ids=())
        res = generate(self.model, prompt_ids, opts, tokenizer_vocab_size=self.vocab)
        return res.output_tokens, res.records


def overlap(a: torch.Tensor, b: torch.Tensor) -> float:
    """Mean over rows of |set(a_row) & set(b_row)| / k."""
    k = a.shape[1]
    hits = (a[:, :, None] == b[:, None, :]).any(-1).sum(-1).double() / k
    return float(hits.mean())


def greedy_agreement(outs: list[list[int]], dense: list[list[int]]) -> dict:
    """Tokens identical before the first difference (mean, min) and the share identical throughout."""
    same = [next((i for i, (a, b) in enumerate(zip(o, d)) if a != b), min(len(o), len(d))) for o, d in zip(outs, dense)]
    return {"identical_prefix_mean": sum(same) / len(same), "identical_prefix_min": min(same),
            "identical_share": sum(1 for o, d in zip(outs, dense) if o == d) / len(same),
            "generated_mean": sum(len(d) for d in dense) / len(dense)}


def attribution_top(fam: Family, rec: dict, targets: torch.Tensor) -> torch.Tensor:
    """The columns of the ATTR_TOP largest |contributions| to `targets` at every position (n, ATTR_TOP),
    as user-facing concept ids (discovered offset by n_known)."""
    from cde.steerling.attribution import RawRecords, model_lookups, token_attribution, token_top_terms
    m = fam.model
    n = targets.shape[0]
    logits = rec["logits"]
    raw = RawRecords(torch.arange(n), targets.cpu(), logits.gather(1, targets[:, None])[:, 0].cpu(),
                     rec["known_idx"].cpu(), rec["known_logits"].cpu(), rec["disc_idx"].cpu(),
                     rec["disc_logits"].cpu())
    known, disc, lm = model_lookups(m)
    attr = token_attribution(raw, lambda i: known(i.to(fam.device)).cpu(), lambda i: disc(i.to(fam.device)).cpu(),
                             lambda i: lm(i.to(fam.device)).cpu())
    return token_top_terms(attr, ATTR_TOP, m.cfg.n_known).concept_ids


def attribution_identity(fam: Family, records) -> float:
    from cde.steerling.attribution import model_lookups, token_attribution
    known, disc, lm = model_lookups(fam.model)
    dev = fam.device
    attr = token_attribution(records.__class__(*(getattr(records, f).cpu() for f in records.__dataclass_fields__)),
                             lambda i: known(i.to(dev)).cpu(), lambda i: disc(i.to(dev)).cpu(),
                             lambda i: lm(i.to(dev)).cpu())
    total = attr.known_contrib.double().sum(-1) + attr.disc_contrib.double().sum(-1) + attr.residual.double()
    target = attr.target_logits.double()
    return float(((total - target).abs() / target.abs().clamp(min=1.0)).max())


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--model-dir", help="a trained model directory (either family)")
    src.add_argument("--preset", help="random weights of a preset (steerling-8b, idlm-8b): benchmark only")
    ap.add_argument("--tokenizer-dir", default="models/steerling-small",
                    help="with --preset: the tokenizer the held-out text is read with (ids clipped to the vocabulary)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, choices=("float32", "bfloat16"),
                    help="the dense run's dtype (default bfloat16 on CUDA, float32 on the CPU)")
    ap.add_argument("--texts", type=int, default=16, help="held-out stories read for the logit figures")
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--prompts", type=int, default=8, help="held-out prompts generated from greedily")
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    cuda = args.device.startswith("cuda")
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype or ("bfloat16" if cuda else "float32")]
    t0 = time.perf_counter()
    fam = Family(args, args.device, dtype)
    result = run_record("bench.fp8_faithfulness", args.model_dir or args.preset, "ar" if fam.causal else "block",
                        cuda, dtype, weights="fp8 vs dense", texts=args.texts, prompts=args.prompts,
                        new_tokens=args.new_tokens, seed=args.seed,
                        random_weights=args.preset is not None)
    save = json_writer(args.out, result)
    texts = held_out(args.texts, args.seed)
    seqs = [fam.sequence(p, t, args.max_len) for p, t in texts]
    prompts = [fam.chat(p) for p, _ in held_out(args.texts + args.prompts, args.seed)[args.texts:]]

    dense_reads = [fam.read(ids, args.seed + i) for i, ids in enumerate(seqs)]
    dense_greedy = [fam.greedy(p, args.new_tokens)[0] for p in prompts]
    print(f"dense done ({time.perf_counter() - t0:.0f} s)", flush=True)
    bf16_errs = bf16_greedy = None
    if dtype == torch.float32:   # the yardstick: what bf16 weights change on the same inputs
        bf16 = copy.deepcopy(fam.model).bfloat16()
        bf16_errs = [rel_err(fam.read(ids, args.seed + i, bf16)["logits"], d["logits"])
                     for i, (ids, d) in enumerate(zip(seqs, dense_reads))]
        fam.model, dense = bf16, fam.model
        bf16_greedy = [fam.greedy(p, args.new_tokens)[0] for p in prompts]
        fam.model = dense
        del bf16
    n_conv = to_fp8(fam.model)
    fp8_reads = [fam.read(ids, args.seed + i) for i, ids in enumerate(seqs)]
    errs = [rel_err(f["logits"], d["logits"]) for f, d in zip(fp8_reads, dense_reads)]
    agree = [float((f["logits"].argmax(-1) == d["logits"].argmax(-1)).double().mean())
             for f, d in zip(fp8_reads, dense_reads)]
    result["converted_projections"] = n_conv
    result["logits"] = {"rel_err_mean": sum(errs) / len(errs), "rel_err_max": max(errs),
                        "argmax_agreement": sum(agree) / len(agree),
                        "positions": sum(f["logits"].shape[0] for f in fp8_reads)}
    if bf16_errs:
        result["logits"]["bf16_vs_fp32_rel_err_mean"] = sum(bf16_errs) / len(bf16_errs)
    print(f"logits: {result['logits']}", flush=True)
    if not fam.causal:
        result["concept_topk_overlap"] = {
            "known": sum(overlap(f["known_idx"], d["known_idx"]) for f, d in zip(fp8_reads, dense_reads)) / len(seqs),
            "discovered": sum(overlap(f["disc_idx"], d["disc_idx"]) for f, d in zip(fp8_reads, dense_reads)) / len(seqs),
            "k_known": int(dense_reads[0]["known_idx"].shape[1]), "k_discovered": int(dense_reads[0]["disc_idx"].shape[1])}
        tops = []
        for f, d in zip(fp8_reads, dense_reads):
            targets = d["logits"].argmax(-1)
            tops.append(overlap(attribution_top(fam, f, targets), attribution_top(fam, d, targets)))
        result["attribution_topk_overlap"] = {"top": ATTR_TOP, "mean": sum(tops) / len(tops)}
        print(f"concepts: {result['concept_topk_overlap']}, attribution: {result['attribution_topk_overlap']}", flush=True)
    save()
    fp8_greedy = [fam.greedy(p, args.new_tokens) for p in prompts]
    result["greedy"] = greedy_agreement([f for f, _ in fp8_greedy], dense_greedy)
    if bf16_greedy:
        result["greedy"]["bf16_vs_fp32"] = greedy_agreement(bf16_greedy, dense_greedy)
    if not fam.causal:
        result["attribution_identity_max"] = max(attribution_identity(fam, r) for _, r in fp8_greedy)
    result["seconds"] = round(time.perf_counter() - t0, 1)
    print(f"greedy: {result['greedy']}", flush=True)
    save()


if __name__ == "__main__":
    main()
