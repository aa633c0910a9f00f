"""FP8 (e4m3) weights for the trunk's linear layers: per-output-channel weight scales, per-token
activation scales, fp32 accumulation.

`Fp8Linear` replaces an `nn.Linear`: its weight is stored as e4m3 with one fp32 scale per output
row (w ~= q * s_w), and each call quantizes its input per token the same way (x ~= p * s_x), so
y = (p q^T) * s_x s_w^T. On a CUDA device with FP8 tensor cores (H100 / H200) that is one
`torch._scaled_mm` with row-wise scales; elsewhere (CPU, tests) the same quantized operands are
multiplied in fp32 after dequantization, so both compute one product up to summation order.
`to_fp8` converts a model's trunk projections, for both families: Steerling's attention and MLP
projections, and a Qwen3 / I-DLM model's q/k/v/o and gate/up/down (fused afterwards like the dense
ones: row-wise scales make the fused e4m3 GEMM the separate ones' exact concatenation). The LM head,
the embeddings and the concept heads stay in the model's dtype (attribution is computed on them, so
its identity stays exact).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0   # largest finite e4m3 value


def quantize_rows(x: Tensor) -> tuple[Tensor, Tensor]:
    """Rows of `x` (..., K) as e4m3 and their fp32 scales (..., 1): x ~= q * scale, each row's
    largest magnitude mapped to 448."""
    xf = x.float()
    scale = xf.abs().amax(-1, keepdim=True).clamp(min=1e-12) / E4M3_MAX
    return (xf / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3), scale


def _scaled_mm_ok(x: Tensor) -> bool:
    if not x.is_cuda or not hasattr(torch, "_scaled_mm"):
        return False
    major, minor = torch.cuda.get_device_capability(x.device)
    return (major, minor) >= (8, 9)


class Fp8Linear(nn.Module):
    """An `nn.Linear` (no bias) with e4m3 weights; out dtype = the input's. It also stands in for
    a Qwen3 projection without an adapter (`forward(x, gate)` ignores the gate as an adapter-less
    `cde.qwen3.model.Linear` does; adapters are merged before conversion)."""

    has_lora = False

    def __init__(self, weight: Tensor):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        q, s = quantize_rows(weight.detach())
        self.register_buffer("qweight", q)                     # (N, K) e4m3
        self.register_buffer("scale", s.reshape(1, -1))        # (1, N) fp32

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "Fp8Linear":
        if linear.bias is not None:
            raise ValueError("Fp8Linear takes projections without bias")
        return cls(linear.weight)

    @classmethod
    def concat(cls, parts: "list[Fp8Linear]") -> "Fp8Linear":
        """One module whose rows are `parts`' rows in order (their e4m3 rows and scales, not
        requantized), and each part's buffers become views of it (no second copy)."""
        fused = cls.__new__(cls)
        nn.Module.__init__(fused)
        fused.in_features = parts[0].in_features
        if any(p.in_features != fused.in_features for p in parts):
            raise ValueError("Fp8Linear.concat: parts differ in in_features")
        fused.out_features = sum(p.out_features for p in parts)
        fused.register_buffer("qweight", torch.cat([p.qweight for p in parts]))
        fused.register_buffer("scale", torch.cat([p.scale for p in parts], dim=1))
        start = 0
        for p in parts:
            p.qweight = fused.qweight[start:start + p.out_features]
            p.scale = fused.scale[:, start:start + p.out_features]
            start += p.out_features
        return fused

    def dequantized(self) -> Tensor:
        """The weight as the product sees it (fp32)."""
        return self.qweight.float() * self.scale.reshape(-1, 1)

    def forward(self, x: Tensor, gate: Tensor | None = None) -> Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        xq, xs = quantize_rows(x2)
        if _scaled_mm_ok(x) and x.dtype in (torch.bfloat16, torch.float16):
            y = torch._scaled_mm(xq, self.qweight.t(), scale_a=xs, scale_b=self.scale, out_dtype=x.dtype)
        else:
            # emulated: fp32 products, float64 for a float64 model (its GEMM rounding then stays far
            # below what could move an activation across an e4m3 rounding boundary between batch shapes)
            acc = torch.float64 if x.dtype == torch.float64 else torch.float32
            y = F.linear(xq.to(acc) * xs.to(acc), self.dequantized().to(acc)).to(x.dtype)
        return y.reshape(*lead, self.out_features)


STEERLING_PROJECTIONS = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
QWEN3_PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                     "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def to_fp8(model: nn.Module) -> int:
    """Replace every trunk block's projections with `Fp8Linear`, in place; returns how many were
    converted. The dense weights are freed. Steerling models (transformer.blocks) and Qwen3 /
    I-DLM models (model.layers; any fused q/k/v and gate/up views are dropped first, so a later
    `fuse_projections` fuses the e4m3 modules). A Qwen3 layer with an adapter attached is refused:
    merge it first (the served models merge theirs at load)."""
    blocks = getattr(getattr(model, "transformer", None), "blocks", None)
    if blocks is not None:
        return _convert(blocks, STEERLING_PROJECTIONS)
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise ValueError("to_fp8 converts Steerling (transformer.blocks) and Qwen3 (model.layers) models")
    for layer in layers:
        if any(getattr(layer.get_submodule(p), "has_lora", False) for p in QWEN3_PROJECTIONS):
            raise ValueError("to_fp8: a layer has a LoRA adapter attached; merge it before converting")
        layer.self_attn.qkv = layer.mlp.gate_up = None
    return _convert(layers, QWEN3_PROJECTIONS)


def _convert(blocks, projections: tuple[str, ...]) -> int:
    n = 0
    for block in blocks:
        for path in projections:
            parent_name, _, leaf = path.rpartition(".")
            parent = block.get_submodule(parent_name) if parent_name else block
            lin = getattr(parent, leaf)
            if isinstance(lin, nn.Linear):
                setattr(parent, leaf, Fp8Linear.from_linear(lin))
                n += 1
    return n
