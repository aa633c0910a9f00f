"""Tensor parallelism inside one worker, over torch.distributed (NCCL on GPUs, gloo on CPUs).

Megatron's split of a transformer layer, per rank r of W:
- attention: q/k/v projections column-parallel (rank r keeps its n_heads / W query heads and
  n_kv_heads / W KV heads, so a paged KV cache on rank r holds only its KV heads), attention
  computed on the local heads, o_proj row-parallel (its input columns for those heads), then one
  all-reduce (sum) of the partial outputs;
- MLP: gate/up column-parallel (intermediate / W), down_proj row-parallel, one all-reduce;
- replicated on every rank: embeddings, the RMSNorms (q/k norms are per head_dim), the LM head
  and so the sampler. Every rank computes the same logits and draws the same tokens (the
  sampler's randomness is a function of (seed, position, step)): no broadcast of samples.
A row-parallel bias is added once, after the reduce. Two all-reduces per layer, as Megatron.

`shard_qwen3(model, group)` / `shard_steerling(model, group)` turn a loaded full model into rank
r's shard in place; the forward (`hidden_states`, any `attend`, the engines' paged attention) is
unchanged, and `local_kv_heads(model)` is what a rank's KV cache holds. LoRA adapters are
refused (R-ISD's adapter would need the same column/row split of its A and B). Steerling: the
steering injection, the concept heads and the LM head act on the full hidden state after the
reduce, replicated, so attribution records and steering are the single-process model's.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn

from cde.qwen3.model import Linear, Qwen3Model
from cde.steerling.model import SteerlingModel


class RowParallel(nn.Module):
    """A projection whose input features are this rank's slice: partial product, all-reduce, bias."""

    def __init__(self, weight: Tensor, bias: Tensor | None, group):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.group = group
        self.has_lora = False

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    def forward(self, x: Tensor, gate: Tensor | None = None) -> Tensor:
        y = nn.functional.linear(x, self.weight)
        dist.all_reduce(y, group=self.group)
        return y if self.bias is None else y + self.bias


def _linear_of(weight: Tensor, bias: Tensor | None = None, cls: type[nn.Linear] = nn.Linear) -> nn.Linear:
    """A `cls` projection holding copies of `weight` (out, in) and `bias`."""
    out = cls(weight.shape[1], weight.shape[0], bias=bias is not None).to(weight.device, weight.dtype)
    with torch.no_grad():
        out.weight.copy_(weight)
        if bias is not None:
            out.bias.copy_(bias)
    return out


def _rows(lin: Linear, start: int, end: int) -> Linear:
    """Output rows [start, end) of a Qwen3 projection (column-parallel)."""
    return _linear_of(lin.weight[start:end], None if lin.bias is None else lin.bias[start:end], Linear)


def _check_divisible(world: int, **sizes: int) -> None:
    if any(n % world for n in sizes.values()):
        named = ", ".join(f"{k} ({v})" for k, v in sizes.items())
        raise ValueError(f"tensor parallel over {world} ranks needs {named} divisible by {world}")


def check_shardable(cfg, world: int) -> None:
    """ValueError unless a Qwen3 config's heads, KV heads and MLP width split evenly over `world` ranks."""
    _check_divisible(world, n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads, intermediate=cfg.intermediate)


def shard_qwen3(model: Qwen3Model, group=None) -> Qwen3Model:
    """This rank's tensor-parallel shard of `model` (in place; returns it)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    cfg = model.cfg
    check_shardable(cfg, world)
    if any(m.has_lora for m in model.lora_modules().values()):
        raise ValueError("tensor parallel with a LoRA adapter attached is not supported")
    hd = cfg.head_dim
    nq, nkv, ni = cfg.n_heads // world, cfg.n_kv_heads // world, cfg.intermediate // world
    for layer in model.model.layers:
        a, m = layer.self_attn, layer.mlp
        a.qkv = m.gate_up = None   # the fused views belong to the full weights
        a.q_proj = _rows(a.q_proj, rank * nq * hd, (rank + 1) * nq * hd)
        a.k_proj = _rows(a.k_proj, rank * nkv * hd, (rank + 1) * nkv * hd)
        a.v_proj = _rows(a.v_proj, rank * nkv * hd, (rank + 1) * nkv * hd)
        a.o_proj = RowParallel(a.o_proj.weight[:, rank * nq * hd:(rank + 1) * nq * hd].clone(),
                               a.o_proj.bias, group)
        a.n_heads, a.n_kv = nq, nkv
        m.gate_proj = _rows(m.gate_proj, rank * ni, (rank + 1) * ni)
        m.up_proj = _rows(m.up_proj, rank * ni, (rank + 1) * ni)
        m.down_proj = RowParallel(m.down_proj.weight[:, rank * ni:(rank + 1) * ni].clone(), m.down_proj.bias, group)
    model.tp = (rank, world)
    return model


def shard_steerling(model: SteerlingModel, group=None) -> SteerlingModel:
    """This rank's tensor-parallel shard of a Steerling model (in place; returns it): c_attn's
    q / k / v rows of its heads, c_fc's up and gate rows of its slice, both c_proj row-parallel."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    cfg = model.cfg
    inter = cfg.intermediate_size
    _check_divisible(world, n_head=cfg.n_head, n_kv_heads=cfg.n_kv_heads, intermediate_size=inter)
    hd = cfg.head_dim
    nq, nkv, ni = cfg.n_head // world, cfg.n_kv_heads // world, inter // world
    q0, k0, v0 = 0, cfg.n_head * hd, cfg.n_head * hd + cfg.n_kv_heads * hd
    for block in model.transformer.blocks:
        a, m = block.attn, block.mlp
        w = a.c_attn.weight
        a.c_attn = _linear_of(torch.cat([w[q0 + rank * nq * hd:q0 + (rank + 1) * nq * hd],
                                         w[k0 + rank * nkv * hd:k0 + (rank + 1) * nkv * hd],
                                         w[v0 + rank * nkv * hd:v0 + (rank + 1) * nkv * hd]]))
        a.c_proj = RowParallel(a.c_proj.weight[:, rank * nq * hd:(rank + 1) * nq * hd].clone(), None, group)
        a.n_head, a.n_kv = nq, nkv
        w = m.c_fc.weight   # (up, gate)
        m.c_fc = _linear_of(torch.cat([w[rank * ni:(rank + 1) * ni], w[inter + rank * ni:inter + (rank + 1) * ni]]))
        m.c_proj = RowParallel(m.c_proj.weight[:, rank * ni:(rank + 1) * ni].clone(), None, group)
    model.tp = (rank, world)
    return model


def local_kv_heads(model) -> int:
    """KV heads a rank's cache holds: the model's, over its tensor-parallel ranks."""
    world = getattr(model, "tp", (0, 1))[1]
    return model.cfg.n_kv_heads // world
