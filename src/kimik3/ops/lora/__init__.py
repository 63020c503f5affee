"""LoRA math: the batched per-row update for serving many adapters (`lora_delta`), and routed experts with LoRA
factors over their frozen MXFP4 weights, as containers `kimik3.ops.moe.routed_experts` computes with.

    lora_delta(x, adapter, lora_a, lora_b, scale)   CUDA bf16 (unless `use_backend("torch")`): `.grouped`, two
                                                    `torch._grouped_mm`, no host sync; else `.reference`
    LoraWeights      one adapter on every expert's w1, w3, w2 (training: gradients for z and the factors):
                     `.experts_grouped` (a grouped GEMM per projection) on CUDA with Triton, else `.experts`
    AdapterWeights   K adapters over one batch, one per token (serving): `.experts`' per-expert loop
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from kimik3.ops.backend import has_triton, use_fast
from kimik3.ops.lora import reference
from kimik3.ops.moe import PackedWeights

__all__ = ["AdapterWeights", "LoraWeights", "lora_delta"]

Triple = tuple[Tensor, Tensor, Tensor]  # (w1, w3, w2)


def lora_delta(x: Tensor, adapter: Tensor, lora_a: Tensor, lora_b: Tensor, scale: Tensor) -> Tensor:
    """The LoRA update of each row under its own adapter; the base GEMM (shared by every row) is the caller's.

    Args:
        x: [N, I] rows (compute dtype).
        adapter: [N] int64 adapter of each row, -1 for none.
        lora_a: [K, R, I], lora_b: [K, O, R] the K adapters' factors (cast to x.dtype; a smaller rank is
            zero-padded to R).
        scale: [K] fp32 each adapter's alpha / rank.

    Returns:
        [N, O] in x.dtype: scale[k] * (x A_k^T) B_k^T for a row of adapter k, exactly 0 for a row of none.
    """
    if use_fast(x, "lora") and x.dtype == torch.bfloat16:
        from kimik3.ops.lora import grouped

        return grouped.lora_delta(x, adapter, lora_a, lora_b, scale)
    return reference.lora_delta(x, adapter, lora_a, lora_b, scale)


@dataclass(frozen=True)
class LoraWeights:
    """Packed experts plus one adapter: lora_a (A1 [E', R, L], A3 [E', R, L], A2 [E', R, F]), lora_b (B1 [E', F, R],
    B3 [E', F, R], B2 [E', L, R]), E' = E (per expert) or 1 (shared by the layer's experts); scale = alpha / R.
    Forward, and backward for z and the factors only (`kimik3.ops.lora.experts` has the math)."""
    base: PackedWeights
    lora_a: Triple
    lora_b: Triple
    scale: float

    def routed(self, z: Tensor, topk_idx: Tensor, topk_weight: Tensor, beta: float, linear_beta: float) -> Tensor:
        args = (self.base.packed, self.base.scales, self.lora_a, self.lora_b, self.scale, beta, linear_beta)
        if use_fast(z, "lora") and has_triton():
            from kimik3.ops.lora import experts_grouped

            if experts_grouped.supports(z, self.lora_a):
                return experts_grouped.routed_experts_mxfp4_lora(z, topk_idx, topk_weight, *args)
        from kimik3.ops.lora import experts

        return experts.routed_experts_mxfp4_lora(z, topk_idx, topk_weight, *args)


@dataclass(frozen=True)
class AdapterWeights:
    """Packed experts plus K adapters for serving: `adapter(N)` gives each of the call's N tokens its adapter
    ([N] int64, -1 for none) or None (no token has one: the base alone, bit for bit); lora_a, lora_b the K
    adapters' factors per projection, [K, E, R, in] and [K, E, out, R]; scale [K] fp32 each adapter's alpha / rank.
    Each expert's base matmul is shared by all its tokens, the adapters' updates grouped per adapter."""
    base: PackedWeights
    adapter: Callable[[int], Tensor | None]
    lora_a: Triple
    lora_b: Triple
    scale: Tensor

    def routed(self, z: Tensor, topk_idx: Tensor, topk_weight: Tensor, beta: float, linear_beta: float) -> Tensor:
        index = self.adapter(z.shape[0])
        if index is None:
            return self.base.routed(z, topk_idx, topk_weight, beta, linear_beta)
        from kimik3.ops.lora import experts

        return experts.routed_experts_mxfp4_adapters(z, topk_idx, topk_weight, self.base.packed, self.base.scales,
                                                     index, self.lora_a, self.lora_b, self.scale, beta, linear_beta)
