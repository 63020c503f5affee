"""Batch-invariant matrix products, and the mode that runs a model's products through them.

    matmul(a, b, out_dtype=None)    a [M, K] @ b [K, N], or batched [B, M, K] @ [B, K, N]: each output row summed
                                    in one fixed order whatever M is (Triton on CUDA, `.triton`; the fp32
                                    reference elsewhere)
    batch_invariant()               a context: inside it, on the current thread, every CUDA mm / addmm / bmm
                                    (the model's linear layers, MLA's absorbed products, the router's fp32-out
                                    product) runs `matmul`, a CPU 16-bit mm / addmm runs in fixed row groups,
                                    and the ops that choose tiles or splits by the step's size (MLA's paged
                                    decode, the MoE kernels) choose one for every size
                                    (`kimik3.ops.backend.batch_invariant_mode`)

Why (issue 39): in bf16 a sequence's logits must not depend on what else its step carries, or a verification row
(speculative decoding) and a decode row, or a request alone and in a batch, take different greedy tokens at near
ties. On the CPU the default kernels are invariant but for MKL's 16-bit GEMM at some shapes, which the mode runs in
fixed row groups (`kimik3.ops.rows`); on CUDA cuBLAS and the fused kernels pick their work split by size. The mode
is a `TorchDispatchMode`: it sees the products after autograd and the composite ops (F.linear, einsum, @) have been
lowered to aten, so no layer changes, and it is thread-local, so an engine turns it on around its own steps only.
Inference only: gradients are not routed.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

from kimik3.ops.backend import has_triton, use_backend
from kimik3.ops.matmul import reference
from kimik3.ops.rows import in_row_groups

__all__ = ["batch_invariant", "matmul"]


def matmul(a: Tensor, b: Tensor, out_dtype: torch.dtype | None = None) -> Tensor:
    """a @ b with each output row summed in one order whatever the row count or the other rows.

    Args:
        a: [M, K] or [B, M, K]; b: [K, N] or [B, K, N]; one dtype (bf16, fp16 or fp32), any strides.
        out_dtype: the output's dtype (default a's): fp32 keeps the sums unrounded (the router's logits).

    Returns:
        [M, N] or [B, M, N]: the products summed in fp32 over K in a fixed order, rounded once.
    """
    if a.is_cuda and has_triton():
        from kimik3.ops.matmul import triton as fast  # lazily: triton exists only on GPU machines

        return fast.matmul(a, b, out_dtype)
    return reference.matmul(a, b, out_dtype)


aten = torch.ops.aten


def _addmm(bias: Tensor, a: Tensor, b: Tensor, *, beta=1, alpha=1) -> Tensor:
    # the product kept in fp32 and the bias added to it before the one rounding, as cuBLAS's epilogue does
    out = matmul(a, b, torch.float32)
    return (alpha * out + beta * bias.float()).to(a.dtype)


_ROUTES = {
    aten.mm.default: lambda a, b: matmul(a, b),
    aten.mm.dtype: lambda a, b, out_dtype: matmul(a, b, out_dtype),
    aten.bmm.default: lambda a, b: matmul(a, b),
    aten.addmm.default: _addmm,
}


def _cpu_rows(func, args: tuple, kwargs: dict) -> Tensor | None:
    """A 16-bit CPU mm / addmm (bias [N]) run in fixed groups of rows (`kimik3.ops.rows`), or None for any other
    call. MKL's bf16 GEMM sums a row by where it falls in the call's row blocking at some shapes (on this
    repository's CPU: K = 512 from 37 rows, K = 7,168 from 2), so a token's product changed with its step's size."""
    if func is aten.mm.default:
        (a, b), bias = args, None
    elif func is aten.addmm.default and args[0].dim() <= 1:
        bias, a, b = args
    else:
        return None
    if a.is_cuda or a.dtype not in (torch.bfloat16, torch.float16):
        return None
    if bias is None:
        return in_row_groups(lambda r: func(r, b), a)
    return in_row_groups(lambda r: func(bias, r, b, **kwargs), a)


class _Products(TorchDispatchMode):
    """Routes the CUDA products of `_ROUTES` to `matmul`, and the CPU's 16-bit mm / addmm through fixed row groups
    (`_cpu_rows`); every other op runs as it would."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        route = _ROUTES.get(func)
        if route is not None and args[0].is_cuda:
            return route(*args, **kwargs)
        if route is not None:
            out = _cpu_rows(func, args, kwargs)
            if out is not None:
                return out
        return func(*args, **kwargs)


@contextmanager
def batch_invariant() -> Iterator[None]:
    """Run the block batch-invariantly (see the module docstring): on this thread, CUDA products through `matmul`,
    the CPU's 16-bit ones in fixed row groups, and size-independent tiles and splits in MLA's and the MoE's kernels.
    Nested uses are fine."""
    with use_backend(batch_invariant=True), _Products():
        yield
