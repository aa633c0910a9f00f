"""Structured output for causal models: ISD (and AR, stride 1) under a grammar against the base
model's distribution restricted to the grammar. The grammar masks the target side (the clean
token and verify's p at every draft position) while drafts stay unconstrained proposals, which
speculative sampling's rule keeps exact.

- greedy: the engine at strides 1-4, overlapped steps on, beside unconstrained requests, equals
  the reference AR decoder under the same grammar (`generate_ar_batch(constraints=...)`) token
  for token;
- sampled: the joint distribution of a constrained 4-token output of a small sharp model,
  decoded by the engine with ISD N = 3, passes a chi-square test against the exact constrained
  distribution (enumerated), with drafts both accepted and rejected.
"""

from __future__ import annotations

import random

import pytest
import torch

from cde.grammar import GrammarVocabulary, compile_response_format
from cde.isd.decoder import generate_ar_batch, keep_mask
from cde.isd.distribution import pooled_chi_square
from cde.qwen3.config import Qwen3Config
from cde.qwen3.model import Qwen3Model
from tests.options import isd_options
from tests.tiny_models import tiny_model
from worker_svc.engine.isd_engine import IsdEngine, IsdFinishEvent
from worker_svc.engine.job import Job

pytestmark = pytest.mark.parity


def byte_vocabulary(cfg: Qwen3Config) -> GrammarVocabulary:
    """ids below 256 are bytes (the tiny preset's ids are arbitrary; the grammar reads them so)."""
    specials = [i for i in (cfg.mask_token_id, cfg.bos_token_id, *cfg.eos_token_ids) if i is not None]
    token_bytes = [bytes([i]) if i < 256 and i not in specials else b"" for i in range(cfg.vocab_size)]
    return GrammarVocabulary(token_bytes, specials, cfg.eos_token_ids, lambda s: [b for b in s.encode()])


@pytest.mark.parametrize("stride", [1, 2, 3, 4])
def test_greedy_isd_under_a_grammar_equals_constrained_ar(stride, seed):
    model = tiny_model(seed)
    vocab = byte_vocabulary(model.cfg)
    rng = random.Random(seed)
    formats = [{"type": "regex", "regex": r"[a-z]{2,12}( [a-z]{1,6}){0,3}"},
               {"type": "json_schema", "json_schema": {"schema": {
                   "type": "object", "properties": {"k": {"type": "string", "maxLength": 5}, "b": {"type": "boolean"}},
                   "required": ["k", "b"], "additionalProperties": False}}}]
    engine = IsdEngine(model, n_pages=128, max_stride=4)
    cases = []
    for i in range(6):
        fmt = formats[i % 2] if i % 3 else None
        prompt = [rng.randrange(256) for _ in range(rng.choice((1, 5, 70)))]
        opts = isd_options(40, stride=stride, seed=rng.randrange(1 << 30))
        grammar = None if fmt is None else compile_response_format(fmt)
        job = Job(f"r{i}", prompt, opts, constraint=None if grammar is None else vocab.constraint(grammar))
        cases.append((prompt, grammar, engine.submit(job)))
    engine.run_until_idle()
    for i, (prompt, grammar, handle) in enumerate(cases):
        (fin,) = [e for e in engine.drain(handle) if isinstance(e, IsdFinishEvent)]
        (ref,) = generate_ar_batch(model, [prompt], 40, constraints=[None if grammar is None else vocab.constraint(grammar)])
        assert fin.output_tokens == ref.tokens, f"seed={seed} stride {stride} request {i} (grammar: {grammar is not None})"


SMALL_V = 6           # ids 0-3 are the letters a-d, 4 is EOS, 5 the mask
REGEX = "[abc][bcd][a-d][ab]"
PROMPT = [1, 2, 0]
RUNS = 6_000


def small_model() -> Qwen3Model:
    """A sharp V = 6 model (as tests/test_isd.py's), with an EOS id for the grammar to end on."""
    cfg = Qwen3Config(n_layers=2, hidden=32, n_heads=2, n_kv_heads=1, head_dim=16, intermediate=64,
                      vocab_size=SMALL_V, mask_token_id=SMALL_V - 1, bos_token_id=None, eos_token_ids=(4,),
                      max_positions=256)
    model = Qwen3Model(cfg).init_random(3).double().eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model


def letters(cfg: Qwen3Config) -> GrammarVocabulary:
    return GrammarVocabulary([b"a", b"b", b"c", b"d", b"", b""], [4, 5], [4],
                             lambda s: [ord(c) - ord("a") for c in s])


