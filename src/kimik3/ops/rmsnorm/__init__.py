"""RMSNorm (every norm of the text model but KDA's gated output norm): one public function; one fused Triton
kernel each way on CUDA, the reference elsewhere."""

from __future__ import annotations

from torch import Tensor

from kimik3.ops.backend import has_triton, use_fast
from kimik3.ops.rmsnorm import reference

__all__ = ["rms_norm"]


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
    if use_fast(x) and has_triton():
        from kimik3.ops.rmsnorm import triton as fast  # lazily: triton exists only on GPU machines

        return fast.rms_norm(x, weight, eps)
    return reference.rms_norm(x, weight, eps)
