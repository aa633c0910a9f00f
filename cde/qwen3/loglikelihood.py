"""Log-probabilities of given tokens under a causal model: what `echo` + `logprobs` on
/v1/completions return for the prompt, and lm-eval's `loglikelihood`.

A causal model factorises left to right, so this is exact: the log-softmax (float32) of the
logits at position i - 1, read at token i. `token_logprobs` gives each token after the first its
logprob and its `top` most likely tokens (the first token has none: nothing predicts it, as
OpenAI's echo reports null for it); `loglikelihood` sums the continuation's and says whether
every continuation token is the argmax (lm-eval's ``is_greedy``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from cde.qwen3.model import Qwen3Model


@dataclass(frozen=True)
class TokenLogprob:
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]   # (token, logprob), most likely first
    greedy: bool                          # the token is the argmax (ties: torch's first index)


@torch.no_grad()
def _log_probs(model: Qwen3Model, tokens: list[int]) -> Tensor:
    """(T - 1, V) float32: row i is the distribution of token i + 1."""
    device = next(model.parameters()).device
    ids = torch.tensor([tokens], dtype=torch.long, device=device)
    return torch.log_softmax(model(ids)[0, :-1].float(), dim=-1)


def token_logprobs(model: Qwen3Model, tokens: list[int], top: int = 0) -> list[TokenLogprob | None]:
    """Per token: None for the first, else its logprob given the tokens before it and the `top`
    most likely tokens there."""
    if not tokens:
        return []
    if top < 0:
        raise ValueError(f"top must be >= 0, got {top}")
    lp = _log_probs(model, tokens)
    target = torch.tensor(tokens[1:], device=lp.device)
    chosen = lp.gather(1, target[:, None])[:, 0].tolist()
    greedy = (lp.argmax(-1) == target).tolist()
    k = min(top, lp.shape[-1])
    top_v, top_i = lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long())
    out: list[TokenLogprob | None] = [None]
    for t, c, g, vs, ids in zip(tokens[1:], chosen, greedy, top_v.tolist(), top_i.tolist()):
        out.append(TokenLogprob(t, c, tuple(zip(ids, vs)), g))
    return out


def loglikelihood(model: Qwen3Model, context: list[int], continuation: list[int]) -> tuple[float, bool]:
    """(sum of the continuation's logprobs given the context, every continuation token greedy).
    The context needs a token (lm-eval prepends the end-of-text token to an empty one)."""
    if not context:
        raise ValueError("context must hold at least one token: nothing predicts the first continuation token")
    if not continuation:
        return 0.0, True
    rows = token_logprobs(model, list(context) + list(continuation))[len(context):]
    return sum(r.logprob for r in rows), all(r.greedy for r in rows)
