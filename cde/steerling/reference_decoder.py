"""The reference block-diffusion decoder: plain, full recompute, one request at a time.

It is the oracle the fast engine must match token for token, so it favours obviousness:
every step runs the whole sequence (prompt + committed + current block) through the
model with a dense block-causal mask; nothing is cached.

Decode blocks are aligned to 64-token attention blocks: the first decode block starts at
floor(L / 64) * 64, and the prompt's partial last block stays fixed inside it. Within a
block, each step scores the masked positions, commits the `tokens_per_step` most confident
ones (in threshold mode: those of them at or above the threshold, at least one), and samples each
with the Steerling sampler. Randomness comes from (seed, position, step) only. When the
prompt length is a multiple of 64 this is the public package's `generate_full`.

Stops: `<|eot_id|>` ends generation at once (later positions become EOS, as the reference
does); other stop ids end it after the block that contains them. Output tokens are the
generated positions in order, skipping still-masked and EOS positions, cut at the first
terminal token.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from cde.options import DecodeOptions
from cde.steerling.attribution import RawRecords
from cde.steerling.model import KnownIntervention, SteeringInputs, SteerlingModel, dense_block_causal_attend
from cde.steerling.sampling import (adjust_logits, banned_ids, choose_tokens, confidence,
                                    counter_uniform, most_confident)
from cde.steerling.steering import PreparedSteering, resolve_alpha


@dataclass
class StepEvent:
    step: int
    block: int
    positions: list[int]
    tokens: list[int]


@dataclass
class CommittedBlock:
    block: int                  # absolute block index (start // 64)
    start: int                  # first generated position in this block
    end: int                    # one past the last position of this block in the sequence
    tokens: list[int]           # sequence[start:end] when the block closed (mask ids = never committed)
    records: RawRecords         # one row per committed token, in commit order


@dataclass
class GenerationResult:
    prompt_len: int
    sequence: list[int]
    output_tokens: list[int]
    finish_reason: str          # "stop" | "length"
    steps: list[StepEvent] = field(default_factory=list)
    blocks: list[CommittedBlock] = field(default_factory=list)
    # position -> (logprob, top ids, their logprobs): each committed token's log-softmax over the
    # raw logits at the step that committed it, and the 20 most likely ids there
    logprobs: dict[int, tuple[float, list[int], list[float]]] = field(default_factory=dict)

    @property
    def records(self) -> RawRecords:
        return RawRecords.cat([b.records for b in self.blocks if len(b.records)])


# choose(positions (n,), adjusted rows (n, V), uniforms (n,)) -> tokens (n,); tests use it to
# replay another sampler's choices.
ChooseFn = Callable[[Tensor, Tensor, Tensor], Tensor]


LOGPROB_ALTERNATIVES = 20   # top ids recorded per committed token (cde/limits.py's TOP_LOGPROBS_MAX)


def terminal_ids(cfg, options: DecodeOptions) -> set[int]:
    ids = set(options.stop_ids)
    if cfg.eot_id is not None:
        ids.add(cfg.eot_id)
    return ids


@torch.inference_mode()
def generate(
    model: SteerlingModel,
    prompt: list[int],
    options: DecodeOptions,
    steering: PreparedSteering | None = None,
    intervention: tuple[list[int], list[float]] | None = None,
    tokenizer_vocab_size: int | None = None,
    choose: ChooseFn | None = None,
    constraint=None,
) -> GenerationResult:
    cfg = model.cfg
    dev = model.transformer.tok_emb.weight.device
    blk = cfg.diff_block_size
    if not prompt:
        raise ValueError("prompt must contain at least one token")
    prompt_len = len(prompt)
    gen_end = prompt_len + options.max_new_tokens
    if gen_end > cfg.block_size:
        raise ValueError(f"prompt + max_new_tokens = {gen_end} exceeds the context of {cfg.block_size}")

    seq = torch.tensor(list(prompt) + [cfg.mask_id] * options.max_new_tokens, dtype=torch.long, device=dev)
    seen = torch.zeros(cfg.vocab_size, dtype=torch.bool, device=dev)
    seen[seq] = True
    banned = banned_ids(cfg, tokenizer_vocab_size, dev)
    rep = torch.tensor([options.sampling.repetition_penalty], device=dev)
    stops = terminal_ids(cfg, options)
    seed = torch.tensor([options.seed], device=dev)
    iv = None
    if intervention is not None:
        iv = KnownIntervention(torch.tensor([intervention[0]], device=dev),
                               torch.tensor([intervention[1]], device=dev, dtype=torch.float32))

    relu = steering.relu_mask.to(dev) if steering is not None and steering.relu_mask is not None else None
    result = GenerationResult(prompt_len, [], [], "length")
    committed = 0
    step = 0
    done = False
    block_start = (prompt_len // blk) * blk
    while block_start < gen_end and not done:
        block_end = min(block_start + blk, gen_end)
        parts: list[RawRecords] = []
        while not done:
            masked = (seq[block_start:block_end] == cfg.mask_id).nonzero().squeeze(1) + block_start
            if masked.numel() == 0:
                break
            if constraint is not None:   # structured output: the leftmost masked position only
                masked = masked[:1]
            tokens = seq[:block_end][None]
            positions = torch.arange(block_end, device=dev)[None]
            steer_in = None
            if steering is not None:
                alpha = resolve_alpha(steering.schedule, steering.base_alpha, committed, steering.cutoff_tokens)
                steer_in = SteeringInputs(steering.direction[None], torch.tensor([alpha], device=dev),
                                          (tokens == cfg.mask_id).float(),
                                          torch.tensor([steering.inject_layer], device=dev))
            h = model.hidden_states(tokens, positions, dense_block_causal_attend(positions, blk), steer_in)
            rows_h = h[0, masked]
            heads = model.heads(rows_h, None if iv is None else KnownIntervention(
                iv.ids.expand(len(masked), -1), iv.values.expand(len(masked), -1)),
                None if iv is None else torch.ones(len(masked), dtype=torch.bool, device=dev))
            adjusted = adjust_logits(heads.logits, seen[None].expand(len(masked), -1), rep.expand(len(masked)),
                                     cfg.eos_id, banned, relu)
            if constraint is not None:
                adjusted = adjusted.masked_fill(~torch.from_numpy(constraint.allowed()).to(dev), float("-inf"))
            conf = confidence(adjusted)
            sel = most_confident(conf, min(options.tokens_per_step, masked.numel()))[1]
            if options.confidence_threshold is not None:
                # at least the most confident position, then those at or above the threshold
                n_sel = max(1, int((conf[sel] >= options.confidence_threshold).sum()))
                sel = sel[:n_sel]
            sel_pos = masked[sel]
            u = counter_uniform(seed.expand(len(sel)), sel_pos, torch.full_like(sel_pos, step))
            if choose is None:
                picked = choose_tokens(adjusted[sel], [options.sampling] * len(sel), u)
            else:
                picked = choose(sel_pos, adjusted[sel], u)
            event = StepEvent(step, block_start // blk, [], [])
            keep = []
            for i in range(len(sel)):
                pos, tok = int(sel_pos[i]), int(picked[i])
                seq[pos] = tok
                seen[tok] = True
                if constraint is not None:
                    constraint.advance(tok)
                committed += 1
                event.positions.append(pos)
                event.tokens.append(tok)
                keep.append(i)
                if cfg.eot_id is not None and tok == cfg.eot_id:
                    seq[pos + 1:gen_end] = cfg.eos_id
                    done = True
                    result.finish_reason = "stop"
                    break
            k = torch.tensor(keep, device=dev)
            rows = sel[k]
            logp = heads.logits[rows].float().log_softmax(-1)
            top_v, top_i = logp.topk(min(LOGPROB_ALTERNATIVES, logp.shape[-1]), -1)
            for j in range(len(keep)):
                result.logprobs[int(sel_pos[k][j])] = (float(logp[j, picked[k][j]]), top_i[j].tolist(), top_v[j].tolist())
            parts.append(RawRecords(
                positions=sel_pos[k], tokens=picked[k],
                target_logits=heads.logits[rows, picked[k]].float(),
                known_idx=heads.known_idx[rows], known_logits=heads.known_logits[rows],
                disc_idx=heads.disc_idx[rows], disc_logits=heads.disc_logits[rows],
            ))
            result.steps.append(event)
            step += 1
        first = max(block_start, prompt_len)
        result.blocks.append(CommittedBlock(block_start // blk, first, block_end,
                                            seq[first:block_end].tolist(), RawRecords.cat(parts) if parts else
                                            _empty_records(cfg, dev)))
        if not done and any(int(t) in stops for t in seq[prompt_len:block_end].tolist()):
            done = True
            result.finish_reason = "stop"
        block_start += blk

    result.sequence = seq.tolist()
    result.output_tokens = clean_output(result.sequence[prompt_len:], cfg, stops)
    return result


def clean_output(generated: list[int], cfg, stops: set[int]) -> list[int]:
    out = []
    for t in generated:
        if t in (cfg.mask_id, cfg.eos_id):
            continue
        if t in stops:
            break
        out.append(t)
    return out


def _empty_records(cfg, dev) -> RawRecords:
    z = torch.zeros(0, dtype=torch.long, device=dev)
    f = torch.zeros(0, device=dev)
    kk = min(cfg.topk_known, cfg.n_known)
    return RawRecords(z, z, f, z.reshape(0, kk), f.reshape(0, kk),
                      z.reshape(0, min(cfg.topk_discovered, cfg.n_discovered)),
                      f.reshape(0, min(cfg.topk_discovered, cfg.n_discovered)))
