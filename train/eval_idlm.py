"""Evaluate an idlm-small bundle: losses, introspective acceptance, ISD tokens per forward, R-ISD.

    python -m train.eval_idlm --model-dir models/idlm-small --out bench/results/idlm-small-eval.json
    python -m train.eval_idlm --model-dir models/idlm-small --out ... --device cuda --speed   # + H200 tok/s

Measured with the project's own decoders: tokens per forward and acceptance through the
serving engine (``worker_svc.engine.isd_engine.IsdEngine``), greedy equality and the R-ISD
distribution test through the reference decoders (``cde.isd.decoder``). Held-out text and
prompts come from the bundle's ``training.json`` (documents the training never saw).

1. held-out AR loss of the base and of the converted model (how far the clean "anchor"
   moved), and L_mask at N = 4 (recomputed here, not copied from training);
2. introspective acceptance alpha on held-out text, per mask offset: with the [x_t | x_0]
   layout q comes from a mask position and p from the clean position predicting the same
   token: ``alpha`` = E_{x~q} min(1, p/q) = sum min(p, q) (the T = 1 acceptance of a draft
   drawn from q), ``greedy_agree`` = P(argmax q == argmax p) (the T = 0 acceptance of a
   draft given correct context), and ``alpha_text`` = mean min(1, p(x)/q(x)) at the text
   token x (the literal reading; near 1 whenever the clean position is the surer one);
3. for N = 2, 3, 4, 8 at T = 0 and 1: acceptance, tokens per forward (prefill counted, as
   the API reports it, and steady-state without it) and the spec's formula
   TPF = (2 + p + ... + p^(N-2)) / (2 - p^(N-1)) at the measured p;
4. greedy ISD == greedy AR of the converted model, token for token (float64);
5. R-ISD (base + gated adapter): chi-square of sampled R-ISD outputs (T = 1, top-k 4, first 4
   tokens) against the base model's exact AR distribution (enumerated), with the broken
   control (adapter ungated) that must fail; R-ISD tokens per forward;
6. with ``--speed`` on a GPU: AR and ISD N = 4 tok/s at C = 1, 32, 64, and, as a labelled
   projection, TPF x (AR step / ISD step) of the idlm-8b bench JSON (``--bench-8b``).

Writes the JSON (``--out``) and the model card ``README.md`` in the model directory
(``--card-out`` elsewhere, e.g. under $OUT on the GPU machine; ``--no-card`` to skip).
"""

from __future__ import annotations

import argparse
import os
import json
import platform
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from cde.isd.decoder import generate_ar_batch, generate_isd_batch, keep_mask
from cde.isd.distribution import pooled_chi_square
from cde.qwen3.chat import load_chat_tokenizer
from cde.qwen3.loading import load_lora, load_qwen3
from cde.qwen3.model import Qwen3Model, masked_attend
from train.idlm_objective import attention_mask, causal_lm_loss
from cde.options import IsdOptions
from worker_svc.engine.isd_engine import IsdEngine, IsdFinishEvent
from worker_svc.engine.job import Job

STRIDES = (2, 3, 4, 8)
PAPER = {"alpha": 0.984, "tpf_n4": 2.96, "model": "I-DLM-8B"}
RISD_DIR = "risd"


def tpf_formula(p: float, n: int) -> float:
    """Expected tokens per forward at per-draft acceptance p, stride n (spec/paper)."""
    return (2 + sum(p ** i for i in range(1, n - 1))) / (2 - p ** (n - 1))


# ---- models -----------------------------------------------------------------------------------
def load_models(model_dir: Path, device: str, dtype: torch.dtype) -> dict[str, Qwen3Model]:
    """converted (base + merged conversion LoRA: what the server serves), base, risd (base + gated adapter)."""
    models = {"converted": load_qwen3(model_dir, dtype=dtype, device=device),
              "base": load_qwen3(model_dir, dtype=dtype, device=device, merge_adapters=False)}
    if (model_dir / RISD_DIR).is_dir():
        models["risd"] = load_lora(model_dir / RISD_DIR, load_qwen3(model_dir, dtype=dtype, device=device,
                                                                      merge_adapters=False))
    return models


