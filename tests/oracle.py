"""Build Guide Labs' public `steerling` model (the oracle) from one of our configs.

Imported only by parity tests; the package is installed by scripts/test.sh.
"""

from __future__ import annotations

import torch

from cde.steerling.config import SteerlingConfig


def oracle_configs(cfg: SteerlingConfig):
    from steerling.configs.causal_diffusion import CausalDiffusionConfig
    from steerling.configs.concept import ConceptConfig

    model_cfg = CausalDiffusionConfig(
        n_layers=cfg.n_layers, n_head=cfg.n_head, n_embd=cfg.n_embd, block_size=cfg.block_size,
        n_kv_heads=cfg.n_kv_heads, diff_block_size=cfg.diff_block_size, rope_base=cfg.rope_base,
        norm_eps=cfg.norm_eps, clip_qkv=cfg.clip_qkv, mlp_ratio=cfg.mlp_ratio,
    )
    concept_cfg = ConceptConfig(
        n_concepts=cfg.n_known, n_unknown_concepts=cfg.n_discovered, concept_dim=cfg.n_embd,
        topk_known=cfg.topk_known, topk_known_features=cfg.topk_known,
        factorize_rank=cfg.factorize_rank, unknown_topk=cfg.topk_discovered,
        block_size=cfg.concept_chunk, pad_multiple=cfg.pad_multiple,
    )
    return model_cfg, concept_cfg


def build_oracle(cfg: SteerlingConfig, seed: int):
    """The oracle model with its own random init (seeded), in eval mode, fp32."""
    from steerling.models.interpretable.interpretable_causal_diffusion import InterpretableCausalDiffusionLM

    torch.manual_seed(seed)
    model_cfg, concept_cfg = oracle_configs(cfg)
    model = InterpretableCausalDiffusionLM(model_cfg, concept_cfg, cfg.vocab_size).eval()
    # The oracle's own init leaves most Linear layers at PyTorch defaults; give every weight a
    # fresh N(0, 0.05) (norm weights perturbed around 1) so the test exercises real values.
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or ".ln_" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.05 * torch.randn(p.shape, generator=gen))
    return model


def assert_same_topk(idx_a, lg_a, idx_b, lg_b, atol=1e-5):
    """Same concepts with the same logits (<= atol). The two paths round differently in the
    last bit, so concepts whose logits tie within atol may swap order, or swap in and out at
    the k-th place; anything else is a real difference."""
    assert idx_a.shape == idx_b.shape
    for ia, la, ib, lb in zip(idx_a.tolist(), lg_a.tolist(), idx_b.tolist(), lg_b.tolist()):
        ma, mb = dict(zip(ia, la)), dict(zip(ib, lb))
        for c in ma.keys() & mb.keys():
            assert abs(ma[c] - mb[c]) <= atol, (c, ma[c], mb[c])
        boundary = min(min(la), min(lb))
        for c in ma.keys() ^ mb.keys():
            assert abs(ma.get(c, mb.get(c)) - boundary) <= atol, (c, boundary)
        # order: descending logits up to ties within atol
        for seq in (la, lb):
            assert all(x >= y - atol for x, y in zip(seq, seq[1:]))


def assert_close_to_rounding(got, want, dtype) -> None:
    """A fused (compiled) kernel against its eager self. fp32: 1e-5. bf16: the two may round
    intermediates differently (eager casts to bf16 between ops, a fused kernel may not), and RoPE's
    products can cancel, so the error is bounded by a few bf16 ulps of the largest value, not of each
    element: atol = 2**-5 * max|want| (8 ulps at the top; 600 random cases stayed under 3.5), rtol 2e-2."""
    import torch

    if dtype == torch.bfloat16:
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2 ** -5 * float(want.float().abs().max()))
    else:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
