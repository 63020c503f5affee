"""Routed experts with LoRA factors over frozen MXFP4-packed weights: forward and input gradient (the reference).

Legend: N tokens, n tokens of one expert, L latent width (experts' input/output), F expert width, E experts,
A active experts, R rank, E' = E (a factor per expert) or 1 (one factor shared by the layer's experts).

Each expert e computes, with s = LoRA scale and W decoded from its packed codes:

    g = z W1_e^T + s (z A1_e^T) B1_e^T          A1 [E', R, L], B1 [E', F, R]
    u = z W3_e^T + s (z A3_e^T) B3_e^T          A3 [E', R, L], B3 [E', F, R]
    h = SiTU-GLU(g, u)
    y = h W2_e^T + s (h A2_e^T) B2_e^T          A2 [E', R, F], B2 [E', L, R]
    r = sum_e w_e * float(y)                    fp32 combine, as `reference.routed_experts`

The base weights never get a gradient and no dense copy of them outlives one expert's matmul: `packed_linear`
decodes W in the forward, keeps only the (already resident) codes for backward, and decodes them again there to
compute dX = dY W. The LoRA terms are plain autograd, so dA, dB and dz follow. With every B zero the output is
`kimik3.ops.moe.reference.routed_experts_mxfp4`'s bit for bit (each LoRA term adds exactly +0).

`routed_experts_mxfp4_adapters` is the serving form: the tokens of one call belong to different adapters (K of
them, factors stacked [K, E, ...]) or to none; each expert's base matmul is shared by all its tokens and the
adapters' updates go through `kimik3.ops.lora.lora_delta`, grouped per adapter.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kimik3.ops.mxfp4 import decode
from kimik3.ops.situ.reference import situ_glu

Factors = tuple[Tensor, Tensor, Tensor]  # (w1, w3, w2) factors, each [E' , ...]


class _PackedLinear(torch.autograd.Function):
    """y = x W^T for W = decode(packed, scale): gradient for x only (W is frozen); W is decoded again in backward."""

    @staticmethod
    def forward(ctx, x: Tensor, packed: Tensor, scale: Tensor) -> Tensor:
        ctx.save_for_backward(packed, scale)  # the codes, not the decoded weight: 1/4 of bf16's bytes, and resident
        return x @ decode(packed, scale, x.dtype).T

    @staticmethod
    def backward(ctx, dy: Tensor):
        packed, scale = ctx.saved_tensors
        return dy @ decode(packed, scale, dy.dtype), None, None


def packed_linear(x: Tensor, packed: Tensor, scale: Tensor) -> Tensor:
    """x [n, in] @ decode(packed [out, in/2], scale [out, in/32])^T -> [n, out] in x.dtype, differentiable in x
    (the same values as `x @ decode(packed, scale, x.dtype).T`; no weight gradient, no dense weight saved)."""
    return _PackedLinear.apply(x, packed, scale)


def _pick(t: Tensor, e: int) -> Tensor:
    return t[e] if t.shape[0] > 1 else t[0]


def _proj(x: Tensor, e: int, k: int, packed: Factors, scales: Factors, lora_a: Factors, lora_b: Factors,
          scale: float) -> Tensor:
    """Projection k (0 = w1, 1 = w3, 2 = w2) of expert e on x [n, in]: base through the codes plus the LoRA term."""
    a, b = _pick(lora_a[k], e).to(x.dtype), _pick(lora_b[k], e).to(x.dtype)
    return packed_linear(x, packed[k][e], scales[k][e]) + ((x @ a.T) @ b.T) * scale


def routed_experts_mxfp4_lora(z: Tensor, topk_idx: Tensor, topk_weight: Tensor, packed: Factors, scales: Factors,
                              lora_a: Factors, lora_b: Factors, scale: float, beta: float,
                              linear_beta: float) -> Tensor:
    """`kimik3.ops.lora.LoraWeights`' reference: LoRA on each expert's w1, w3 and w2 (shapes: the module docstring).

    The factors are used in z.dtype (cast per expert: fp32 master factors under a bf16 compute dtype).
    Returns [N, L] in z.dtype.
    """
    out_NL = torch.zeros(z.shape, dtype=torch.float32, device=z.device)
    for e in range(packed[0].shape[0]):
        tok, slot = (topk_idx == e).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        z_nL = z[tok]

        h_nF = situ_glu(_proj(z_nL, e, 0, packed, scales, lora_a, lora_b, scale),
                        _proj(z_nL, e, 1, packed, scales, lora_a, lora_b, scale), beta, linear_beta)
        y_nL = _proj(h_nF, e, 2, packed, scales, lora_a, lora_b, scale)
        out_NL = out_NL.index_add(0, tok, y_nL.float() * topk_weight[tok, slot, None])
    return out_NL.to(z.dtype)


def _adapted(x: Tensor, e: int, k: int, packed: Factors, scales: Factors, adapter: Tensor, lora_a: Factors,
             lora_b: Factors, scale: Tensor) -> Tensor:
    """Projection k of expert e on x [n, in]: the base matmul once for all rows, each row's adapter update added."""
    from kimik3.ops.lora import lora_delta

    base = x @ decode(packed[k][e], scales[k][e], x.dtype).T
    return base + lora_delta(x, adapter, lora_a[k][:, e], lora_b[k][:, e], scale)


def routed_experts_mxfp4_adapters(z: Tensor, topk_idx: Tensor, topk_weight: Tensor, packed: Factors,
                                  scales: Factors, adapter: Tensor, lora_a: Factors, lora_b: Factors, scale: Tensor,
                                  beta: float, linear_beta: float) -> Tensor:
    """`kimik3.ops.lora.AdapterWeights`: a batch whose tokens use different adapters (serving; no gradient needed).

    Per expert the base matmul runs once over all its tokens (every adapter's and the base's); the adapters'
    updates go through `kimik3.ops.lora.lora_delta`, grouped per adapter. A token of no adapter (-1) gets the
    packed reference's value bit for bit.

    Args:
        adapter: [N] int64 adapter of each token, -1 for none.
        lora_a: (A1 [K, E, R, L], A3 [K, E, R, L], A2 [K, E, R, F]); lora_b: (B1 [K, E, F, R], B3 [K, E, F, R],
            B2 [K, E, L, R]): the K adapters' factors, shared layouts expanded per expert.
        scale: [K] fp32 each adapter's experts' alpha / rank.
        other arguments: as `kimik3.ops.moe.routed_experts` with `PackedWeights`.
    """
    out_NL = torch.zeros(z.shape, dtype=torch.float32, device=z.device)
    for e in range(packed[0].shape[0]):
        tok, slot = (topk_idx == e).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        z_nL, ad_n = z[tok], adapter[tok]
        g_nF, u_nF = (_adapted(z_nL, e, k, packed, scales, ad_n, lora_a, lora_b, scale) for k in (0, 1))
        h_nF = situ_glu(g_nF, u_nF, beta, linear_beta)
        y_nL = _adapted(h_nF, e, 2, packed, scales, ad_n, lora_a, lora_b, scale)
        out_NL = out_NL.index_add(0, tok, y_nL.float() * topk_weight[tok, slot, None])
    return out_NL.to(z.dtype)