def heldout_rows(heldout: Sequence[int], length: int, n: int) -> torch.Tensor:
    arr = np.asarray(heldout, dtype=np.int64)
    length = min(length, len(arr) - 2)
    starts = np.linspace(0, len(arr) - length - 2, n).astype(np.int64)
    return torch.from_numpy(np.stack([arr[s:s + length + 1] for s in starts]))


# ---- 1 + 2: losses and introspective acceptance -------------------------------------------------
@torch.no_grad()
def introspection(model: Qwen3Model, rows: torch.Tensor, stride: int, gated: bool,
                  p_model: Qwen3Model | None = None) -> dict:
    """Losses and alpha of the [x_t | x_0] layout at stride ``stride`` (blocks of stride - 1 masks).

    p comes from the clean half of ``p_model`` (default: the same model; R-ISD: the base,
    which its gated clean half equals exactly)."""
    dev = model.lm_head.weight.device
    x0 = rows[:, :-1].to(dev)
    b, n = x0.shape
    block = stride - 1
    mask_id = model.cfg.mask_token_id
    tokens = torch.cat([torch.full_like(x0, mask_id), x0], 1)
    pos = torch.arange(n, device=dev)
    positions = torch.cat([pos, pos]).expand(b, -1)
    attn = attention_mask(n, block, dev)[None, None]
    gate = torch.cat([torch.ones(n, dtype=torch.bool, device=dev), torch.zeros(n, dtype=torch.bool, device=dev)])
    gate = gate.expand(b, -1) if gated else None
    out: dict = {}
    sums: dict[str, list[float]] = {k: [] for k in ("mask_loss", "clean_loss", "ar_loss")}
    per_k = {k: {"alpha": [], "alpha_text": [], "greedy_agree": []} for k in range(block)}
    for i in range(b):
        sl = slice(i, i + 1)
        logits = model.logits(model.hidden_states(tokens[sl], positions[sl], masked_attend(attn),
                                                  None if gate is None else gate[sl])).double()
        q_log = logits[0, :n - 1]
        p_log = logits[0, n:2 * n - 1]
        if p_model is not None:
            p_log = p_model(x0[sl])[0, :n - 1].double()
        target = x0[i, 1:]
        lq = torch.log_softmax(q_log, -1)
        lp = torch.log_softmax(p_log, -1)
        sums["mask_loss"].append(float(-lq.gather(-1, target[:, None]).mean()))
        sums["clean_loss"].append(float(-lp.gather(-1, target[:, None]).mean()))
        sums["ar_loss"].append(float(causal_lm_loss(model if p_model is None else p_model, rows[sl].to(dev))))
        ratio = (lp.gather(-1, target[:, None]) - lq.gather(-1, target[:, None])).exp().clamp(max=1.0)[:, 0]
        overlap = torch.minimum(lp.exp(), lq.exp()).sum(-1)
        agree = (q_log.argmax(-1) == p_log.argmax(-1)).double()
        j = torch.arange(n - 1, device=dev)
        k = j % block
        valid = j >= block     # the first block has no clean context
        for kk in range(block):
            sel = valid & (k == kk)
            per_k[kk]["alpha"].append(float(overlap[sel].mean()))
            per_k[kk]["alpha_text"].append(float(ratio[sel].mean()))
            per_k[kk]["greedy_agree"].append(float(agree[sel].mean()))
    out.update({k: float(np.mean(v)) for k, v in sums.items()})
    out["per_offset"] = [{"offset": kk, "predicts_tokens_ahead": kk + 2,
                          **{m: float(np.mean(v)) for m, v in per_k[kk].items()}} for kk in range(block)]
    for m in ("alpha", "alpha_text", "greedy_agree"):
        out[m] = float(np.mean([e[m] for e in out["per_offset"]]))
    out["stride"] = stride
    return out


