"""The text model's RMSNorms: `rms_norm` (one fused Triton kernel each way on CUDA) and KDA's `gated_rms_norm`
(fla-core's fused kernel on CUDA); the references elsewhere."""

from __future__ import annotations

from torch import Tensor

from kimik3.ops.backend import has_fla, has_triton, require, use_fast
from kimik3.ops.rmsnorm import reference

__all__ = ["gated_rms_norm", "rms_norm"]


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Normalize x over its last dim in fp32, cast to x's dtype, then multiply by the gain:

        y = weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)

    Args:
        x: [..., D] any float dtype.
        weight: [D] the gain (the model's dtype, or fp32 master weights under autocast).
        eps: K3's rms_norm_eps (1e-5).

    Returns:
        [..., D] in the promoted dtype of weight and x; differentiable in x and weight.

    On CUDA tensors (unless `use_backend("torch")`) one Triton kernel reads x once and writes y once, and the
    backward one more pass per row (the reference: an fp32 copy of x, the norm, a cast and the product, each a
    pass of its own, and as many again backward).
    """
    if use_fast(x, "rmsnorm") and has_triton():
        from kimik3.ops.rmsnorm import triton as fast  # lazily: triton exists only on GPU machines

        return fast.rms_norm(x, weight, eps)
    return reference.rms_norm(x, weight, eps)


def gated_rms_norm(o: Tensor, gate: Tensor, weight: Tensor, eps: float) -> Tensor:
    """KDA's output norm (`FusedRMSNormGated`, sigmoid): rms(o) * weight * sigmoid(gate), all in fp32.

    Args:
        o: [..., K] the delta rule's output per head.
        gate: [..., K] the g_proj output, same shape.
        weight: [K] the norm's gain (fp32 in K3: an fp32 island).
        eps: rms_norm_eps.

    Returns:
        [..., K] in o's dtype; differentiable in o, gate and weight.

    On CUDA (unless `use_backend("torch")`): fla's fused kernel (fla-core missing is an error), one pass where the
    reference makes about six (two fp32 copies, the norm, the sigmoid, the product, the cast).
    """
    if use_fast(o, "rmsnorm"):
        require(has_fla(), "the gated RMSNorm", "fla-core")
        from kimik3.ops.rmsnorm import fla as fast  # lazily: fla exists only on GPU machines

        return fast.gated_rms_norm(o, gate, weight, eps)
    return reference.gated_rms_norm(o, gate, weight, eps)
