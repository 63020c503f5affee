"""The MoE router's logits in torch: the reference (see `kimik3.ops.router.router_logits`).

Spec §2.8 step 1 makes the router an fp32 island: both operands upcast (exactly) and one fp32 GEMM,
    logits_NE = x_ND.float() @ w_ED.float()^T
"""

from __future__ import annotations

from torch import Tensor


def router_logits(x_ND: Tensor, w_ED: Tensor) -> Tensor:
    """[N, E] fp32 logits of tokens x_ND [N, D] against the gate weight w_ED [E, D] (any float dtypes)."""
    return x_ND.float() @ w_ED.float().T