# ---- 3: acceptance and tokens per forward through the engine -----------------------------------
def engine_runs(model: Qwen3Model, prompts: list[list[int]], opts: IsdOptions) -> tuple[dict, list[list[int]]]:
    engine = IsdEngine(model, max_slots=len(prompts), max_stride=8, n_pages=max(64, len(prompts) * 8))
    reqs = [engine.submit(Job(f"r{i}", p, IsdOptions(**{**opts.__dict__, "seed": opts.seed + i})))
            for i, p in enumerate(prompts)]
    engine.run_until_idle()
    keys = ("forwards", "generated", "proposed", "accepted", "verify_steps", "full_accepts")
    tot = {k: 0 for k in keys} | {"requests": len(prompts)}
    outs = []
    for r in reqs:
        fin = [e for e in engine.drain(r) if isinstance(e, IsdFinishEvent)][0]
        outs.append(list(fin.output_tokens))
        for key in keys:
            tot[key] += getattr(fin.stats, key)
    return tot, outs


def tpf_table(model: Qwen3Model, prompts: list[list[int]], max_new: int, strides=STRIDES,
              temperatures=(0.0, 1.0)) -> list[dict]:
    rows = []
    for t in temperatures:
        for n in strides:
            opts = IsdOptions(max_new_tokens=max_new, stride=n, temperature=t, top_k=0, top_p=1.0, seed=11,
                              proposal="sample", lora_gated=True, stop_ids=())
            tot, _ = engine_runs(model, prompts, opts)
            acceptance = tot["accepted"] / tot["proposed"] if tot["proposed"] else 0.0
            # p: a draft's acceptance given the drafts before it were accepted (the formula's p):
            # accepted over the drafts examined (accepted + one rejection per non-full verify step)
            examined = tot["accepted"] + tot["verify_steps"] - tot["full_accepts"]
            p = tot["accepted"] / examined if examined else 0.0
            n_req = tot["requests"]
            rows.append({"stride": n, "temperature": t, "acceptance": acceptance, "p": p,
                         "tokens_per_forward": tot["generated"] / tot["forwards"],
                         "tokens_per_forward_steady": (tot["generated"] - n_req) / max(tot["forwards"] - n_req, 1),
                         "formula_tpf_at_p": tpf_formula(p, n), **tot})
            print(f"  N={n} T={t}: acceptance {acceptance:.3f}, p {p:.3f}, TPF {rows[-1]['tokens_per_forward']:.3f} "
                  f"(steady {rows[-1]['tokens_per_forward_steady']:.3f}, formula {rows[-1]['formula_tpf_at_p']:.3f})",
                  flush=True)
    return rows


# ---- 4: greedy ISD == greedy AR ---------------------------------------------------------------
def greedy_equality(model: Qwen3Model, prompts: list[list[int]], max_new: int, strides=STRIDES,
                    lora_gated: bool = True) -> dict:
    """Reference decoders in the model's dtype (use float64: no near-tie flips between shapes)."""
    ar = generate_ar_batch(model, prompts, max_new)
    res = {"prompts": len(prompts), "max_new_tokens": max_new, "strides": {}}
    for n in strides:
        isd = generate_isd_batch(model, prompts, max_new, n, lora_gated=lora_gated)
        same = sum(a.tokens == b.tokens for a, b in zip(ar, isd))
        res["strides"][str(n)] = {"identical": same, "tokens_per_forward":
                                  sum(g.stats.generated for g in isd) / sum(g.stats.forwards for g in isd)}
    res["all_identical"] = all(v["identical"] == len(prompts) for v in res["strides"].values())
    return res