def exact_constrained(model: Qwen3Model, vocab: GrammarVocabulary, grammar: str, temperature: float):
    """P(the 4 letters, then EOS) under AR sampling of the base model restricted to the grammar."""
    joint = {(): 1.0}
    for _ in range(len(REGEX.split("]")) - 1):
        seqs = list(joint)
        with torch.no_grad():
            logits = model(torch.tensor([PROMPT + list(s) for s in seqs]),
                           lora_gate=torch.zeros(len(seqs), len(PROMPT) + len(seqs[0])))[:, -1].double()
        nxt = {}
        for s, row in zip(seqs, logits):
            c = vocab.constraint(grammar)
            for t in s:
                c.advance(t)
            row = row.masked_fill(~torch.from_numpy(c.allowed()), float("-inf"))
            row[model.cfg.mask_token_id] = float("-inf")
            probs = torch.softmax(row.masked_fill(~keep_mask(row, temperature, 0, 1.0), float("-inf")) / temperature, -1)
            nxt.update({s + (t,): joint[s] * float(probs[t]) for t in range(SMALL_V) if float(probs[t]) > 0})
        joint = nxt
    return joint


@pytest.mark.slow
def test_sampled_isd_under_a_grammar_follows_the_constrained_distribution(seed):
    model = small_model()
    vocab = letters(model.cfg)
    grammar = compile_response_format({"type": "regex", "regex": REGEX})
    temperature = 0.9
    exact = exact_constrained(model, vocab, grammar, temperature)
    engine = IsdEngine(model, n_pages=512, max_stride=3, max_slots=64)
    handles = [engine.submit(Job(f"s{i}", PROMPT, isd_options(8, stride=3, temperature=temperature, seed=seed + i),
                                 constraint=vocab.constraint(grammar))) for i in range(RUNS)]
    engine.run_until_idle()
    counts: dict[tuple[int, ...], int] = {}
    proposed = accepted = 0
    for h in handles:
        (fin,) = [e for e in engine.drain(h) if isinstance(e, IsdFinishEvent)]
        assert fin.output_tokens[-1] == 4 and len(fin.output_tokens) == 5, f"seed={seed}: {fin.output_tokens}"
        key = tuple(fin.output_tokens[:4])
        counts[key] = counts.get(key, 0) + 1
        proposed += fin.stats.proposed
        accepted += fin.stats.accepted
    stat, df, p, tv = pooled_chi_square(counts, exact, RUNS)
    msg = f"seed={seed}: chi2={stat:.1f} df={df} p={p:.3g} TV={tv:.4f} acceptance={accepted / max(proposed, 1):.3f}"
    print(msg)
    assert p > 1e-5, msg
    assert 0.05 < accepted / proposed < 0.95, f"{msg}: accept and reject paths not both exercised"


@pytest.mark.gpu
@pytest.mark.parity
def test_greedy_isd_under_a_grammar_with_cuda_graphs_equals_constrained_ar(seed):
    """The served GPU path (Triton verify, CUDA graphs) under grammars, float64 weights: greedy ISD
    at stride 4 equals the reference AR decoder under the same grammar, token for token."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pytest.importorskip("triton")
    model = tiny_model(seed)
    vocab = byte_vocabulary(model.cfg)
    rng = random.Random(seed)
    formats = [None, {"type": "regex", "regex": r"[a-z]{2,12}( [a-z]{1,6}){0,3}"},
               {"type": "json_schema", "json_schema": {"schema": {
                   "type": "object", "properties": {"k": {"type": "string", "maxLength": 5}, "b": {"type": "boolean"}},
                   "required": ["k", "b"], "additionalProperties": False}}}]
    engine = IsdEngine(model.cuda(), n_pages=128, max_stride=4, cuda_graphs=True)
    cases = []
    for i in range(6):
        fmt = formats[i % 3]
        prompt = [rng.randrange(256) for _ in range(rng.choice((1, 5, 70)))]
        grammar = None if fmt is None else compile_response_format(fmt)
        job = Job(f"r{i}", prompt, isd_options(40, stride=4, seed=rng.randrange(1 << 30)),
                  constraint=None if grammar is None else vocab.constraint(grammar))
        cases.append((prompt, grammar, engine.submit(job)))
    engine.run_until_idle()
    assert engine.stats().graphs > 0
    model.cpu()
    for i, (prompt, grammar, handle) in enumerate(cases):
        (fin,) = [e for e in engine.drain(handle) if isinstance(e, IsdFinishEvent)]
        (ref,) = generate_ar_batch(model, [prompt], 40, constraints=[None if grammar is None else vocab.constraint(grammar)])
        assert fin.output_tokens == ref.tokens, f"seed={seed} request {i} (grammar: {grammar is not None})"
