"""Ids that are never output cannot be sampled, in either model family, by the engines or by
their reference decoders (the oracles the engines are tested against).

Never-output ids (documented in README "API"):
* Steerling: EOS, mask, pad, BOS (`cde.steerling.sampling.banned_ids` + the EOS ban of
  `adjust_logits`) and the embedding rows past the tokenizer's vocabulary;
* causal (I-DLM): the mask, a BOS that is not a stop id, and the rows past the tokenizer's
  vocabulary (`cde.isd.decoder.never_output_ids`);
* both: the tokenizer's unassigned ids (`unassigned_ids()`), which the worker passes to the engine.

Each model here gets an LM-head bias that gives those ids the largest logits by far (the mask
the largest of all), checked on the raw logits first, so a decoder that forgets any ban samples
them at once. Greedy and sampled (T 0.7, top_p 0.95; Steerling also its entropy sampler), fresh
seeds printed in every failure; the engines must still equal their reference token for token.
"""

from __future__ import annotations

import random

import pytest
import torch

from cde.isd.decoder import generate_ar_batch, generate_isd_batch, never_output_ids
from cde.isd.toy import lag_model
from cde.qwen3.config import preset
from cde.qwen3.model import Qwen3Model
from cde.steerling.config import TINY
from cde.steerling.model import SteerlingModel
from cde.steerling.reference_decoder import generate
from cde.steerling.sampling import SamplingParams, banned_ids
from tests.options import decode_options, isd_options
from worker_svc.engine.job import Job
from worker_svc.engine.steerling_engine import FinishEvent, SteerlingEngine, StepEvent
from worker_svc.engine.isd_engine import IsdEngine, IsdFinishEvent

pytestmark = pytest.mark.parity

STEERLING_VOCAB = 264   # the tiny byte tokenizer's ids; rows 264..319 are padding


def bias_toward(lm_head: torch.nn.Linear, ids: list[int], top: float = 60.0, gap: float = 2.0) -> None:
    """Give the LM head a bias: ids[0] gets `top`, each later id `gap` less, others 0."""
    bias = torch.zeros(lm_head.out_features, dtype=lm_head.weight.dtype)
    for i, t in enumerate(ids):
        bias[t] = top - gap * i
    lm_head.bias = torch.nn.Parameter(bias, requires_grad=False)


# ---- Steerling ----------------------------------------------------------------------------

def steerling_never_output() -> list[int]:
    return sorted(set(banned_ids(TINY, STEERLING_VOCAB).tolist()) | {TINY.eos_id})


def biased_steerling(seed: int) -> SteerlingModel:
    model = SteerlingModel(TINY).init_random(seed, std=0.05).to(torch.float64).eval()
    padding_rows = list(range(STEERLING_VOCAB, TINY.vocab_size))
    bias_toward(model.transformer.lm_head,
                [TINY.mask_id, TINY.eos_id, TINY.pad_id, TINY.bos_id, padding_rows[0], padding_rows[-1]], gap=8.0)
    return model


def test_banned_set_is_what_the_docs_say():
    ids = set(steerling_never_output())
    assert {TINY.mask_id, TINY.pad_id, TINY.bos_id, TINY.eos_id} <= ids
    assert set(range(STEERLING_VOCAB, TINY.vocab_size)) <= ids
    # chunk boundaries and turn markers are output tokens
    assert TINY.endofchunk_id not in ids and TINY.eot_id not in ids