# ---- 5: R-ISD distribution test ---------------------------------------------------------------
def exact_ar_distribution(model: Qwen3Model, prompt: list[int], new_tokens: int, temperature: float,
                          top_k: int) -> dict[tuple[int, ...], float]:
    """P(first new_tokens tokens) under base AR sampling (gate 0), enumerated in float64. A
    sequence ends at an EOS id (kept), as the decoders cut it."""
    dev = model.lm_head.weight.device
    eos = set(model.cfg.eos_token_ids)
    joint: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(new_tokens):
        done = {s: pr for s, pr in joint.items() if s and s[-1] in eos}
        seqs = [s for s in joint if s not in done]
        if not seqs:
            break
        batch = torch.tensor([prompt + list(s) for s in seqs], device=dev)
        with torch.no_grad():
            logits = model(batch, lora_gate=torch.zeros(batch.shape, device=dev))[:, -1].double().cpu()
        keep = keep_mask(logits, temperature, top_k, 1.0)
        probs = torch.softmax((logits / temperature).masked_fill(~keep, float("-inf")), -1)
        nxt = dict(done)
        for s, row in zip(seqs, probs):
            for t in torch.nonzero(row > 0).flatten().tolist():
                nxt[s + (t,)] = joint[s] * float(row[t])
        joint = nxt
    return joint


def risd_distribution_test(risd: Qwen3Model, prompt: list[int], runs: int, seed: int, stride: int = 4,
                           new_tokens: int = 4, temperature: float = 1.0, top_k: int = 4) -> dict:
    exact = exact_ar_distribution(risd, prompt, new_tokens, temperature, top_k)
    out = {"prompt_tokens": len(prompt), "runs": runs, "seed": seed, "stride": stride, "new_tokens": new_tokens,
           "temperature": temperature, "top_k": top_k, "sequences": len(exact)}
    for label, gated in (("gated", True), ("broken_ungated", False)):
        gens = generate_isd_batch(risd, [prompt] * runs, new_tokens, stride, temperature, top_k, 1.0,
                                  range(seed, seed + runs), lora_gated=gated)
        counts: dict = {}
        for g in gens:
            key = tuple(g.tokens[:new_tokens])
            counts[key] = counts.get(key, 0) + 1
        stat, df, p, tv = pooled_chi_square(counts, exact, runs)
        prop = sum(g.stats.proposed for g in gens)
        impossible = sum(c for k, c in counts.items() if k not in exact)
        out[label] = {"chi2": stat, "df": df, "p_value": p, "total_variation": tv,
                      "runs_outside_base_support": impossible,
                      "acceptance": sum(g.stats.accepted for g in gens) / prop if prop else 0.0}
        print(f"  R-ISD {label}: chi2 {stat:.1f} df {df} p {p:.3g} TV {tv:.4f}, {impossible} runs produced a "
              f"sequence the base cannot", flush=True)
    out["passes"] = out["gated"]["p_value"] > 1e-5 and out["broken_ungated"]["p_value"] < 1e-12
    return out


# ---- 6: speed on a GPU ------------------------------------------------------------------------
def speed(model_dir: Path, prompts: list[list[int]], max_new: int, concurrencies=(1, 32, 64)) -> dict:
    model = load_qwen3(model_dir, dtype=torch.bfloat16, device="cuda")
    engine = IsdEngine(model, max_slots=max(concurrencies), max_stride=8, cuda_graphs=True, compile=True)
    engine.warmup(8, 70)
    res = []
    for c in concurrencies:
        for n in (1, 4):
            for rep in range(2):   # the first pass captures graphs for new buckets
                reqs = [engine.submit(Job(f"s{c}-{n}-{rep}-{i}", prompts[i % len(prompts)],
                                          IsdOptions(max_new_tokens=max_new, stride=n, temperature=0.0, top_k=0,
                                                     top_p=1.0, seed=0, proposal="sample", lora_gated=True,
                                                     stop_ids=()))) for i in range(c)]
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                engine.run_until_idle()
                torch.cuda.synchronize()
                dt = time.perf_counter() - t0
                fins = [[e for e in engine.drain(r) if isinstance(e, IsdFinishEvent)][0] for r in reqs]
            gen = sum(f.stats.generated for f in fins)
            res.append({"concurrency": c, "stride": n, "seconds": dt, "tok_per_s_aggregate": gen / dt,
                        "tok_per_s_per_request": float(np.mean([f.stats.generated for f in fins])) / dt,
                        "tokens_per_forward": gen / sum(f.stats.forwards for f in fins)})
            print(f"  C={c} N={n}: {res[-1]['tok_per_s_per_request']:.0f} tok/s per request, "
                  f"{res[-1]['tok_per_s_aggregate']:.0f} aggregate", flush=True)
    return {"gpu": torch.cuda.get_device_name(), "runs": res}


