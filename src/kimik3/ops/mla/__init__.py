"""MLA attention: one public function; SDPA / latent-decode fast paths are dispatched here."""

from __future__ import annotations

from torch import Tensor

from kimik3.ops.mla import reference


def mla_attention(q: Tensor, k: Tensor, v: Tensor, *, scale: float, cu_seqlens: Tensor | None = None) -> Tensor:
    """Causal multi-head attention over expanded keys and values.

    Args:
        q, k: [B, T, H, K]; v: [B, T, H, V] (any float dtype; math in fp32).
        scale: softmax scale (K3: 192**-0.5, no mscale).
        cu_seqlens: optional [N+1] int document boundaries of one packed row (B == 1).

    Returns:
        [B, T, H, V] in `q.dtype`.
    """
    return reference.mla_attention(q, k, v, scale=scale, cu_seqlens=cu_seqlens)
