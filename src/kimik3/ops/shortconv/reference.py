"""KDA's short convolution in torch: the references of `kimik3.ops.shortconv.short_conv` (prefill, training) and
`decode_short_conv`.

Legend: N sequences, S slots, W conv window, P channels. What KDA's decode did before the fused kernel:
    window = cat([tails[slots], x[:, None]]);  tails[slots] = window[:, 1:];  silu(sum_j window[:, j] * w[:, j])
The sum runs j = 0 .. W-1 one add at a time, spelled out (not `.sum(1)`) so that the order is the kernel's
on every device: on the CPU `.sum(1)` over W = 4 happens to add in the same order (tested bitwise).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from kimik3.ops.varlen import positions


def short_conv(x_BTP: Tensor, weight_PW: Tensor, cu_seqlens: Tensor | None = None) -> Tensor:
    """silu(causal depthwise conv) over whole sequences: x [B, T, P], weight [P, W] -> [B, T, P] in x's dtype.

    fp32 products summed one tap at a time from the newest (tap W-1) back, zero left padding per document.
    """
    T, W = x_BTP.shape[1], weight_PW.shape[-1]
    w_PW = weight_PW.float()
    x = x_BTP.float()
    # one pass per tap over the shifted rows only (t >= s), accumulated in place: a padded, masked copy per
    # tap costs 2-3 more full [B, T, P] fp32 passes each
    y = x * w_PW[:, W - 1]
    pos_T1 = None if cu_seqlens is None else positions(cu_seqlens, T, x.device)[:, None]
    for s in range(1, min(W, T)):
        prev = x[:, : T - s]  # x[t - s] for t >= s
        if pos_T1 is not None:  # zeroed where t - s falls before the token's own document start
            prev = prev * (pos_T1[s:] >= s)
        y[:, s:] += prev * w_PW[:, W - 1 - s]
    return F.silu(y).to(x_BTP.dtype)


def gathered_short_conv(ext_XP: Tensor, index_WT: Tensor, weight_PW: Tensor) -> Tensor:
    """Packed sequences with cached tails: ext [X, P] (new inputs, then tails), index [W, T] (the row of ext
    feeding tap j of each of the T outputs), weight [P, W] -> silu(conv) [T, P] in ext's dtype; the same sums
    in the same order as `short_conv` over a tail-extended row."""
    W = weight_PW.shape[-1]
    w_PW = weight_PW.float()
    x = ext_XP.float()
    y = x[index_WT[W - 1]] * w_PW[:, W - 1]
    for s in range(1, W):
        y += x[index_WT[W - 1 - s]] * w_PW[:, W - 1 - s]
    return F.silu(y).to(ext_XP.dtype)


def decode_short_conv(x_NP: Tensor, tails_SWP: Tensor, slots_N: Tensor, weight_PW: Tensor) -> Tensor:
    """x [N, P], tails [S, W-1, P] (updated in place at the distinct `slots_N` [N]), weight [P, W] fp32 ->
    silu(conv) [N, P] in x's dtype."""
    window_NWP = torch.cat([tails_SWP[slots_N], x_NP[:, None]], dim=1)
    tails_SWP.index_copy_(0, slots_N, window_NWP[:, 1:])
    p_NWP = window_NWP.float() * weight_PW.float().T
    # newest tap first, as `short_conv` and `gathered_short_conv` sum: a decode row then equals the same token's row
    # in a prefill or a verification step bit for bit (speculation and chunking keep greedy tokens in bf16)
    W = p_NWP.shape[1]
    y_NP = p_NWP[:, W - 1]
    for j in range(W - 2, -1, -1):
        y_NP = y_NP + p_NWP[:, j]
    return F.silu(y_NP).to(x_NP.dtype)