def projection_8b(bench_file: Path, tpf_n4: float) -> dict | None:
    if not bench_file.is_file():
        return None
    d = json.loads(bench_file.read_text())
    by = {(r["concurrency"], r["stride"]): r for r in d["runs"] if r.get("temperature", 0) == 0}
    out = []
    for c in sorted({c for c, _ in by}):
        if (c, 1) in by and (c, 4) in by:
            ar_ms, isd_ms = by[(c, 1)]["ms_per_forward"], by[(c, 4)]["ms_per_forward"]
            out.append({"concurrency": c, "ar_ms_per_step": ar_ms, "isd_ms_per_step": isd_ms,
                        "projected_speedup": tpf_n4 * ar_ms / isd_ms})
    return {"label": "PROJECTION: idlm-small's TPF at N=4, T=0 times the AR/ISD step-time ratio of the idlm-8b "
                     "bench (random weights) -- not a measurement of a trained 8B model",
            "bench": str(bench_file), "tpf_n4": tpf_n4, "by_concurrency": out}


# ---- model card -------------------------------------------------------------------------------
def samples(model: Qwen3Model, model_dir: Path, prompts: list[list[int]], max_new: int) -> list[dict]:
    tok = load_chat_tokenizer(model_dir, model.cfg)
    out = []
    for t in (0.0, 1.0):
        opts = IsdOptions(max_new_tokens=max_new, stride=4, temperature=t, top_k=0, top_p=1.0, seed=5,
                          proposal="sample", lora_gated=True, stop_ids=())
        tot, outs = engine_runs(model, prompts, opts)
        for p, o in zip(prompts, outs):
            out.append({"temperature": t, "prompt": tok.decode(p, skip_special=False),
                        "completion": tok.decode(o)})
    return out


