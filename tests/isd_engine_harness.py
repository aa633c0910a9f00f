"""The harness that holds the paged ISD engine (worker_svc/engine/isd_engine.py) to the reference
decoders (cde/isd/decoder.py), shared by tests/test_isd_engine.py and the child process that runs
the engine with the Triton verify kernel under the CPU interpreter (``triton_engine_child``).

Jobs are ``(request id, prompt, IsdOptions)``; ``run_in_waves`` submits them with steps in
between (mid-flight joins) and ``check_all`` compares every request's events with the reference
run once per options set."""

from __future__ import annotations

import dataclasses
import random

import torch

from cde.isd.decoder import generate_ar_batch, generate_isd_batch
from cde.qwen3.model import Qwen3Model
from tests.options import isd_options
from tests.tiny_models import stopping_lag_model, tiny_model
from cde.options import IsdOptions
from worker_svc.engine.isd_engine import IsdCommitEvent, IsdEngine, IsdFinishEvent
from worker_svc.engine.isd_runner import IsdInputs, greedy_verify
from worker_svc.engine.job import Job

LENGTHS = (1, 5, 63, 64, 65, 130)   # prompt lengths around the 64-token page
NEW = 24


def models(seed: int) -> dict[str, Qwen3Model]:
    return {"tiny-random": tiny_model(seed), "lag4": stopping_lag_model(seed)}


def prompts_for(model: Qwen3Model, rng: random.Random, lengths=LENGTHS) -> list[list[int]]:
    cfg = model.cfg
    avoid = {cfg.mask_token_id, *cfg.eos_token_ids}
    ids = [i for i in range(cfg.vocab_size) if i not in avoid]
    return [[rng.choice(ids) for _ in range(n)] for n in lengths]


def reference(model: Qwen3Model, prompts, opts: IsdOptions, seeds):
    """The oracle for one options set (rows are independent, so one call serves many requests)."""
    if opts.stride == 1:
        return generate_ar_batch(model, prompts, opts.max_new_tokens, opts.temperature, opts.top_k, opts.top_p,
                                 seeds, use_lora=not opts.lora_gated)
    return generate_isd_batch(model, prompts, opts.max_new_tokens, opts.stride, opts.temperature, opts.top_k,
                              opts.top_p, seeds, opts.lora_gated, opts.proposal)


