"""KDA on CUDA through fla-core's Triton kernels, with K3's flags (imported lazily: CUDA only).

The gate runs inside the kernel in the lower-bounded form (`safe_gate`, bound -5), as do the q/k L2 norm
(eps 1e-6 inside the sqrt) and the beta sigmoid: the reference's call (spec 2.4, step 6). The state is fp32
[N, H, K, V] in fla's default K-first layout, the same layout as our reference and cache. fla's modules are loaded by
`kimik3.ops.fla_modules.fla_module`: only those K3 runs, with the package's autotuning choices for this GPU.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kimik3.ops.fla_modules import fla_module


def _k3_flags(q: Tensor, A_log: Tensor, dt_bias: Tensor, lower_bound: float) -> dict:
    return dict(A_log=A_log[: q.shape[2]], dt_bias=dt_bias, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                use_beta_sigmoid_in_kernel=True, lower_bound=lower_bound)


def chunk_kda_with_gate(q, k, v, g, beta, A_log, dt_bias, *, lower_bound, scale=None, initial_state=None,
                        output_final_state=False, cu_seqlens=None):
    chunk_kda = fla_module("fla.ops.kda").chunk_kda

    return chunk_kda(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                     output_final_state=output_final_state, safe_gate=True, cu_seqlens=cu_seqlens,
                     **_k3_flags(q, A_log, dt_bias, lower_bound))


def recurrent_kda_with_gate(q, k, v, g, beta, A_log, dt_bias, *, lower_bound, scale=None, initial_state=None,
                            output_final_state=False, cu_seqlens=None):
    fused_recurrent_kda = fla_module("fla.ops.kda").fused_recurrent_kda

    return fused_recurrent_kda(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                               output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                               **_k3_flags(q, A_log, dt_bias, lower_bound))


def decode_kda_with_gate(q, k, v, g, beta, A_log, dt_bias, *, lower_bound, scale=None, states, slots):
    # fla's public `fused_recurrent_kda` always writes a new final-state tensor; its forward function has vLLM's
    # continuous-batching mode (`ssm_state_indices`, the state read from and written back to the pool in place)
    fused_recurrent_kda_fwd = fla_module("fla.ops.kda.fused_recurrent").fused_recurrent_kda_fwd

    H, K, V = v.shape[2], q.shape[3], v.shape[3]
    if q.shape[1] != 1 or states.dtype != torch.float32 or states.stride()[1:] != (K * V, V, 1):
        raise ValueError(f"decode_kda_with_gate: one token a row and a contiguous fp32 [S, {H}, {K}, {V}] pool, got "
                         f"{q.shape[1]} tokens and a {states.dtype} pool of strides {states.stride()}")
    o, _ = fused_recurrent_kda_fwd(q, k, v, g, beta, scale=scale, initial_state=states, inplace_final_state=True,
                                   ssm_state_indices=slots, **_k3_flags(q, A_log, dt_bias, lower_bound))
    return o
