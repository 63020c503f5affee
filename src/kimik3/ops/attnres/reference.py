"""Attention residuals (AttnRes): a per-token softmax mix over depth. Reference, fp32 math.

Legend: M stored block sums, S = M + 1 sources (the blocks, then the current partial sum), N tokens (any
leading dims), D hidden.

For sources v_0..v_m (the last is the current partial sum), with one pseudo-query vector
w = norm.weight * proj.weight[0] (fp32):
    k_j = v_j / sqrt(mean_D(v_j^2) + eps)        # RMS-normalized key, no weight
    s_j = <k_j, w>;  pi = softmax_j(s)
    out = sum_j pi_j * v_j                        # over the UNnormalized values
The norm's weight enters only through w; the norm's own forward is never called (spec 2.3).
"""

from __future__ import annotations

import torch
from torch import Tensor


def attn_res_mix(blocks: Tensor, partial: Tensor, norm_weight: Tensor, proj_weight: Tensor, eps: float) -> Tensor:
    v_SND = torch.cat([blocks, partial[None]]).float()
    w_D = norm_weight.float() * proj_weight.float().reshape(-1)
    k_SND = v_SND * torch.rsqrt(v_SND.pow(2).mean(-1, keepdim=True) + eps)
    pi_SN = (k_SND * w_D).sum(-1).softmax(0)
    return (pi_SN.unsqueeze(-1) * v_SND).sum(0).to(partial.dtype)
