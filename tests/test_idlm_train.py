"""idlm-small's training code: the I-DLM objective's layout, the adapters' format, merge at load.

* The [x_t | x_0] attention mask equals its definition, and -- the property the conversion
  rests on -- every mask position's logits in the training layout equal the logits the same
  [MASK] gets in an ISD window at inference (a plain causal forward over the clean prefix
  plus masks), with and without the R-ISD gate; the clean half equals a causal forward.
* ``TrainableLora.save`` writes what PEFT reads: PEFT on transformers' Qwen3 (the oracle)
  gives the logits of our model with the adapter bound; ``cde_merge_adapters`` at load
  gives PEFT's ``merge_and_unload`` logits; bad entries are refused with the key named.
* slow: the whole pipeline in --tiny mode on the CPU (train -> bundle -> serving loader ->
  greedy ISD == greedy AR through the engine -> eval JSON and model card), bounded.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from cde.qwen3.config import Qwen3Config  # noqa: E402
from cde.qwen3.loading import load_lora, load_qwen3, save_qwen3  # noqa: E402
from cde.qwen3.model import Qwen3Model  # noqa: E402
from train.idlm_lora import TrainableLora  # noqa: E402
from train.idlm_objective import (attention_mask, causal_lm_loss, consistency_batch, consistency_loss,  # noqa: E402
                                  training_attend)

ROOT = Path(__file__).resolve().parents[1]
V = 97
MASK = 96


def tiny_model(seed: int, dtype=torch.float64) -> Qwen3Model:
    cfg = Qwen3Config(n_layers=2, hidden=32, n_heads=4, n_kv_heads=2, head_dim=8, intermediate=64, vocab_size=V,
                      mask_token_id=MASK, bos_token_id=None, eos_token_ids=(), max_positions=512,
                      tie_word_embeddings=True, rope_theta=10_000.0)
    return Qwen3Model(cfg).init_random(seed, std=0.2).to(dtype).eval()


def random_lora(model: Qwen3Model, seed: int, rank: int = 4) -> TrainableLora:
    lora = TrainableLora(model, rank, 2.0 * rank, seed=seed).to(next(model.parameters()).dtype)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for b in lora.b:
            b.copy_(0.2 * torch.randn(b.shape, generator=gen))
    return lora


@pytest.mark.parametrize("length,block", [(7, 1), (9, 2), (10, 3), (5, 7)])
def test_attention_mask_is_the_definition(length, block):
    m = attention_mask(length, block)
    n = length
    for qi in range(2 * n):
        for kj in range(2 * n):
            q_noisy, k_noisy = qi < n, kj < n
            qp, kp = qi % n, kj % n
            start = (qp // block) * block
            if q_noisy:
                want = (kp < start) if not k_noisy else (start <= kp <= qp)
            else:
                want = (not k_noisy) and kp <= qp
            assert bool(m[qi, kj]) == want, (length, block, qi, kj)


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("block", [1, 3])
def test_training_layout_equals_inference_windows(block, gated, seed):
    """Logits of x_t position s + k == logits of the last [MASK] of x_0[:s] + [MASK] * (k + 1)."""
    model = tiny_model(seed)
    random_lora(model, seed).bind(model)
    n = 11
    x0 = torch.randint(0, MASK, (2, n), generator=torch.Generator().manual_seed(seed))
    batch = consistency_batch(x0, block, MASK)
    with torch.no_grad():   # the attention the training runs (GQA: 4 query / 2 KV heads)
        h = model.hidden_states(batch.tokens, batch.positions, training_attend(batch.mask),
                                batch.gate if gated else None)
        logits = model.logits(h)
        for i in range(n):
            s = (i // block) * block
            seq = torch.cat([x0[:, :s], torch.full((2, i - s + 1), MASK)], 1)
            gate = torch.cat([torch.zeros(2, s), torch.ones(2, i - s + 1)], 1) if gated else None
            want = model(seq, lora_gate=gate)[:, -1]
            err = float((logits[:, i] - want).abs().max())
            assert err < 1e-9, f"seed={seed} block={block} gated={gated} mask position {i}: {err:.3g}"
        clean_gate = torch.zeros(2, n) if gated else None
        want_clean = model(x0, lora_gate=clean_gate)
        err = float((logits[:, n:] - want_clean).abs().max())
        assert err < 1e-9, f"seed={seed}: clean half != causal forward ({err:.3g})"
        losses = consistency_loss(model, batch, lora_gated=gated)
    assert torch.isfinite(losses.total) and float(losses.mask) > 0, f"seed={seed}"
    if not gated:   # auto-balance: total = L_mask + (L_mask / L_clean) L_clean = 2 L_mask
        assert abs(float(losses.total) - 2 * float(losses.mask)) < 1e-9, f"seed={seed}"


def test_causal_lm_loss_is_next_token_cross_entropy(seed):
    model = tiny_model(seed)
    tokens = torch.randint(0, V, (3, 12), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        logits = model(tokens[:, :-1])   # the reference forward (enable_gqa SDPA)
        want = torch.nn.functional.cross_entropy(logits.reshape(-1, V), tokens[:, 1:].reshape(-1))
        got = causal_lm_loss(model, tokens)
    assert abs(float(got - want)) < 1e-10, f"seed={seed}: {float(got)} vs {float(want)}"


def test_lora_gradients_reach_only_the_adapter(seed):
    model = tiny_model(seed, torch.float32)
    for p in model.parameters():
        p.requires_grad_(False)
    lora = random_lora(model, seed)
    lora.bind(model)
    x0 = torch.randint(0, MASK, (2, 9), generator=torch.Generator().manual_seed(seed))
    consistency_loss(model, consistency_batch(x0, 2, MASK)).total.backward()
    assert all(p.grad is not None and float(p.grad.abs().sum()) > 0 for p in lora.parameters()), f"seed={seed}"
    assert all(p.grad is None for p in model.parameters()), f"seed={seed}"
    assert not any("lora" in k for k in model.state_dict()), "bound factors leaked into the model's state_dict"


def _hf_pair(tmp_path: Path, seed: int):
    """Our tiny model saved as an HF checkpoint + a trained-format adapter; transformers + PEFT loaded."""
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    model = tiny_model(seed, torch.float32)
    save_qwen3(model, tmp_path / "base")
    lora = random_lora(model, seed, rank=4)
    lora.save(tmp_path / "adapter", dtype=torch.float32)
    hf = transformers.Qwen3ForCausalLM.from_pretrained(tmp_path / "base", torch_dtype=torch.float32,
                                                       attn_implementation="eager").eval()
    peft_model = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()
    return model, lora, peft_model


def test_saved_adapter_is_what_peft_reads(tmp_path, seed):
    model, lora, peft_model = _hf_pair(tmp_path, seed)
    tokens = torch.randint(0, V, (2, 13), generator=torch.Generator().manual_seed(seed + 5))
    with torch.no_grad():
        want = peft_model(input_ids=tokens).logits
        lora.bind(model)
        ours = model(tokens)
        loaded = load_lora(tmp_path / "adapter", load_qwen3(tmp_path / "base"))(tokens)
    scale = float(want.abs().max())
    for name, got in (("bound", ours), ("load_lora", loaded)):
        err = float((got - want).abs().max()) / scale
        assert err < 1e-5, f"seed={seed}: {name} vs PEFT rel err {err:.3g}"


def test_merge_at_load_equals_peft_merge_and_unload(tmp_path, seed):
    _, _, peft_model = _hf_pair(tmp_path, seed)
    bundle = tmp_path / "base"
    (bundle / "conversion").mkdir()
    for f in (tmp_path / "adapter").iterdir():
        (bundle / "conversion" / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((bundle / "config.json").read_text())
    cfg["cde_merge_adapters"] = ["conversion"]
    (bundle / "config.json").write_text(json.dumps(cfg))
    tokens = torch.randint(0, V, (2, 13), generator=torch.Generator().manual_seed(seed + 6))
    with torch.no_grad():
        unmerged = peft_model(input_ids=tokens).logits
        merged_ref = peft_model.merge_and_unload()(input_ids=tokens).logits
        merged = load_qwen3(bundle)(tokens)
        base = load_qwen3(bundle, merge_adapters=False)(tokens)
    scale = float(merged_ref.abs().max())
    assert float((merged - merged_ref).abs().max()) / scale < 1e-5, f"seed={seed}"
    assert float((merged - unmerged).abs().max()) / scale < 1e-5, f"seed={seed}"
    assert float((base - merged).abs().max()) / scale > 1e-3, f"seed={seed}: merge_adapters=False merged anyway"


@pytest.mark.parametrize("entry,err", [("../evil", ValueError), ("a/b", ValueError), ("", ValueError),
                                       ("absent", FileNotFoundError)])
def test_merge_entries_are_checked(tmp_path, entry, err):
    model = tiny_model(1, torch.float32)
    save_qwen3(model, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["cde_merge_adapters"] = [entry]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(err, match="cde_merge_adapters"):
        load_qwen3(tmp_path)


@pytest.mark.slow
def test_tiny_pipeline_end_to_end(tmp_path):
    """--tiny on the CPU: train, bundle (<= 8 files), eval + card; the serving loader's model
    decodes greedy ISD == greedy AR through the engine."""
    out = tmp_path / "idlm"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "train.train_idlm", "--device", "cpu", "--tiny", "--out", str(out),
           "--time-budget-s", "40", "--max-steps", "6"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    files = [p for p in out.rglob("*") if p.is_file()]
    assert len(files) <= 8, files
    assert {p.relative_to(out).as_posix() for p in files} >= {
        "config.json", "model.safetensors", "tokenizer.json", "training.json", "conversion/adapter_config.json",
        "conversion/adapter_model.safetensors", "risd/adapter_config.json", "risd/adapter_model.safetensors"}

    from tests.options import isd_options
    from worker_svc.engine.isd_engine import IsdEngine, IsdFinishEvent
    from worker_svc.engine.job import Job
    training = json.loads((out / "training.json").read_text())
    model = load_qwen3(out, dtype=torch.float64)
    engine = IsdEngine(model, max_slots=4, max_stride=4)
    prompts = training["prompts"][:2]
    got = {}
    for stride in (1, 4):
        reqs = [engine.submit(Job(f"{stride}-{i}", p, isd_options(max_new_tokens=12, stride=stride)))
                for i, p in enumerate(prompts)]
        engine.run_until_idle()
        got[stride] = [[e for e in engine.drain(r) if isinstance(e, IsdFinishEvent)][0].output_tokens for r in reqs]
    assert got[1] == got[4], got

    ev = tmp_path / "eval.json"
    cmd = [sys.executable, "-m", "train.eval_idlm", "--model-dir", str(out), "--out", str(ev), "--prompts", "2",
           "--max-new", "12", "--windows", "2", "--window", "48", "--equality-prompts", "2", "--equality-tokens",
           "8", "--dist-runs", "300", "--sample-prompts", "1", "--seed", "3"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(ev.read_text())
    assert res["greedy_equality"]["all_identical"], res["greedy_equality"]
    assert {(r["stride"], r["temperature"]) for r in res["isd"]} == {(n, t) for n in (2, 3, 4, 8) for t in (0.0, 1.0)}
    assert (out / "README.md").is_file()


def test_eval_introspection_losses_equal_the_training_objective(seed):
    """eval_idlm's per-row alpha pass computes the training loss it reports (rows differ)."""
    from train.eval_idlm import introspection
    model = tiny_model(seed)
    random_lora(model, seed).bind(model)
    rows = torch.randint(0, MASK, (3, 13), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        for gated in (False, True):
            got = introspection(model, rows, 4, gated=gated)
            want = consistency_loss(model, consistency_batch(rows[:, :-1], 3, MASK), lora_gated=gated)
            assert abs(got["mask_loss"] - float(want.mask)) < 1e-9, f"seed={seed} gated={gated}"
            assert abs(got["clean_loss"] - float(want.clean)) < 1e-9, f"seed={seed} gated={gated}"
            assert 0.0 <= got["alpha"] <= 1.0 and 0.0 <= got["greedy_agree"] <= 1.0, f"seed={seed}"


def test_tpf_formula_limits():
    from train.eval_idlm import tpf_formula
    for n in (2, 3, 4, 8):
        assert tpf_formula(0.0, n) == 1.0
        assert abs(tpf_formula(1.0, n) - n) < 1e-12
    assert abs(tpf_formula(0.5, 4) - (2 + 0.5 + 0.25) / (2 - 0.125)) < 1e-12


def test_stride_curriculum_reaches_the_last_stride_in_order():
    import dataclasses

    from train.train_idlm import SMALL, stride_at
    for max_stride in (2, 4, 8):
        recipe = dataclasses.replace(SMALL, max_stride=max_stride)
        seq = [stride_at(i / 200, recipe) for i in range(200)]
        assert seq == sorted(seq) and seq[0] == 2 and seq[-1] == max_stride, (max_stride, seq)
        assert set(seq) == set(range(2, max_stride + 1)), (max_stride, sorted(set(seq)))
