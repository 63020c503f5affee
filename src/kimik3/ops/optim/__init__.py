"""The optimizer's passes over every parameter: the global gradient norm and the AdamW update with the clip
folded in. Triton kernels on CUDA tensors, the references (`.reference`) elsewhere.

Why our own: torch's fused AdamW reads the clip as a `grad_scale` and then writes every unscaled gradient back
(GradScaler's contract: 2 more bytes per parameter), and `_foreach_norm` reads bf16 gradients at about half the
copy rate (BENCHMARKS.md, "Measurements behind code choices"). Both passes are bound by bytes; these kernels move
each byte once.
"""

from __future__ import annotations

from torch import Tensor

from kimik3.ops.backend import has_triton, use_fast
from kimik3.ops.optim import reference

__all__ = ["adamw_update_", "grad_norm"]


def grad_norm(grads: list[Tensor]) -> Tensor:
    """The 2-norm of all `grads` together, an fp32 scalar on their device (no host sync).

    Each element is squared and summed in fp32; on CUDA (unless `use_backend("torch")`) one Triton pass per
    tensor writes per-block partial sums into one buffer, summed in a fixed order (deterministic). The reference
    is `torch.nn.utils.get_total_norm` (per-tensor norms, then their norm), equal up to fp32 summation order.
    """
    if grads and use_fast(grads[0], "optim") and has_triton():
        from kimik3.ops.optim import triton as fast  # lazily: triton exists only on GPU machines

        return fast.grad_norm(grads)
    return reference.grad_norm(grads)


def adamw_update_(param: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, *, step: int, lr: float,
                  beta1: float, beta2: float, eps: float, weight_decay: float,
                  grad_scale: Tensor | None = None) -> None:
    """One AdamW update of `param` and its moments, IN PLACE, as torch's fused AdamW computes it.

    Args:
        param, exp_avg, exp_avg_sq: same shape, updated in place (each keeps its dtype; math in fp32).
        grad: same shape; read only (never written back, unlike torch's fused kernel with a grad_scale).
        step: the 1-based step count after this update's increment (the bias corrections use it).
        grad_scale: optional fp32 scalar on param's device; the gradient is divided by it first (the clip:
            max(1, norm / max_norm)), read on the device, so the host never waits for the norm.

    Math per element (fp32, in this order): g = grad / grad_scale; p -= (lr * weight_decay) * p;
    m = beta1 * m + (1 - beta1) * g; v = beta2 * v + (1 - beta2) * (g * g);
    p -= (lr / (1 - beta1^step)) * m / (sqrt(v) / sqrt(1 - beta2^step) + eps).
    """
    if use_fast(param, "optim") and has_triton() and reference.kernel_can_take(param, grad, exp_avg, exp_avg_sq):
        from kimik3.ops.optim import triton as fast

        return fast.adamw_update_(param, grad, exp_avg, exp_avg_sq, step=step, lr=lr, beta1=beta1, beta2=beta2,
                                  eps=eps, weight_decay=weight_decay, grad_scale=grad_scale)
    return reference.adamw_update_(param, grad, exp_avg, exp_avg_sq, step=step, lr=lr, beta1=beta1, beta2=beta2,
                                   eps=eps, weight_decay=weight_decay, grad_scale=grad_scale)