def write_card(path: Path, res: dict, tr: dict) -> Path:
    rec = tr["recipe"]
    tb = {(r["stride"], r["temperature"]): r for r in res["isd"]}
    lines = [
        "# idlm-small: a small causal LM converted by I-DLM introspective-consistency training",
        "",
        f"A Qwen3-layout causal model ({tr['parameters']:,} parameters: {rec['layers']} layers, hidden "
        f"{rec['hidden']}, {rec['heads']} query / {rec['kv_heads']} KV heads, tied embeddings, vocabulary "
        f"{tr['data']['vocab']}), trained by `python -m train.train_idlm` on {tr['source']} data "
        f"({tr['data']['train_tokens'] / 1e6:.1f}M tokens of synthetic stories and chat pairs made by our own "
        f"generator), then converted to introspective strided decoding (ISD) with the I-DLM recipe.",
        "",
        "Files: `model.safetensors` (the AR base, bf16), `conversion/` (the I-DLM conversion, a PEFT LoRA of rank "
        f"{rec['conv_rank']}, merged into the weights at load: `cde_merge_adapters` in `config.json`), `risd/` "
        f"(the R-ISD adapter, rank {rec['risd_rank']}, applied only at [MASK] positions), `tokenizer.json` "
        "(byte-level BPE, ChatML specials, `<|MASK|>`), `training.json` (recipe, losses, timings).",
        "",
        "Serve it: `python -m cde.launch --model-dir models/idlm-small --demo` (ISD with `decode.stride`).",
        "",
        "Why a LoRA conversion: lossless R-ISD needs the unmodified base, so a full fine-tune would put two "
        "copies of the weights in the 20 MB bundle; with a LoRA the base can be twice as large.",
        "",
        "Data: synthetic stories and ChatML chat pairs from `train/stories.py` (our own generator; sources and "
        "licenses in `train/SOURCES.md`). Training: one H200 command, `bash bench/run_h200.sh train-all` "
        "(`python -m train.train_idlm --out OUT/idlm-small --time-budget-s 520`); GPU evaluation: "
        "`bash bench/run_h200.sh eval-idlm`.",
        "",
        "## Figures (held-out text and prompts)",
        "",
        f"Measured by `python -m train.eval_idlm` on {res['device']} ({res['dtype']}) at commit {res['commit']}; "
        f"JSON: `bench/results/{Path(res['out']).name}`.",
        "",
        "| figure | value |",
        "|---|---|",
        f"| held-out AR loss, base | {res['losses']['base']['ar_loss']:.4f} |",
        f"| held-out AR (clean) loss, converted | {res['losses']['converted']['ar_loss']:.4f} |",
        f"| mask loss at N = 4: converted / R-ISD | {res['losses']['converted']['mask_loss']:.4f} / "
        f"{res['losses'].get('risd', {}).get('mask_loss', float('nan')):.4f} |",
        f"| alpha = E min(1, p/q), converted (paper, 8B: {PAPER['alpha']}) | {res['losses']['converted']['alpha']:.3f} |",
        f"| alpha at the text token / greedy agreement | {res['losses']['converted']['alpha_text']:.3f} / "
        f"{res['losses']['converted']['greedy_agree']:.3f} |",
        f"| greedy ISD == greedy AR (converted, N = {', '.join(res['greedy_equality']['strides'])}) | "
        f"{'yes' if res['greedy_equality']['all_identical'] else 'NO'} on {res['greedy_equality']['prompts']} prompts |",
    ]
    if res.get("risd_distribution"):
        d = res["risd_distribution"]
        lines.append(f"| R-ISD output == base AR distribution (chi-square, {d['runs']} runs of {d['new_tokens']} "
                     f"tokens, T = {d['temperature']:g}, top-k {d['top_k']}, N = {d['stride']}) | p = "
                     f"{d['gated']['p_value']:.3g}; control with the gate off: p = "
                     f"{d['broken_ungated']['p_value']:.3g} ({d['broken_ungated']['runs_outside_base_support']} runs "
                     f"outside the base's support) |")
    lines += ["", "Acceptance (accepted / proposed drafts, as the API reports it), p (a draft's acceptance "
              "given the drafts before it were accepted), tokens per forward (TPF; prefill counted as the API "
              "counts it; steady: without the prefill) and the formula (2 + p + ... + p^(N-2)) / (2 - p^(N-1)) "
              f"at the measured p; {res['isd'][0]['requests']} held-out prompts, up to "
              f"{res['max_new']} new tokens (stories end earlier at their end-of-text); paper, I-DLM-8B: 2.96 at N = 4:",
              "", "| model | N | T | acceptance | p | TPF | TPF steady | formula at p |",
              "|---|---|---|---|---|---|---|---|"]
    for label, table in (("converted", res["isd"]), ("R-ISD", res.get("risd_isd") or [])):
        for r in table:
            lines.append(f"| {label} | {r['stride']} | {r['temperature']:g} | {r['acceptance']:.3f} | {r['p']:.3f} | "
                         f"{r['tokens_per_forward']:.3f} | {r['tokens_per_forward_steady']:.3f} | "
                         f"{r['formula_tpf_at_p']:.3f} |")
    n4 = tb.get((4, 0.0))
    if n4:
        met = "met" if n4["tokens_per_forward"] >= 2.5 else "NOT met"
        lines += ["", f"Aim TPF >= 2.5 at N = 4, T = 0: {met} ({n4['tokens_per_forward']:.3f})."]
    if res.get("speed"):
        lines += ["", f"Speed ({res['speed']['gpu']}, bf16, CUDA graphs, 128 new tokens, greedy):", "",
                  "| C | N | tok/s per request | aggregate | TPF |", "|---|---|---|---|---|"]
        for r in res["speed"]["runs"]:
            lines.append(f"| {r['concurrency']} | {r['stride']} | {r['tok_per_s_per_request']:.0f} | "
                         f"{r['tok_per_s_aggregate']:.0f} | {r['tokens_per_forward']:.2f} |")
    if res.get("projection_8b"):
        pr = res["projection_8b"]
        lines += ["", f"{pr['label']}: " + ", ".join(f"C = {r['concurrency']}: {r['projected_speedup']:.2f}x"
                                                      for r in pr["by_concurrency"]) + "."]
    lines += ["", "## Training", "", "| phase | seconds | steps | tokens |", "|---|---|---|---|"]
    for ph in tr["phases"]:
        lines.append(f"| {ph['name']} | {ph['seconds']:.0f} | {ph['steps']} | {ph['tokens'] / 1e6:.1f}M |")
    lines += ["", f"Device {tr['device']}, torch {tr['torch']}, seed {tr['seed']}, budget {tr['time_budget_s']:.0f} s "
              f"(total {tr.get('seconds_total', 0):.0f} s). Conversion: [x_t | x_0], x_t all [MASK], causal within "
              "each noisy block and to earlier clean positions, logit shift, L = L_mask + s L_clean with "
              "s = L_mask / L_clean detached, stride curriculum N = 2 -> 3 -> 4. R-ISD: the same objective with the "
              "LoRA gated to the masks (L_mask only), initialized from the conversion adapter truncated by SVD.",
              "", "## Samples (ISD N = 4; held-out prompts)", ""]
    for s in res.get("samples", []):
        lines += [f"- T = {s['temperature']:g}, prompt `{s['prompt']!r}`:", f"  > {s['completion']!r}"]
    lines += ["", "The text is synthetic (a grammar of our own); nothing here is a general-purpose language model.", ""]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines))
    return path


