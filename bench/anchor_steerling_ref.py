"""Anchor: Guide Labs' public `steerling` 0.2.0 inference (generate_full, no KV cache)
at Steerling-8B dimensions with random bf16 weights on this GPU (docs/BENCHMARKS.md).

Prints tok/s for batch 1 and 4, with and without the attribution callback path.
`bash bench/run_h200.sh anchor` runs it; merge its log into an engine JSON with
`python -m bench.steerling --merge-reference <log> --out bench/results/<engine>.json`.

Where the GPU machine cannot reach a package registry, bring the `steerling` wheel and
pydantic's wheels (pydantic, pydantic-core, annotated-types, typing-inspection, for the
GPU machine's CPython) along with the code, install them with
`pip install --no-index --no-deps --ignore-requires-python --target SITE WHEELS`,
and put SITE on PYTHONPATH (bench/run_h200.sh does this for wheels in .whl/).
Argument: number of new tokens (multiple of 64).
"""
import time, sys, types, torch
from steerling.configs.causal_diffusion import CausalDiffusionConfig
from steerling.configs.concept import ConceptConfig
from steerling.configs.generation import GenerationConfig
from steerling.models.interpretable.interpretable_causal_diffusion import InterpretableCausalDiffusionLM
from steerling.inference.causal_diffusion import SteerlingGenerator

torch.manual_seed(0)
cfg = CausalDiffusionConfig(interpretable=True)
cc = ConceptConfig()
with torch.device("cuda"):
    torch.set_default_dtype(torch.bfloat16)
    model = InterpretableCausalDiffusionLM(cfg, cc, vocab_size=100352)
    torch.set_default_dtype(torch.float32)
print("params", sum(p.numel() for p in model.parameters()), flush=True)
tok = types.SimpleNamespace(mask_token_id=100280, eos_token_id=100257, pad_token_id=100277, eot_id=None,
                            decode=lambda ids, **k: "")
gen = SteerlingGenerator(model, tok, cfg, is_interpretable=True, device="cuda")
P, G = 128, int(sys.argv[1]) if len(sys.argv) > 1 else 128
for bsz, cb in [(1, False), (1, True), (4, False)]:
    prompt = torch.randint(0, 100000, (bsz, P), device="cuda")
    gc = GenerationConfig(max_new_tokens=G, steps=G, seed=0)
    callback = (lambda info: None) if cb else None
    gen.generate_full(prompt, GenerationConfig(max_new_tokens=64, steps=64, seed=0), step_callback=callback)  # warm-up
    torch.cuda.synchronize(); t = time.perf_counter()
    out = gen.generate_full(prompt, gc, step_callback=callback)
    torch.cuda.synchronize(); dt = time.perf_counter() - t
    print(f"steerling-ref bsz={bsz} attribution_cb={cb} prompt={P} new={G}: {dt:.2f} s, {bsz*G/dt:.1f} tok/s, {dt/G*1e3:.1f} ms/step", flush=True)