def run_in_waves(engine: IsdEngine, jobs: list[tuple[str, list[int], IsdOptions]], waves: int = 3,
                 steps_between: int = 4) -> dict[str, list]:
    """Submit jobs in waves with steps in between (mid-flight joins); returns each request's events."""
    handles = {}
    per_wave = -(-len(jobs) // waves)
    for w in range(waves):
        for rid, prompt, opts in jobs[w * per_wave:(w + 1) * per_wave]:
            handles[rid] = engine.submit(Job(rid, prompt, opts))
        for _ in range(steps_between):
            engine.step()
    engine.run_until_idle()
    assert engine.stats().pages_used == 0 and engine.stats().running == 0
    return {rid: list(engine.drain(h)) for rid, h in handles.items()}


def check_events(rid: str, events: list, ref, opts: IsdOptions, tag: str) -> IsdFinishEvent:
    """Tokens, finish reason, commit events and usage against the reference Generation."""
    fins = [e for e in events if isinstance(e, IsdFinishEvent)]
    assert len(fins) == 1 and events[-1] is fins[0], f"{tag} {rid}: one finish event, last"
    fin = fins[0]
    assert fin.output_tokens == ref.tokens, f"{tag} {rid}: engine {fin.output_tokens} != reference {ref.tokens}"
    assert fin.reason == ref.finish_reason, f"{tag} {rid}"
    commits = [e for e in events if isinstance(e, IsdCommitEvent)]
    streamed = [t for e in commits for t in e.tokens]
    assert streamed == fin.output_tokens, f"{tag} {rid}: commit events do not add up to the output"
    assert [e.start for e in commits] == [sum(len(c.tokens) for c in commits[:i]) for i in range(len(commits))]
    assert [e.step for e in commits] == sorted({e.step for e in commits}), f"{tag} {rid}: steps not increasing"
    if opts.stride == 1:  # generate_ar_batch counts forwards (== tokens) and tokens only
        assert (fin.stats.forwards, fin.stats.generated) == (ref.stats.forwards, ref.stats.generated), f"{tag} {rid}"
        assert fin.stats.proposed == 0
    else:
        assert fin.stats == ref.stats, f"{tag} {rid}: usage {fin.stats} != reference {ref.stats}"
        assert sum(e.proposed for e in commits) == fin.stats.proposed
        assert sum(e.accepted for e in commits) == fin.stats.accepted
    assert fin.steps == fin.stats.forwards and fin.completion_tokens == len(fin.output_tokens)
    assert fin.device_forwards >= fin.stats.forwards, f"{tag} {rid}: fewer device forwards than logical ones"
    return fin


def check_all(model, engine_events, jobs, tag) -> dict[str, IsdFinishEvent]:
    """Group jobs by options, run the reference once per group, compare every request."""
    groups: dict[IsdOptions, list] = {}
    for rid, prompt, opts in jobs:
        groups.setdefault(dataclasses.replace(opts, seed=0), []).append((rid, prompt, opts))
    fins = {}
    for members in groups.values():
        refs = reference(model, [p for _, p, _ in members], members[0][2], [o.seed for _, _, o in members])
        for (rid, _, opts), ref in zip(members, refs):
            fins[rid] = check_events(rid, engine_events[rid], ref, opts, tag)
    return fins


def greedy_step_inputs(g: torch.Generator, r: int, k: int, v: int, n_slots: int, dtype: torch.dtype):
    """Random window logits (R, 2K+1, V) with many ties (small integers; in float64 split by
    1e-12, which float32 rounds back to ties) and all-greedy step inputs: verify rows whose
    drafts are mostly the argmax (every acceptance length), non-verify rows with drafts 0."""
    w = 2 * k + 1
    logits = torch.randint(0, 6, (r, w, v), generator=g).to(dtype)
    if dtype == torch.float64:
        logits += 1e-12 * torch.rand(r, w, v, generator=g, dtype=torch.float64)
    verify_row = torch.rand(r, generator=g) < 0.7
    best = logits[:, :k].float().argmax(-1)
    drafts = torch.where(torch.rand(r, k, generator=g) < 0.8, best, torch.randint(0, v, (r, k), generator=g))
    drafts = torch.where(verify_row[:, None], drafts, 0)
    ints = lambda lo, hi, *shape: torch.randint(lo, hi, shape, generator=g)   # noqa: E731
    inp = IsdInputs(
        tokens=ints(0, v, r, w), positions=ints(0, 99, r, w), gate=torch.zeros(r, w, dtype=torch.bool),
        write_idx=ints(0, 64, r, w), pages=ints(0, 2, r, 1), read_start=ints(0, w, r),
        slot=ints(1, n_slots, r), win_pos=ints(0, 999, r), clean_j=ints(0, w, r), mask_j0=ints(0, w, r),
        verify_row=verify_row, drafts=drafts, greedy=torch.ones(r, dtype=torch.bool),
        temperature=torch.ones(r, dtype=torch.float64), top_k=ints(0, 4, r), top_p=torch.ones(r, dtype=torch.float64),
        seed=ints(0, 1 << 40, r), fwd_index=ints(0, 99, r), proposal=ints(0, 3, r), n_drafts=ints(0, k + 1, r),
        from_carry=torch.zeros(r, dtype=torch.bool), allow_slot=torch.zeros(r, dtype=torch.long))
    return logits, inp


SAMPLED = [  # stride, temperature, top_k, top_p, proposal
    (1, 0.8, 0, 1.0, "sample"),
    (1, 1.1, 5, 0.9, "sample"),
    (2, 0.7, 0, 1.0, "sample"),
    (3, 1.3, 6, 0.9, "sample"),
    (4, 0.6, 0, 0.95, "argmax_onehot"),
    (3, 0.9, 0, 1.0, "argmax"),
    (8, 0.8, 4, 1.0, "sample"),
    (2, 0.0, 0, 1.0, "sample"),  # a greedy ISD row in the same batch
]


def triton_engine_child(seed: int) -> None:
    """Runs with TRITON_INTERPRET=1 (see tests/test_isd_engine.py's
    test_engine_with_the_triton_kernel_under_the_interpreter); the test passes its seed."""
    from cde.isd.verify_kernel import launch

    torch.set_num_threads(1)
    # greedy_verify (the greedy-only step's verify) gives what the kernel gives greedy rows; V = 37
    # in 3 splits of one tile of 16, ties within and across tiles and splits
    g = torch.Generator().manual_seed(seed)
    for k, dtype in ((1, torch.float32), (3, torch.float64), (7, torch.bfloat16)):
        logits, inp = greedy_step_inputs(g, 8, k, 37, 2, dtype)
        p, r = logits[:, :k], logits.shape[0]
        got = launch(p, torch.randn(p.shape, generator=g), inp.drafts, torch.zeros(r), torch.rand(r, k, generator=g),
                     torch.rand(r, k, generator=g), torch.ones(r, dtype=torch.bool), block=16, split_tiles=1)
        want = greedy_verify(p, inp.drafts)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), f"seed={seed} K={k}: kernel {got} != {want}"
    model = stopping_lag_model(seed)
    rng = random.Random(seed)
    jobs = [(f"c{c}-{i}", prompt, isd_options(16, stride=n, temperature=t, top_k=k, top_p=p, proposal=prop,
                                             seed=rng.randrange(1 << 40)))
            for c, (n, t, k, p, prop) in enumerate(SAMPLED)
            for i, prompt in enumerate(prompts_for(model, rng, (3, 65)))]
    # the CUDA path's verify, V = 64 in 4 vocabulary splits
    engine = IsdEngine(model, n_pages=64, verify_fn=lambda *a: launch(*a, block=16, split_tiles=1))
    fins = check_all(model, run_in_waves(engine, jobs), jobs, f"seed={seed} triton-interpreter")
    print(sum(f.stats.proposed for f in fins.values()))
