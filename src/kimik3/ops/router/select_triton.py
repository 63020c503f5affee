"""The router's expert selection as one Triton kernel per token row (inference: no autograd); the contract of
`.select_reference`.

Legend: N tokens, E experts (a row of E fits one block: K3 has 896), A = top_k. Per row, in fp32:
    s = sigmoid(logits)                          written out (the scores the caller may keep)
    A times: i = argmax(s + bias) over the experts not yet taken (the lowest index on a tie), w_i = s_i
    w = w / (sum w + 1e-20) if renormalize, then * scaling
The selected experts come out in descending biased score; the reference's `topk(sorted=False)` leaves the order
unspecified, so the two agree as sets (and on each expert's weight), which is all the combine reads.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

__all__ = ["route"]


@triton.jit
def _route_kernel(logits_ptr, bias_ptr, idx_ptr, w_ptr, scores_ptr, scaling, E: tl.constexpr, A: tl.constexpr,
                  BLOCK_E: tl.constexpr, BLOCK_A: tl.constexpr, RENORMALIZE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_E)
    mask = cols < E
    s = tl.sigmoid(tl.load(logits_ptr + row * E + cols, mask=mask, other=0.0).to(tl.float32))
    tl.store(scores_ptr + row * E + cols, s, mask=mask)
    biased = tl.where(mask, s + tl.load(bias_ptr + cols, mask=mask, other=0.0).to(tl.float32), float("-inf"))
    slots = tl.arange(0, BLOCK_A)
    idx = tl.zeros([BLOCK_A], dtype=tl.int64)
    w = tl.zeros([BLOCK_A], dtype=tl.float32)
    for j in tl.static_range(A):
        i = tl.argmax(biased, axis=0, tie_break_left=True)
        idx = tl.where(slots == j, i, idx)
        w = tl.where(slots == j, tl.sum(tl.where(cols == i, s, 0.0), axis=0), w)
        biased = tl.where(cols == i, float("-inf"), biased)
    if RENORMALIZE:
        w = w / (tl.sum(w, axis=0) + 1e-20)
    tl.store(idx_ptr + row * A + slots, idx, mask=slots < A)
    tl.store(w_ptr + row * A + slots, w * scaling, mask=slots < A)


def route(logits_NE: Tensor, bias_E: Tensor, top_k: int, renormalize: bool, scaling: float
          ) -> tuple[Tensor, Tensor, Tensor]:
    N, E = logits_NE.shape
    logits = logits_NE.float().contiguous()
    idx = torch.empty(N, top_k, dtype=torch.int64, device=logits.device)
    w = torch.empty(N, top_k, dtype=torch.float32, device=logits.device)
    scores = torch.empty(N, E, dtype=torch.float32, device=logits.device)
    if N:
        block_e = triton.next_power_of_2(E)
        _route_kernel[(N,)](logits, bias_E.float().contiguous(), idx, w, scores, float(scaling), E=E, A=top_k,
                            BLOCK_E=block_e, BLOCK_A=triton.next_power_of_2(top_k),
                            RENORMALIZE=renormalize and top_k > 1, num_warps=4 if block_e <= 1024 else 8)
    return idx, w, scores
