"""The router's expert selection in torch: the reference (see `kimik3.ops.router.route`)."""

from __future__ import annotations

import torch
from torch import Tensor


def route(logits_NE: Tensor, bias_E: Tensor, top_k: int, renormalize: bool, scaling: float
          ) -> tuple[Tensor, Tensor, Tensor]:
    scores_NE = torch.sigmoid(logits_NE)
    _, idx_NA = torch.topk(scores_NE.detach() + bias_E, top_k, dim=-1, sorted=False)
    w_NA = scores_NE.gather(-1, idx_NA)
    if renormalize and top_k > 1:
        w_NA = w_NA / (w_NA.sum(-1, keepdim=True) + 1e-20)
    return idx_NA, w_NA * scaling, scores_NE