# ---- main -------------------------------------------------------------------------------------
def evaluate(args: argparse.Namespace) -> dict:
    if args.device == "cpu" and args.threads > 0:
        torch.set_num_threads(args.threads)
    model_dir = Path(args.model_dir)
    training = json.loads((model_dir / "training.json").read_text())
    heldout = training.get("heldout_sample") or []
    prompts = [list(p) for p in training["prompts"]][:args.prompts]
    dtype = torch.float64 if args.dtype == "float64" else torch.float32
    t0 = time.monotonic()
    models = load_models(model_dir, args.device, dtype)
    res: dict = {"model_dir": str(model_dir), "device": args.device, "dtype": args.dtype, "out": args.out,
                 "commit": _commit(), "max_new": args.max_new, "command": " ".join(["python -m train.eval_idlm", *args.argv]),
                 "torch": torch.__version__, "host": platform.node(), "paper": PAPER,
                 "training_summary": {k: training.get(k) for k in ("recipe", "phases", "heldout", "parameters",
                                                                   "source", "seconds_total")}}
    print("[losses + alpha]", flush=True)
    rows = heldout_rows(heldout, args.window, args.windows)
    res["losses"] = {"base": introspection(models["base"], rows, 4, gated=False)}
    res["losses"]["converted"] = introspection(models["converted"], rows, 4, gated=False)
    res["losses"]["converted_by_stride"] = [introspection(models["converted"], rows, n, gated=False)
                                            for n in (2, 3, 8)]
    if "risd" in models:
        res["losses"]["risd"] = introspection(models["risd"], rows, 4, gated=True, p_model=models["base"])
    for k in ("base", "converted", "risd"):
        if k in res["losses"]:
            v = res["losses"][k]
            print(f"  {k}: AR {v['ar_loss']:.4f} mask {v['mask_loss']:.4f} alpha {v['alpha']:.3f} "
                  f"greedy agree {v['greedy_agree']:.3f}", flush=True)
    print("[ISD through the engine: converted model]", flush=True)
    res["isd"] = tpf_table(models["converted"], prompts, args.max_new)
    if "risd" in models:
        print("[R-ISD through the engine]", flush=True)
        res["risd_isd"] = tpf_table(models["risd"], prompts, args.max_new, strides=(4,))
    print("[greedy ISD == greedy AR, float64 reference decoders]", flush=True)
    conv64 = load_qwen3(model_dir, dtype=torch.float64, device=args.device)
    res["greedy_equality"] = greedy_equality(conv64, prompts[:args.equality_prompts], args.equality_tokens)
    print(f"  {res['greedy_equality']}", flush=True)
    if "risd" in models:
        risd64 = load_lora(model_dir / RISD_DIR, load_qwen3(model_dir, dtype=torch.float64, device=args.device,
                                                             merge_adapters=False))
        base_eq = greedy_equality(risd64, prompts[:args.equality_prompts], args.equality_tokens, strides=(4,))
        res["risd_greedy_equals_base"] = base_eq
        print("[R-ISD distribution test]", flush=True)
        res["risd_distribution"] = risd_distribution_test(risd64, prompts[0], args.dist_runs, args.seed)
    if args.speed:
        print("[speed]", flush=True)
        res["speed"] = speed(model_dir, prompts, 128)
    tpf4 = next(r["tokens_per_forward"] for r in res["isd"] if r["stride"] == 4 and r["temperature"] == 0)
    res["projection_8b"] = projection_8b(Path(args.bench_8b), tpf4)
    res["samples"] = samples(models["converted"], model_dir, prompts[:args.sample_prompts], args.max_new)
    res["seconds"] = time.monotonic() - t0
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2) + "\n")
    if not args.no_card:
        card = Path(args.card_out) if args.card_out else model_dir / "README.md"
        print(f"model card: {write_card(card, res, training)}")
    print(f"wrote {out} ({res['seconds']:.0f} s)")
    return res


