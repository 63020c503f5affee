"""The MoE router's logits in torch: the reference (see `kimik3.ops.router.router_logits`).

Spec §2.8 step 1 makes the router an fp32 island: both operands upcast (exactly) and one fp32 GEMM,
    logits_NE = x_ND.float() @ w_ED.float()^T
"""

from __future__ import annotations

import torch
from torch import Tensor

from kimik3.ops.matmul import reference as products


def router_logits(x_ND: Tensor, w_ED: Tensor) -> Tensor:
    """[N, E] fp32 logits of tokens x_ND [N, D] against the gate weight w_ED [E, D] (any float dtypes); each token's
    the same in any batch (the products' reference sums each row alike at any row count)."""
    return products.matmul(x_ND, w_ED.T, torch.float32)
