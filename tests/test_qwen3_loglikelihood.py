"""cde/qwen3/loglikelihood.py against transformers' Qwen3 on the same random weights: each
token's logprob and top tokens equal the log-softmax of transformers' logits, and lm-eval's
loglikelihood (sum over the continuation, is_greedy) follows from them."""

from __future__ import annotations

import random

import pytest
import torch
import transformers

from cde.qwen3.loading import load_qwen3
from cde.qwen3.loglikelihood import loglikelihood, token_logprobs

VOCAB = 256


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    seed = 20261204
    cfg = transformers.Qwen3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=4096, rms_norm_eps=1e-6,
        tie_word_embeddings=False, attn_implementation="eager")
    torch.manual_seed(seed)
    hf = transformers.Qwen3ForCausalLM(cfg).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen) if name.endswith("norm.weight")
                    else 0.3 * torch.randn(p.shape, generator=gen))
    path = tmp_path_factory.mktemp("qwen3")
    hf.save_pretrained(path, safe_serialization=True)
    return hf, load_qwen3(path, torch.float32, "cpu")


@pytest.mark.parity
def test_token_logprobs_and_top_equal_transformers(pair, seed):
    hf, ours = pair
    rng = random.Random(seed)
    for _ in range(3):
        tokens = [rng.randrange(VOCAB) for _ in range(rng.randint(2, 40))]
        top = rng.choice([0, 1, 5])
        with torch.no_grad():
            want = torch.log_softmax(hf(input_ids=torch.tensor([tokens])).logits[0].double(), -1)
        got = token_logprobs(ours, tokens, top=top)
        assert got[0] is None and len(got) == len(tokens), f"seed={seed}"
        for i, row in enumerate(got[1:], start=1):
            tag = f"seed={seed} tokens={tokens} position {i}"
            assert row.token == tokens[i] and abs(row.logprob - float(want[i - 1, tokens[i]])) < 1e-4, tag
            assert row.greedy == (int(want[i - 1].argmax()) == tokens[i]), tag
            # the top tokens, most likely first (an order between near-ties may differ from float64's)
            assert len(row.top) == top and len({t for t, _ in row.top}) == top, tag
            assert all(abs(v - float(want[i - 1, t])) < 1e-4 for t, v in row.top), tag
            assert [v for _, v in row.top] == sorted((v for _, v in row.top), reverse=True), tag
            if top:
                kth = float(want[i - 1].topk(top).values[-1])
                assert min(v for _, v in row.top) >= kth - 1e-4, tag


@pytest.mark.parity
def test_loglikelihood_sums_the_continuation_and_detects_greedy(pair, seed):
    hf, ours = pair
    rng = random.Random(seed)
    context = [rng.randrange(VOCAB) for _ in range(9)]
    continuation = [rng.randrange(VOCAB) for _ in range(6)]
    with torch.no_grad():
        lp = torch.log_softmax(hf(input_ids=torch.tensor([context + continuation])).logits[0].double(), -1)
    want = sum(float(lp[len(context) - 1 + j, t]) for j, t in enumerate(continuation))
    got, greedy = loglikelihood(ours, context, continuation)
    assert abs(got - want) < 1e-3, f"seed={seed}: {got} vs {want}"
    # the greedy continuation, built token by token with transformers, is greedy
    seq = list(context)
    for _ in range(5):
        with torch.no_grad():
            seq.append(int(hf(input_ids=torch.tensor([seq])).logits[0, -1].argmax()))
    ll, greedy = loglikelihood(ours, context, seq[len(context):])
    assert greedy and ll < 0, f"seed={seed}: {seq}"
    assert loglikelihood(ours, context, []) == (0.0, True)
    with pytest.raises(ValueError, match="context"):
        loglikelihood(ours, [], [1, 2])
    with pytest.raises(ValueError, match="top"):
        token_logprobs(ours, [1, 2], top=-1)