def _commit() -> str:
    if os.environ.get("CDE_COMMIT"):   # bench/run_h200.sh names the commit (a device copy's git may be stale)
        return os.environ["CDE_COMMIT"][:7]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", default="models/idlm-small")
    ap.add_argument("--out", default="bench/results/idlm-small-eval.json")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=("float32", "float64"),
                    help="losses and TPF tables (greedy equality and the distribution test always float64)")
    ap.add_argument("--prompts", type=int, default=32, help="held-out prompts for the TPF tables")
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--windows", type=int, default=32, help="held-out windows for losses and alpha")
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--equality-prompts", type=int, default=8)
    ap.add_argument("--equality-tokens", type=int, default=64)
    ap.add_argument("--dist-runs", type=int, default=20000)
    ap.add_argument("--sample-prompts", type=int, default=3)
    ap.add_argument("--seed", type=int, default=int(time.time()) % 100_000,
                    help="decoding seed of the distribution test (printed in the JSON)")
    ap.add_argument("--threads", type=int, default=0, help="CPU: torch threads (0: torch's default)")
    ap.add_argument("--speed", action="store_true", help="GPU: tok/s at C = 1, 32, 64")
    ap.add_argument("--bench-8b", default="bench/results/isd-idlm-8b-h200-3152228.json")
    ap.add_argument("--no-card", action="store_true")
    ap.add_argument("--card-out", default="", help="where the model card goes (default: MODEL_DIR/README.md)")
    args = ap.parse_args(argv)
    args.argv = list(argv) if argv is not None else __import__("sys").argv[1:]
    if args.dist_runs < 100 or args.prompts < 1:
        ap.error("--dist-runs must be >= 100 and --prompts >= 1")
    return args


def main(argv: list[str] | None = None) -> None:
    evaluate(parse_args(argv))


if __name__ == "__main__":
    main()