def test_steerling_decoders_never_sample_the_mask_even_when_it_has_the_largest_logit(seed):
    model = biased_steerling(seed)
    rng = random.Random(seed)
    never = steerling_never_output()
    # the bias really makes the mask the raw argmax at every masked position
    seq = torch.tensor([rng.randrange(256) for _ in range(64)] + [TINY.mask_id] * 64)
    with torch.no_grad():
        raw = model(seq[None]).logits
    assert (raw[64:].argmax(-1) == TINY.mask_id).all(), f"seed={seed}: the bias does not make the mask the argmax"

    samplers = [SamplingParams(use_entropy_sampling=False, temperature=0.0),
                SamplingParams(use_entropy_sampling=False, temperature=0.7, top_p=0.95),
                SamplingParams(top_p=1.0)]   # entropy-adaptive temperature, no top-p cut
    engine = SteerlingEngine(model, tokenizer_vocab_size=STEERLING_VOCAB, n_pages=64)
    submitted = {}
    for i, sp in enumerate(samplers):
        # a request that samples <|eot_id|> early checks too few draws: take the next prompt and
        # seed of the test's stream (at most 10) until the reference samples at least 20 tokens
        for _ in range(10):
            prompt = [rng.randrange(256) for _ in range(rng.choice((5, 40, 64)))]
            opts = decode_options(48, sampling=sp, tokens_per_step=2, seed=rng.randrange(1 << 40))
            ref = generate(model, prompt, opts, tokenizer_vocab_size=STEERLING_VOCAB)
            if sum(len(s.tokens) for s in ref.steps) >= 20:
                break
        submitted[f"s{i}"] = (prompt, opts, ref, engine.submit(Job(f"s{i}", prompt, opts)))
    engine.run_until_idle()
    for rid, (prompt, opts, ref, handle) in submitted.items():
        events = list(engine.drain(handle))
        steps = [(e.step, e.positions, e.tokens) for e in events if isinstance(e, StepEvent)]
        fin = [e for e in events if isinstance(e, FinishEvent)][0]
        sampled = [t for s in ref.steps for t in s.tokens]
        assert len(sampled) >= 20, f"seed={seed} {rid}: only {len(sampled)} tokens sampled in 10 tries"
        hit = sorted(set(sampled + [t for _, _, ts in steps for t in ts]) & set(never))
        assert not hit, f"seed={seed} {rid} {opts.sampling}: never-output ids {hit} were sampled"
        # the engine still equals its reference, step for step
        assert steps == [(s.step, s.positions, s.tokens) for s in ref.steps], f"seed={seed} {rid}"
        assert fin.output_tokens == ref.output_tokens, f"seed={seed} {rid}"


# ---- causal (ISD and AR) ----------------------------------------------------------------------

def biased_tiny_qwen3(seed: int) -> tuple[Qwen3Model, int | None]:
    """The random tiny preset: mask 511 and BOS 509 (not a stop id) get the largest logits."""
    model = Qwen3Model(preset("tiny")).init_random(seed).double().eval()
    cfg = model.cfg
    assert cfg.bos_token_id not in cfg.eos_token_ids
    bias_toward(model.lm_head, [cfg.mask_token_id, cfg.bos_token_id])
    return model, None


def biased_lag(seed: int) -> tuple[Qwen3Model, int | None]:
    """The lag model (drafts often accepted): mask 63, and rows 60..62 past a 60-id tokenizer."""
    model = lag_model(seed, lag=4, vocab=64)
    # |own logit| <= |lm_head row| * |final-norm output| <= |row| * sqrt(hidden) * max|gain|, so a gap of
    # twice that bound orders the biased ids strictly whatever the input (a fixed gap failed on some seeds)
    with torch.no_grad():
        bound = float(model.lm_head.weight.norm(dim=-1).max() * model.cfg.hidden ** 0.5
                      * model.model.norm.weight.abs().max())
    gap = 2 * bound + 1
    bias_toward(model.lm_head, [63, 62, 61, 60], top=4 * gap, gap=gap)
    return model, 60


CAUSAL = {"tiny-random": biased_tiny_qwen3, "lag4": biased_lag}
# (stride, temperature, top_p)
CAUSAL_RUNS = [(1, 0.0, 1.0), (1, 0.7, 0.95), (2, 0.0, 1.0), (4, 0.0, 1.0), (2, 0.7, 0.95), (4, 0.7, 0.95)]


def causal_reference(model, prompts, stride, temperature, top_p, seeds, vocab):
    new = 24
    if stride == 1:
        return generate_ar_batch(model, prompts, new, temperature, 0, top_p, seeds, tokenizer_vocab_size=vocab)
    return generate_isd_batch(model, prompts, new, stride, temperature, 0, top_p, seeds,
                              tokenizer_vocab_size=vocab)


