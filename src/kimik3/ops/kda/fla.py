"""KDA on CUDA through fla-core's Triton kernels, with K3's flags (imported lazily: CUDA only).

The gate runs inside the kernel in the lower-bounded form (`safe_gate`, bound -5), as do the q/k L2 norm
(eps 1e-6 inside the sqrt) and the beta sigmoid: the reference's call (spec 2.4, step 6). The state is fp32
[N, H, K, V] in fla's default K-first layout, the same layout as our reference and cache.
"""

from __future__ import annotations

from torch import Tensor


def _k3_flags(q: Tensor, A_log: Tensor, dt_bias: Tensor, lower_bound: float) -> dict:
    return dict(A_log=A_log[: q.shape[2]], dt_bias=dt_bias, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                use_beta_sigmoid_in_kernel=True, lower_bound=lower_bound)


def chunk_kda_with_gate(q, k, v, g, beta, A_log, dt_bias, *, lower_bound, scale=None, initial_state=None,
                        output_final_state=False, cu_seqlens=None):
    from fla.ops.kda import chunk_kda

    return chunk_kda(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                     output_final_state=output_final_state, safe_gate=True, cu_seqlens=cu_seqlens,
                     **_k3_flags(q, A_log, dt_bias, lower_bound))


def recurrent_kda_with_gate(q, k, v, g, beta, A_log, dt_bias, *, lower_bound, scale=None, initial_state=None,
                            output_final_state=False, cu_seqlens=None):
    from fla.ops.kda import fused_recurrent_kda

    return fused_recurrent_kda(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                               output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                               **_k3_flags(q, A_log, dt_bias, lower_bound))
