"""The MoE router's logits in torch: the reference (see `kimik3.ops.router.router_logits`).

Spec §2.8 step 1 makes the router an fp32 island: both operands upcast (exactly) and one fp32 GEMM,
    logits_NE = x_ND.float() @ w_ED.float()^T
"""

from __future__ import annotations

from torch import Tensor

from kimik3.ops.rows import in_row_groups


def router_logits(x_ND: Tensor, w_ED: Tensor) -> Tensor:
    """[N, E] fp32 logits of tokens x_ND [N, D] against the gate weight w_ED [E, D] (any float dtypes); each token's
    the same in any batch (`in_row_groups`)."""
    w_DE = w_ED.float().T
    return in_row_groups(lambda x: x.float() @ w_DE, x_ND)
