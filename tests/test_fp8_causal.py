"""FP8 (e4m3) trunk weights for causal (Qwen3 / I-DLM) models, cde/fp8.py's `to_fp8` on a
Qwen3Model: a converted model against its unquantized self, the fused e4m3 q/k/v and gate/up GEMMs
against the separate ones, the paged ISD engine on a converted model against the reference decoders
on the same model (token for token, greedy and seeded sampling, every stride), and
`worker_svc --weights fp8` through the stack against the reference on the same converted checkpoint."""

from __future__ import annotations

import copy
import random
from pathlib import Path

import pytest
import torch

from cde.fp8 import Fp8Linear, to_fp8
from cde.isd.decoder import generate_ar, generate_ar_batch
from cde.qwen3.config import preset
from cde.qwen3.model import Qwen3Model
from tests.isd_engine_harness import NEW, SAMPLED, check_all, models, prompts_for, run_in_waves
from tests.numerics import rel_err
from tests.options import isd_options
from tests.tiny_models import random_lora
from worker_svc.engine.isd_engine import IsdEngine

N_PROJECTIONS = 7   # q k v o gate up down
IDLM_DIR = Path(__file__).resolve().parents[1] / "models" / "idlm-tiny"
PROMPT = [{"role": "user", "content": "Tell me about the sea."}]


def test_a_converted_qwen3_stays_near_its_unquantized_self_and_fusing_changes_nothing(seed):
    model = Qwen3Model(preset("tiny")).init_random(seed).eval()
    fp8 = copy.deepcopy(model)
    assert to_fp8(fp8) == N_PROJECTIONS * model.cfg.n_layers
    layer = fp8.model.layers[0]
    assert isinstance(layer.self_attn.q_proj, Fp8Linear) and isinstance(layer.mlp.down_proj, Fp8Linear)
    assert fp8.lm_head.weight.dtype == torch.float32 and fp8.model.embed_tokens.weight.dtype == torch.float32
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, model.cfg.vocab_size, (2, 90), generator=g)
    with torch.no_grad():
        ref = model(tokens)
        separate = fp8(tokens)
        bf16_err = rel_err(copy.deepcopy(model).bfloat16()(tokens).float(), ref)
        err = rel_err(separate, ref)
        # e4m3 keeps 3 mantissa bits to bf16's 7 (random tiny weights: near-flat logits, large errors both)
        assert 2 * bf16_err < err < 24 * bf16_err, f"seed={seed}: logits rel err {err}, bf16 {bf16_err}"
        fp8.fuse_projections()
        a, m = fp8.model.layers[0].self_attn, fp8.model.layers[0].mlp
        assert isinstance(a.qkv, Fp8Linear) and isinstance(m.gate_up, Fp8Linear)
        # the separate modules are views of the fused rows (no second copy)
        assert a.k_proj.qweight.data_ptr() == a.qkv.qweight[a.q_proj.out_features:].data_ptr()
        fused = fp8(tokens)
    # row-wise scales: the fused GEMM is the separate ones' concatenation (summation order aside)
    assert rel_err(fused, separate) < 1e-5, f"seed={seed}"


def test_a_model_with_an_adapter_attached_is_refused(seed):
    model = random_lora(Qwen3Model(preset("tiny")).init_random(seed).eval(), seed, scale=0.1)
    with pytest.raises(ValueError, match="merge it"):
        to_fp8(model)


@pytest.mark.parity
@pytest.mark.parametrize("kind", ["tiny-random", "lag4"])
def test_the_isd_engine_on_fp8_weights_equals_the_reference_on_the_same_model(kind, seed):
    # float64 as the other parity tests: an e4m3 rounding of an activation cannot flip between batch shapes
    model = models(seed)[kind]
    assert model.lm_head.weight.dtype == torch.float64
    to_fp8(model)
    rng = random.Random(seed)
    greedy_prompts = prompts_for(model, rng)[:4]
    jobs = [(f"g{n}-L{len(p)}", p, isd_options(NEW, stride=n)) for n in (1, 2, 4) for p in greedy_prompts]
    for c, (n, t, k, p, prop) in enumerate(SAMPLED[:5]):
        for prompt in prompts_for(model, rng, (5, 65)):
            jobs.append((f"s{c}-{len(jobs)}", prompt, isd_options(NEW, stride=n, temperature=t, top_k=k, top_p=p,
                                                                  proposal=prop, seed=rng.randrange(1 << 40))))
    rng.shuffle(jobs)
    engine = IsdEngine(model, n_pages=128)
    assert isinstance(model.model.layers[0].self_attn.qkv, Fp8Linear)   # the engine fused the e4m3 modules
    fins = check_all(model, run_in_waves(engine, jobs), jobs, f"seed={seed} {kind} fp8")
    ar = {len(p): g.tokens for p, g in zip(greedy_prompts, generate_ar_batch(model, greedy_prompts, NEW))}
    for rid, prompt, opts in jobs:   # greedy ISD = greedy AR on the converted model, at every stride
        if rid.startswith("g"):
            assert fins[rid].output_tokens == ar[len(prompt)], f"seed={seed} {kind} {rid}"


@pytest.mark.e2e
def test_a_causal_worker_with_fp8_weights_serves_the_converted_models_greedy_text(tmp_path):
    """`cde.launch --weights fp8` on idlm-tiny: the worker converts its trunk, and greedy output
    at strides 1 and 4 equals the reference decoder's on the same converted checkpoint."""
    import httpx

    from cde.qwen3.chat import load_chat_tokenizer
    from cde.qwen3.loading import load_qwen3
    from tests.stack_fixture import running_stack

    model = load_qwen3(IDLM_DIR, dtype=torch.float32)
    to_fp8(model)
    tok = load_chat_tokenizer(IDLM_DIR, model.cfg)
    want = generate_ar(model, tok.apply_chat_template(PROMPT), 32, temperature=0.0).tokens
    want = want[:next((i for i, t in enumerate(want) if t in tok.stop_ids), len(want))]   # served up to a stop
    with running_stack(tmp_path / "run", model_dir=IDLM_DIR, weights="fp8") as stack:
        log = next(s.log for s in stack.services if s.name == "worker0").read_text()
        assert f"FP8 (e4m3) weights: {N_PROJECTIONS * model.cfg.n_layers} trunk projections" in log, log[-2000:]
        with httpx.Client(timeout=120) as c:
            info = c.get(f"{stack.base_url}/v1/models").json()["data"][0]
            for stride in (1, 4):
                r = c.post(f"{stack.base_url}/v1/chat/completions", json={
                    "messages": PROMPT, "max_tokens": 32, "temperature": 0, "decode": {"stride": stride}})
                assert r.status_code == 200, r.text
                toks = [t for b in r.json()["cde"]["blocks"] for t in b["tokens"]]
                assert toks == want, f"stride {stride}"
    assert info["id"] == "idlm-tiny"