@pytest.mark.parametrize("kind", sorted(CAUSAL))
def test_causal_decoders_never_sample_the_mask_even_when_it_has_the_largest_logit(kind, seed):
    model, vocab = CAUSAL[kind](seed)
    cfg = model.cfg
    never = never_output_ids(cfg, vocab)
    rng = random.Random(seed)
    prompts = [[rng.randrange(min(vocab or 500, 500)) for _ in range(n)] for n in (3, 9, 20)]
    with torch.no_grad():
        raw = model(torch.tensor([prompts[1]]))[0]
    assert (raw.argmax(-1) == cfg.mask_token_id).all(), f"seed={seed}: the bias does not make the mask the argmax"

    engine = IsdEngine(model, n_pages=64, tokenizer_vocab_size=vocab)
    handles, refs = {}, {}
    for c, (n, t, p) in enumerate(CAUSAL_RUNS):
        seeds = [rng.randrange(1 << 40) for _ in prompts]
        for prompt, ref, s in zip(prompts, causal_reference(model, prompts, n, t, p, seeds, vocab), seeds):
            rid = f"N{n}-T{t}-L{len(prompt)}-{c}"
            refs[rid] = ref
            handles[rid] = engine.submit(Job(rid, prompt, isd_options(24, stride=n, temperature=t, top_p=p, seed=s)))
    engine.run_until_idle()
    greedy_ar = {len(p): g.tokens for p, g in zip(prompts, causal_reference(model, prompts, 1, 0.0, 1.0,
                                                                              [0] * 3, vocab))}
    total = 0
    for rid, handle in handles.items():
        fin = [e for e in engine.drain(handle) if isinstance(e, IsdFinishEvent)][0]
        ref = refs[rid]
        hit = sorted(set(ref.tokens + fin.output_tokens) & set(never))
        assert not hit, f"seed={seed} {kind} {rid}: never-output ids {hit} were sampled"
        assert fin.output_tokens == ref.tokens, f"seed={seed} {kind} {rid}: engine {fin.output_tokens} != {ref.tokens}"
        total += len(fin.output_tokens)
        if "T0.0" in rid:   # greedy ISD still equals greedy AR with the bans in place
            assert ref.tokens == greedy_ar[int(rid.split("-L")[1].split("-")[0])], f"seed={seed} {kind} {rid}"
    assert total >= 8 * len(handles), f"seed={seed} {kind}: too few tokens decoded ({total}) to mean anything"


def test_without_the_tokenizer_vocabulary_the_padding_rows_would_be_sampled(seed):
    """The control that shows the causal test above can fail: the same biased lag model decoded
    without the tokenizer's vocabulary size bans only the mask, and the padding rows win."""
    model, vocab = biased_lag(seed)
    gens = generate_ar_batch(model, [[1, 2, 3]], 8, 0.0)
    # every greedy token is a padding row (the bias puts 62 first by a gap of 100, which the
    # model's own logits, up to ~100, can close for a step: 61 then wins, still a padding row)
    assert set(gens[0].tokens) <= {60, 61, 62}, f"seed={seed}: {gens[0].tokens}"
    assert never_output_ids(model.cfg, vocab) == [60, 61, 62, 63]


def test_causal_never_output_ids_never_include_a_stop_id():
    from cde.qwen3.make_tiny import CONFIG as IDLM_TINY

    tiny = preset("tiny")   # bos 509 (not a stop), eos 510, mask 511
    assert never_output_ids(tiny) == [509, 511]
    assert never_output_ids(tiny, 505) == [505, 506, 507, 508, 509, 511]   # eos 510 stays samplable
    assert never_output_ids(IDLM_TINY, 260) == [IDLM_TINY.mask_token_id]   # its BOS is a stop id


def test_the_tokenizers_holes_are_never_sampled_by_the_engine(seed):
    """cl100k leaves 16 ids among its specials unassigned (decoding one is an error, which the
    gateway would answer with 500): the worker passes `Tokenizer.unassigned_ids()` to the engine
    as never_output_ids. Here the ids a first run sampled most are banned and a second run with
    the same seeds samples none of them."""
    model = SteerlingModel(TINY).init_random(seed % 1000, std=0.05).eval()
    prompt = list(range(1, 40))
    opts = decode_options(96, sampling=SamplingParams(temperature=1.0), seed=seed)
    # both runs ban EOS and <|eot_id|>: every run goes to length (a first token that ended the
    # request left nothing to pick holes from, seed 420051850)
    stops = (TINY.eos_id, TINY.eot_id)
    first = SteerlingEngine(model, tokenizer_vocab_size=STEERLING_VOCAB, n_pages=16, never_output_ids=stops)
    h = first.submit(Job("a", prompt, opts))
    first.run_until_idle()
    out = [e for e in first.drain(h) if isinstance(e, FinishEvent)][0].output_tokens
    holes = tuple(sorted(set(out), key=out.count)[-3:])
    assert len(out) == 96 and holes, f"seed={seed}: {out}"
    second = SteerlingEngine(model, tokenizer_vocab_size=STEERLING_VOCAB, n_pages=16,
                             never_output_ids=holes + stops)
    h = second.submit(Job("a", prompt, opts))
    second.run_until_idle()
    again = [e for e in second.drain(h) if isinstance(e, FinishEvent)][0].output_tokens
    assert again and not set(again) & set(holes), f"seed={seed}: {holes} sampled again"


