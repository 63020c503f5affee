"""References of `kimik3.ops.optim`: the gradient norm as torch computes it, and AdamW in torch ops with the
fused kernel's math order (fp32 opmath, scalars rounded to fp32 once)."""

from __future__ import annotations

import math

import torch
from torch import Tensor


def grad_norm(grads: list[Tensor]) -> Tensor:
    """Each tensor's norm in fp32, then the norm of those (torch's `get_total_norm` would round the norm of a
    bf16 tensor to bf16 first)."""
    if not grads:
        return torch.zeros((), dtype=torch.float32)
    norms = [torch.linalg.vector_norm(g, 2.0, dtype=torch.float32) for g in grads]
    return torch.linalg.vector_norm(torch.stack(norms), 2.0)


def scalars(step: int, lr: float, beta1: float, beta2: float, weight_decay: float) -> dict[str, float]:
    """The update's per-step constants, in double on the host (as torch's fused kernel forms them); the
    kernels and the reference round each to fp32 once."""
    return {"decay": lr * weight_decay, "beta1": beta1, "one_minus_beta1": 1.0 - beta1, "beta2": beta2,
            "one_minus_beta2": 1.0 - beta2, "step_size": lr / (1.0 - beta1**step),
            "bc2_sqrt": math.sqrt(1.0 - beta2**step)}


def kernel_can_take(param: Tensor, *others: Tensor) -> bool:
    """Contiguous, same shape, floating point: what the Triton pass indexes as one flat array."""
    return param.is_contiguous() and param.is_floating_point() and all(
        t.shape == param.shape and t.is_contiguous() and t.is_floating_point() and t.device == param.device
        for t in others)


@torch.no_grad()
def adamw_update_(param: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, *, step: int, lr: float,
                  beta1: float, beta2: float, eps: float, weight_decay: float,
                  grad_scale: Tensor | None = None) -> None:
    c = {k: torch.tensor(v, dtype=torch.float32) for k, v in scalars(step, lr, beta1, beta2, weight_decay).items()}
    eps32 = torch.tensor(eps, dtype=torch.float32)
    f32 = lambda t: t.to(torch.float32)  # noqa: E731 -- each operand as the kernel loads it
    # divisors are materialized in full: torch divides by a scalar (or an expanded one, stride 0) as a
    # multiplication by its reciprocal, which is not correctly rounded; the kernel divides
    g = f32(grad)
    if grad_scale is not None:
        g = g / torch.full_like(g, 1.0).mul_(f32(grad_scale).to(g.device))
    p = f32(param)
    if weight_decay != 0:
        p = p - c["decay"] * p
    m = c["beta1"] * f32(exp_avg) + c["one_minus_beta1"] * g
    v = c["beta2"] * f32(exp_avg_sq) + c["one_minus_beta2"] * (g * g)
    # sqrt correctly rounded, as the kernel's sqrt_rn: through float64 (exact for an fp32 input once rounded
    # back); torch's vectorized fp32 sqrt on the CPU is not always correctly rounded
    denom = v.double().sqrt().float() / torch.full_like(v, float(c["bc2_sqrt"])) + eps32
    p = p - (c["step_size"] * m) / denom
    param.copy_(p)
    exp_avg.copy_(m)
    exp_avg_sq.copy_(v)
