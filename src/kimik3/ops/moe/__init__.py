"""Routed-expert computation of the latent MoE: one public function over any container of the experts' weights.

Legend: N tokens, A active experts per token, E experts, L latent width, F expert width.

    routed_experts(z [N, L], topk_idx [N, A], topk_weight [N, A], experts, beta, linear_beta) -> [N, L]

`experts` holds the weights and says how they are held; its `routed` method runs the call (the seam DeepSeek's
`linear()` is for quantized weights: one call site in `LatentMoE`, the choice made here, by the container):
    DenseWeights        stacked bf16/fp32 experts: three `torch._grouped_mm` on CUDA bf16 (`.grouped`,
                        differentiable), else `.reference`
    PackedWeights       MXFP4 stored bytes (W4A16): a W4A16 backend on CUDA bf16/fp16 (inference), else
                        `.reference`, which decodes each expert exactly (equal to DenseWeights of the decoded weights)
    RelaidWeights       Humming's layout (`kimik3.quant.relayout_experts`, inference on Hopper): Humming only
    TieredWeights       `.tiered`: every expert in host memory, the hot ones in a device cache of slots
                        (`kimik3.placement.tier_experts`)
    LoraWeights, AdapterWeights (`kimik3.ops.lora`): LoRA over packed experts, trained or served per row;
    expert parallelism's container (`kimik3.distributed.expert_parallel`): experts sharded over ranks.

The W4A16 backend, imported on first use:
    humming  Humming's MoE GEMM (`.humming`; the `gpu` extra's humming-kernels) where it can run: bf16 z on a
             compute capability 9.x device, L a multiple of 256 and F of 128 (K3's widths); faster than ours at
             every size measured (BENCHMARKS.md, MoE).
    triton   our Triton kernels (`.triton_mxfp4`): for fp16, other GPUs, other widths, stored bytes and the tiers.
Humming wants its own weight layout: `RelaidWeights` is experts already re-laid out (one copy); `PackedWeights`
runs Triton, or Humming on a second copy kept beside the stored bytes when forced.
`kimik3.ops.backend.use_backend(moe=...)` picks (the CLI sets it once from KIMIK3_MOE_BACKEND):
    auto     (default) re-laid-out experts where Humming can run; stored bytes run Triton (no second copy)
    humming  as auto, and stored bytes run Humming on a second copy; where Humming cannot run it is an error that
             says why, not a silent fallback
    triton   never Humming
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from functools import cache
from typing import Protocol

import torch
from torch import Tensor

from kimik3.ops.backend import MOE_BACKENDS, has_triton, moe_backend, use_fast
from kimik3.ops.moe import reference

__all__ = ["DenseWeights", "ExpertWeights", "PackedWeights", "RelaidWeights", "routed_experts", "experts_backend",
           "compile_relaid", "warm_relaid", "MOE_BACKENDS"]

Triple = tuple[Tensor, Tensor, Tensor]  # (w1, w3, w2)


class ExpertWeights(Protocol):
    """What `routed_experts` computes with: the weights, and how the call runs on them."""

    def routed(self, z: Tensor, topk_idx: Tensor, topk_weight: Tensor, beta: float, linear_beta: float) -> Tensor:
        ...


def routed_experts(z: Tensor, topk_idx: Tensor, topk_weight: Tensor, experts: ExpertWeights, beta: float,
                   linear_beta: float) -> Tensor:
    """Run each token through its selected experts and combine them.

    Args:
        z: [N, L] latent tokens (compute dtype).
        topk_idx: [N, A] int64 selected experts, in [0, E) (not checked: that would need the host).
        topk_weight: [N, A] fp32 combine weights (already renormalized and scaled).
        experts: the E experts' weights (see the module docstring).
        beta, linear_beta: SiTU constants.

    Returns:
        [N, L] in `z.dtype`: sum over the A experts of weight * expert output, accumulated in fp32 after each
        expert's output is rounded to the compute dtype. Each expert computes w2(SiTU([w1 z | w3 z])), its matmuls
        rounded to the compute dtype.
    """
    return experts.routed(z, topk_idx, topk_weight, beta, linear_beta)


@dataclass(frozen=True)
class DenseWeights:
    """w1, w3 [E, F, L] gate and up projections; w2 [E, L, F] down projection (compute dtype, or fp32 masters)."""
    w1: Tensor
    w3: Tensor
    w2: Tensor

    def routed(self, z: Tensor, topk_idx: Tensor, topk_weight: Tensor, beta: float, linear_beta: float) -> Tensor:
        if use_fast(z, "moe") and z.dtype == torch.bfloat16:
            from kimik3.ops.moe import grouped

            return grouped.routed_experts(z, topk_idx, topk_weight, self.w1, self.w3, self.w2, beta, linear_beta)
        return reference.routed_experts(z, topk_idx, topk_weight, self.w1, self.w3, self.w2, beta, linear_beta)


@dataclass(frozen=True)
class PackedWeights:
    """MXFP4 stored bytes (the checkpoint's): codes (w1, w3, w2) uint8 [E, F, L/2], [E, F, L/2], [E, L, F/2] and
    E8M0 scales [E, F, L/32], [E, F, L/32], [E, L, F/32]. Decoding is exact, so the function is DenseWeights' on
    the decoded weights; the fast paths sum the matmuls in their own order (bf16-level differences)."""
    packed: Triple
    scales: Triple

    @property
    def num_experts(self) -> int:
        return self.packed[0].shape[0]

    def routed(self, z: Tensor, topk_idx: Tensor, topk_weight: Tensor, beta: float, linear_beta: float) -> Tensor:
        if use_fast(z, "moe") and z.dtype in (torch.bfloat16, torch.float16) and has_triton() \
                and not (z.requires_grad and torch.is_grad_enabled()):
            if mxfp4_backend(z, self.packed) == "humming":
                from kimik3.ops.moe import humming as fast
            else:
                from kimik3.ops.moe import triton_mxfp4 as fast
            return fast.routed_experts_mxfp4(z, topk_idx, topk_weight, self.packed, self.scales, beta, linear_beta)
        return reference.routed_experts_mxfp4(z, topk_idx, topk_weight, self.packed, self.scales, beta, linear_beta)


@dataclass(frozen=True)
class RelaidWeights:
    """The experts in Humming's MoE GEMM layout (`humming.relayout` of the packed codes and scales): [w1; w3] as
    one [E, 2F, L] layer and w2 [E, L, F] (each Humming's layer config and tensors). Inference only, bf16 on
    Hopper; its reference is PackedWeights on the stored bytes."""
    w13: object  # kimik3.ops.moe.humming.Layer
    w2: object
    num_experts: int  # E
    width: int  # F

    def nbytes(self) -> int:
        return sum(t.nbytes for layer in (self.w13, self.w2) for t in layer.tensors.values())

    def routed(self, z: Tensor, topk_idx: Tensor, topk_weight: Tensor, beta: float, linear_beta: float) -> Tensor:
        """Raises ValueError for a call Humming cannot run (`humming.unsupported_for`) or one that asks for a
        gradient."""
        from kimik3.ops.moe import humming

        why = humming.unsupported_for(z.device, z.dtype, z.shape[1], self.width)
        if why is None and z.requires_grad and torch.is_grad_enabled():
            why = "is inference only (a gradient was asked for)"
        if why is not None:
            raise ValueError(f"experts re-laid out for Humming: its MoE GEMM {why}; load the model again without "
                             "relayout_experts (or with use_backend(moe='triton'), KIMIK3_MOE_BACKEND=triton) to "
                             "run them elsewhere")
        return humming.routed_experts_relaid(z, topk_idx, topk_weight, self, beta, linear_beta)


def compile_relaid(relaid: RelaidWeights, max_tokens: int, top_k: int, device: torch.device) -> int:
    """Compile, side by side, the Humming kernels `routed_experts` on these experts meets for calls of up to
    `max_tokens` tokens, without calling them (no launch: safe beside another thread's eager work); returns how
    many (layer, tile config) pairs were asked for."""
    from kimik3.ops.moe import humming

    counts = humming.tiling_token_counts(relaid, max_tokens, top_k, device)
    return humming.compile_tiles(relaid, counts, top_k, device)


def warm_relaid(relaid: RelaidWeights, max_tokens: int, top_k: int, dtype: torch.dtype,
                device: torch.device) -> int:
    """Compile side by side every Humming kernel `routed_experts` on these experts meets for calls of up to
    `max_tokens` tokens (`humming.compile_tiles`), then run it once at each token count that meets a new one
    (`humming.tiling_token_counts`), on zero inputs, so each is loaded; returns the number of calls. An engine runs
    this in its warm-up: otherwise a step whose routed-row count falls in a new tile config waits seconds for a JIT
    compile (and calls alone compile their kernels one after another)."""
    from kimik3.ops.moe import humming

    counts = humming.tiling_token_counts(relaid, max_tokens, top_k, device)
    humming.compile_tiles(relaid, counts, top_k, device)
    L, E = relaid.w2.config.shape_n, relaid.num_experts
    for n in counts:
        z = torch.zeros(n, L, dtype=dtype, device=device)
        idx = (torch.arange(n * top_k, device=device) % E).view(n, top_k)
        humming.routed_experts_relaid(z, idx, torch.full((n, top_k), 1 / top_k, device=device), relaid, 1.0, 0.0)
    return len(counts)


@cache
def has_humming() -> bool:
    """Whether humming-kernels is installed and imports (it is imported on the first fast call that asks)."""
    if importlib.util.find_spec("humming") is None:
        return False
    try:
        import humming  # noqa: F401
    except (ImportError, OSError):  # installed without its CUDA libraries
        return False
    return True


def experts_backend(device: torch.device, dtype: torch.dtype, L: int, F: int) -> str:
    """"humming" or "triton": how experts of latent width L and expert width F, run in `dtype` on `device`, should
    be held for inference (humming: re-laid out once, `relayout_experts`).

    Raises:
        ValueError: the MoE backend (`use_backend(moe=...)`) forces humming where Humming cannot run.
    """
    choice = moe_backend()
    if choice == "triton":
        return "triton"
    if not has_humming():
        why = "humming-kernels is not installed (the gpu extra)"
    else:
        from kimik3.ops.moe import humming

        why = humming.unsupported_for(torch.device(device), dtype, L, F)
    if why is None:
        return "humming"
    if choice == "humming":
        raise ValueError(f"moe backend 'humming' (KIMIK3_MOE_BACKEND=humming): Humming's MoE GEMM {why}")
    return "triton"


def mxfp4_backend(z: Tensor, packed: Triple) -> str:
    """"humming" or "triton": the W4A16 kernels `PackedWeights` runs on for these inputs on its fast path: humming
    only where the MoE backend is "humming" (it keeps a second copy of the weights).

    Raises:
        ValueError: the MoE backend forces humming where Humming cannot run.
    """
    if moe_backend() != "humming":
        return "triton"
    return experts_backend(z.device, z.dtype, z.shape[1], packed[0].shape[1])
