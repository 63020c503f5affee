"""The decode short convolution in torch: the reference (see `kimik3.ops.shortconv.decode_short_conv`).

Legend: N sequences, S slots, W conv window, P channels. What KDA's decode did before the fused kernel:
    window = cat([tails[slots], x[:, None]]);  tails[slots] = window[:, 1:];  silu(sum_j window[:, j] * w[:, j])
The sum runs j = 0 .. W-1 one add at a time, spelled out (not `.sum(1)`) so that the order is the kernel's
on every device: on the CPU `.sum(1)` over W = 4 happens to add in the same order (tested bitwise).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def decode_short_conv(x_NP: Tensor, tails_SWP: Tensor, slots_N: Tensor, weight_PW: Tensor) -> Tensor:
    """x [N, P], tails [S, W-1, P] (updated in place at the distinct `slots_N` [N]), weight [P, W] fp32 ->
    silu(conv) [N, P] in x's dtype."""
    window_NWP = torch.cat([tails_SWP[slots_N], x_NP[:, None]], dim=1)
    tails_SWP.index_copy_(0, slots_N, window_NWP[:, 1:])
    p_NWP = window_NWP.float() * weight_PW.float().T
    y_NP = p_NWP[:, 0]
    for j in range(1, p_NWP.shape[1]):
        y_NP = y_NP + p_NWP[:, j]
    return F.silu(y_NP).to(x_NP.dtype)