def test_cl100k_unassigned_ids_are_the_holes_among_its_specials():
    from cde.steerling.tokenizer import Cl100kTokenizer
    import os
    path = os.environ.get("CDE_CL100K_BPE")
    if not path or not os.path.isfile(path):
        pytest.skip("needs the real cl100k_base.tiktoken (CDE_CL100K_BPE)")
    tok = Cl100kTokenizer(path)
    holes = tok.unassigned_ids()
    assert holes == [100256, *range(100261, 100276)], holes
    for i in holes:
        with pytest.raises(ValueError, match="not assigned"):
            tok.decode_bytes([i])


def test_a_tokenizer_json_with_a_hole_reports_it(tmp_path):
    """A tokenizer.json whose vocabulary skips an id: both loaders (the causal family's
    Qwen3Tokenizer, Steerling's TokenizerJsonTokenizer) report it in unassigned_ids() (decode
    refuses it), a dense file reports none, and never_output_ids bans what it is given."""
    import json

    from cde.qwen3.chat import write_byte_tokenizer
    from cde.qwen3.tokenizer import Qwen3Tokenizer

    dense = tmp_path / "dense.json"
    write_byte_tokenizer(dense, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    assert Qwen3Tokenizer(dense).unassigned_ids() == []
    holed = tmp_path / "holed.json"
    data = json.loads(dense.read_text())
    vocab = data["model"]["vocab"]
    del vocab[next(k for k, i in vocab.items() if i == 100)]
    holed.write_text(json.dumps(data))
    tok = Qwen3Tokenizer(holed)
    assert tok.unassigned_ids() == [100]
    with pytest.raises(ValueError, match="not assigned"):
        tok.decode([100])
    tiny = preset("tiny")
    assert never_output_ids(tiny, None, tok.unassigned_ids()) == [100, 509, 511]


def test_steerling_tokenizer_json_reports_its_holes(tmp_path):
    import json

    from cde.steerling.tokenizer import TokenizerJsonTokenizer

    from pathlib import Path

    bundled = Path(__file__).resolve().parent.parent / "models" / "steerling-small" / "tokenizer.json"
    tok = TokenizerJsonTokenizer(bundled)
    assert tok.unassigned_ids() == [], "the bundled tokenizer's ids are dense"
    data = json.loads(open(bundled, encoding="utf-8").read())
    vocab = data["model"]["vocab"]
    gone = next(k for k, i in vocab.items() if i == 300)
    del vocab[gone]
    data["model"]["merges"] = [m for m in data["model"]["merges"]
                               if gone not in (m.split(" ") if isinstance(m, str) else m)
                               and gone != "".join(m.split(" ") if isinstance(m, str) else m)]
    holed = tmp_path / "tokenizer.json"
    holed.write_text(json.dumps(data))
    assert TokenizerJsonTokenizer(holed).unassigned_ids() == [300]
    # instruct=False leaves the chat specials out: their ids decode to nothing, so they are holes too
    base = TokenizerJsonTokenizer(bundled, instruct=False)
    chat = [i for s, i in tok.special_tokens.items() if s not in base.special_tokens]
    assert chat and base.unassigned_ids() == sorted(chat)


def test_the_causal_engine_never_samples_the_ids_it_is_told_to_ban(seed):
    """IsdEngine(never_output_ids=...) (the worker passes the tokenizer's holes): the ids a first
    sampled run produced most are banned, and the same requests again sample none of them,
    AR and ISD alike."""
    model = lag_model(seed, lag=4, vocab=64)
    prompts = [[1, 2, 3, 4], [5, 6, 7, 8, 9, 10]]

    def run(banned):
        engine = IsdEngine(model, n_pages=64, never_output_ids=banned)
        hs = [engine.submit(Job(f"r{i}-{n}", p, isd_options(24, stride=n, temperature=1.0, seed=seed + i)))
              for i, p in enumerate(prompts) for n in (1, 4)]
        engine.run_until_idle()
        return [t for h in hs for e in engine.drain(h) if isinstance(e, IsdFinishEvent) for t in e.output_tokens]

    out = run(())
    stops = set(model.cfg.eos_token_ids)   # a stop id is never banned (never_output_ids)
    holes = tuple([t for t in sorted(set(out), key=out.count) if t not in stops][-3:])
    again = run(holes)
    assert len(again) >= 40 and not set(again) & set(holes), f"seed={seed}: {holes} sampled again"
