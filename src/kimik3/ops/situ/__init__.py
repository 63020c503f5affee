"""SiTU-GLU, the activation of every K3 MLP (dense, shared and routed experts): one public function; a fused
Triton kernel (forward and backward) on CUDA, the reference elsewhere."""

from __future__ import annotations

from torch import Tensor

from kimik3.ops.backend import has_triton, use_fast
from kimik3.ops.situ import reference

__all__ = ["situ_glu"]


def situ_glu(gate: Tensor, up: Tensor, beta: float, linear_beta: float) -> Tensor:
    """SiTU of the gate times the soft-clipped up projection, computed in fp32, returned in `gate.dtype`:

        a   = beta * tanh(gate / beta) * sigmoid(gate)
        out = a * linear_beta * tanh(up / linear_beta)

    Args:
        gate, up: the two projections, same shape and dtype (any shape).
        beta, linear_beta: K3's activation_situ_beta = 4 and activation_situ_linear_beta = 25.

    Returns:
        [same shape] in gate.dtype; differentiable in gate and up.

    On CUDA tensors (unless `use_backend("torch")`) one Triton kernel reads gate and up once and writes the
    output once (the reference makes about a dozen fp32 passes), and the backward recomputes from the saved
    inputs in one more (the reference saves its fp32 intermediates).
    """
    if use_fast(gate, "situ") and has_triton():
        from kimik3.ops.situ import triton as fast  # lazily: triton exists only on GPU machines

        return fast.situ_glu(gate, up, beta, linear_beta)
    return reference.situ_glu(gate, up, beta, linear_beta)
