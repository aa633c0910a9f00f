"""Input attribution in the attribution tier: a finished request's stored spec and tokens ->
which prompt and earlier generated tokens made the model commit each target token.

The snapshots are rebuilt, not stored: the request is replayed with the full-recompute reference
decoder (`cde/steerling/reference_decoder.py`: randomness is a function of (seed, position,
step), so the same options give the same commit order), and the replay must reproduce the stored
tokens exactly, else the call fails (FAILED_PRECONDITION: e.g. a generation decoded in bf16 on
a GPU that a float32 replay does not follow token for token). Then integrated gradients from a
MASK baseline on each target's snapshot (`cde/steerling/input_attribution.py`, equal to the
public package's faithful replay; steered requests replay their injection), the targets of one
denoising step and their interpolation points batched (up to 64 rows a forward).

The model is loaded on the first call (the concept-attribution path needs only four embedding
tables; a replica never asked for input attribution never holds the trunk).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator

import torch

from cde import limits as L
from cde.rpc.v1 import attribution_pb2, common_pb2
from cde.steerling.input_attribution import CommitGroup, attribute_at_step, commit_groups, snapshot

DEVICE_ENV = "CDE_ATTRIBUTION_DEVICE"   # where the model runs for input attribution (default cpu)


class InputAttributionError(ValueError):
    """A job that cannot be attributed; `code` is the gRPC status to answer."""

    def __init__(self, message: str, code: str = "INVALID_ARGUMENT"):
        super().__init__(message)
        self.code = code


class InputAttributor:
    def __init__(self, model_dir: str, device: str | None = None):
        self.model_dir = model_dir
        self.device = device or os.environ.get(DEVICE_ENV, "cpu")
        self._model = None
        self._tokenizer_vocab = None
        self._lock = threading.Lock()

    def model(self):
        with self._lock:
            if self._model is None:
                from cde.steerling.loading import load_model
                from cde.steerling.tokenizer import load_model_tokenizer
                model = load_model(self.model_dir, dtype=torch.float32, device=self.device).eval()
                self._tokenizer_vocab = load_model_tokenizer(model.cfg, self.model_dir).vocab_size
                self._model = model
            return self._model

    def run(self, job: attribution_pb2.InputAttributionJob,
            emit: Callable[[common_pb2.InputAttributionEvent], None]) -> None:
        """Attribute the job's targets, calling `emit` with progress, each target, then the summary."""
        from cde.steerling.reference_decoder import generate
        from worker_svc.block_diffusion import prepared_steering
        from worker_svc.request_options import block_diffusion_options
        from worker_svc.validation import BadRequest

        model = self.model()
        cfg = model.cfg
        n_steps = job.n_steps or L.DEFAULT_IG_STEPS
        prompt = list(job.prompt_tokens)
        try:
            options = block_diffusion_options(job, cfg, self._tokenizer_vocab)
            steering = prepared_steering(job.steering, cfg, job.model) if job.HasField("steering") else None
        except BadRequest as e:
            raise InputAttributionError(str(e)) from None
        if not prompt or len(prompt) + options.max_new_tokens > cfg.block_size:
            raise InputAttributionError("the stored request does not fit this model")
        # the replay: the commit order (which tokens each step committed) of the stored generation
        replay = generate(model, prompt, options, steering, tokenizer_vocab_size=self._tokenizer_vocab)
        stored = list(job.generated)
        if replay.sequence[len(prompt):len(prompt) + len(stored)] != stored:
            raise InputAttributionError(
                "replaying the request did not reproduce its stored tokens (it was decoded on another "
                "device or dtype than this float32 replay), so its commit order is unknown", "FAILED_PRECONDITION")
        groups = commit_groups(replay.steps)
        targets = self._targets(job, groups, len(prompt), len(stored))
        try:
            L.check_input_attribution(n_steps, len(targets))
        except L.LimitError as e:
            raise InputAttributionError(e.message if e.message.startswith(e.path) else f"{e.path}: {e.message}") from None
        for event in self._attribute(model, prompt, groups, targets, n_steps, steering, options.max_new_tokens):
            emit(event)

    @staticmethod
    def _targets(job, groups: list[CommitGroup], prompt_len: int, n_generated: int) -> set[int]:
        committed = {p for g in groups for p in g.positions}
        if job.positions:
            bad = [p for p in job.positions if p not in committed or not prompt_len <= p < prompt_len + n_generated]
            if bad:
                raise InputAttributionError(f"positions: {bad[:5]} are not tokens this request's steps committed "
                                            f"(generated positions start at {prompt_len})")
            return set(job.positions)
        if job.chunk_end <= job.chunk_start:
            raise InputAttributionError("positions: give positions or a chunk with chunk_end > chunk_start")
        return {p for p in committed if job.chunk_start <= p < job.chunk_end}

    @staticmethod
    def _attribute(model, prompt: list[int], groups: list[CommitGroup], targets: set[int], n_steps: int,
                   steering, max_new: int) -> Iterator[common_pb2.InputAttributionEvent]:
        cfg = model.cfg
        device = next(model.parameters()).device
        blk = cfg.diff_block_size
        # later blocks are invisible under block-causal attention: the sequence ends with the last target's block
        seq_len = min(len(prompt) + max_new, (max(targets) // blk + 1) * blk)
        total, done, committed = len(targets), 0, 0
        rows: list[torch.Tensor] = []
        yield common_pb2.InputAttributionEvent(progress=common_pb2.InputAttributionProgress(done=0, total=total))
        for g in groups:
            picked = [(p, t) for p, t in zip(g.positions, g.tokens) if p in targets]
            if picked:
                x = snapshot(prompt, seq_len, groups, g.order, cfg.mask_id)
                attr = attribute_at_step(model, torch.tensor(x, device=device), [p for p, _ in picked],
                                         [t for _, t in picked], committed, n_steps, steering).cpu()
                n = len(picked)
                seen = [q for q in range(seq_len) if x[q] != cfg.mask_id]
                for (p, t), a in zip(picked, attr):
                    total_score = float(a.sum())
                    denom = max(abs(total_score), 1e-6) * (1.0 if total_score >= 0 else -1.0)
                    yield common_pb2.InputAttributionEvent(target=common_pb2.TargetAttribution(
                        position=p, token=t, commit_order=g.order,
                        inputs=[common_pb2.InputScore(position=q, token=x[q], score=float(a[q]),
                                                      normalized=float(a[q]) / denom) for q in seen]))
                    rows.append(a[:len(prompt)])
                done += n
                yield common_pb2.InputAttributionEvent(progress=common_pb2.InputAttributionProgress(done=done,
                                                                                                  total=total))
                if done == total:
                    break
            committed += len(g.positions)
        # the package's aggregate_chunk(scope="prompt"): each target by its absolute mass, then the mean
        scoped = torch.stack(rows)
        agg = (scoped / scoped.abs().sum(-1, keepdim=True).clamp(min=1e-8)).mean(0)
        order = torch.argsort(agg, descending=True).tolist()
        yield common_pb2.InputAttributionEvent(summary=common_pb2.InputAttributionSummary(
            prompt=[common_pb2.InputScore(position=i, token=prompt[i], score=float(agg[i])) for i in order],
            targets=total, n_steps=n_steps))
