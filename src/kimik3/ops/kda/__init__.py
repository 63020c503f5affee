"""Kimi Delta Attention (KDA): gated delta-rule linear attention with a per-channel decay.

``chunk_kda`` / ``recurrent_kda`` are the delta rule on activated inputs (normalized q/k, log-decay,
beta), pure PyTorch (fp32 math, differentiable). The K3 layer calls ``chunk_kda_with_gate`` (prefill,
training) and ``recurrent_kda_with_gate`` (decode), which take the pre-activation inputs and run fla-core's
kernels with K3's flags on CUDA, the reference elsewhere.
"""

from __future__ import annotations

from torch import Tensor

from kimik3.ops.backend import has_fla, require, use_fast

from . import fla, reference
from .reference import CHUNK_SIZE

__all__ = ["CHUNK_SIZE", "chunk_kda", "chunk_kda_with_gate", "chunk_kda_with_gate_checkpoints", "decode_kda_with_gate",
           "recurrent_kda", "recurrent_kda_with_gate", "supports_checkpoints"]


def chunk_kda(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, *, scale: float | None = None,
              initial_state: Tensor | None = None, output_final_state: bool = False,
              cu_seqlens: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    """KDA over whole sequences, computed in chunks of 64 tokens (WY/UT transform).

    Use for prefill and training. Equal to ``recurrent_kda`` on the same arguments up to rounding.

    Shapes (B batch, T tokens, H heads, K key dim, V value dim, N sequences):
        q, k:  [B, T, H, K]  queries and keys, ALREADY L2-normalized over K by the caller (not done here).
        v:     [B, T, H, V]  values.
        g:     [B, T, H, K]  per-channel LOG decay, <= 0 (fp32, typically in (-5, 0)).
        beta:  [B, T, H]     delta-rule write strength in (0, 1).

    Args:
        scale: multiplier applied to q; defaults to K ** -0.5.
        initial_state: [N, H, K, V], any float dtype (used in fp32); zeros when None.
        output_final_state: when True also return the state after the last token.
        cu_seqlens: optional 1-D int64 tensor [N + 1] of cumulative boundaries (first 0, last T) for
            sequences packed along T. Requires B == 1. Each sequence starts from its own row of
            initial_state and no token sees another sequence. Without it, N == B.

    Per (sequence, head) the state S is K x V, and for each token t:
        S   <- diag(exp(g_t)) S                (row d of S scaled by exp(g_t[d]))
        u_t  = beta_t * (v_t - S^T k_t)
        S   <- S + k_t u_t^T
        o_t  = S^T (scale * q_t)                (the state already includes token t)

    Returns:
        (o, final_state): o is [B, T, H, V] in v.dtype; final_state is [N, H, K, V] in fp32 (fp64 when
        an input is fp64) if output_final_state, else None.

    All arithmetic is fp32 (inputs are upcast; fp64 inputs stay fp64). Differentiable with respect to
    q, k, v, g, beta and initial_state.

    Raises:
        ValueError naming the argument on malformed input: shape mismatch between q, k, v, g, beta;
        cu_seqlens with B != 1 or boundaries that are not non-decreasing from 0 to T; initial_state
        not [N, H, K, V].
    """
    return reference.chunk_kda(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                               output_final_state=output_final_state, cu_seqlens=cu_seqlens)


def recurrent_kda(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, *, scale: float | None = None,
                  initial_state: Tensor | None = None, output_final_state: bool = False,
                  cu_seqlens: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    """KDA one token at a time: the defining recurrence. Same arguments, math and returns as ``chunk_kda``.

    Use for decode: T == 1 (or a few tokens) with the cached state as initial_state and
    output_final_state=True to get the next cache. Cost is linear in T with a Python step per token,
    so prefer ``chunk_kda`` for long inputs.
    """
    return reference.recurrent_kda(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                                   output_final_state=output_final_state, cu_seqlens=cu_seqlens)


def chunk_kda_with_gate(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, A_log: Tensor, dt_bias: Tensor,
                        *, lower_bound: float, scale: float | None = None, initial_state: Tensor | None = None,
                        output_final_state: bool = False, cu_seqlens: Tensor | None = None
                        ) -> tuple[Tensor, Tensor | None]:
    """K3's KDA for prefill and training: `chunk_kda` with the activations applied inside.

    Shapes as `chunk_kda`, but the inputs are pre-activation:
        q, k:  [B, T, H, K]  raw (after the short conv); L2-normalized inside (eps 1e-6 in the sqrt).
        g:     [B, T, H, K]  raw decay input (f_b_proj output); the log-decay is
               lower_bound * sigmoid(exp(A_log[h]) * (g + dt_bias)).
        beta:  [B, T, H]     logits; sigmoid inside.
        A_log: [>= H] fp32 (the first H used); dt_bias: [H*K] fp32.
    On CUDA this is fla-core's `chunk_kda` with K3's flags (gate, norm and sigmoid in the kernel, safe gate);
    elsewhere, or under `use_backend("torch")`, the reference. Returns (o [B, T, H, V] in v.dtype, state | None).
    """
    return _with_gate(fla.chunk_kda_with_gate, reference.chunk_kda, q, k, v, g, beta, A_log, dt_bias, lower_bound,
                      scale=scale, initial_state=initial_state, output_final_state=output_final_state,
                      cu_seqlens=cu_seqlens)


def recurrent_kda_with_gate(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, A_log: Tensor,
                            dt_bias: Tensor, *, lower_bound: float, scale: float | None = None,
                            initial_state: Tensor | None = None, output_final_state: bool = False,
                            cu_seqlens: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    """`chunk_kda_with_gate` one token at a time, for decode (fla's `fused_recurrent_kda` on CUDA)."""
    return _with_gate(fla.recurrent_kda_with_gate, reference.recurrent_kda, q, k, v, g, beta, A_log, dt_bias,
                      lower_bound, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
                      cu_seqlens=cu_seqlens)


def decode_kda_with_gate(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, A_log: Tensor, dt_bias: Tensor,
                         *, lower_bound: float, scale: float | None = None, states: Tensor, slots: Tensor) -> Tensor:
    """One decode token per sequence, each continuing the state kept in its slot of a pool and leaving its new state
    there: `recurrent_kda_with_gate` with the gather before it and the scatter after it folded in.

    Shapes: q, k, g [N, 1, H, K], v [N, 1, H, V], beta [N, 1, H] (pre-activation, as `recurrent_kda_with_gate`);
    states [S, H, K, V] fp32, updated in place; slots [N] int, distinct (rows on one padding slot leave it scratch).
    Returns o [N, 1, H, V] in v.dtype, bitwise what `recurrent_kda_with_gate(initial_state=states[slots])` returns,
    and states[slots] its final state. On CUDA, fla's recurrent kernel in its continuous-batching mode reads and
    writes the slots itself: the gather and `index_copy_` it saves were 3.6 ms of a 33 ms decode step at 64
    sequences on the H200 (BENCHMARKS.md)."""
    if use_fast(v, "kda"):
        require(has_fla(), "KDA", "fla-core")
        return fla.decode_kda_with_gate(q, k, v, g, beta, A_log, dt_bias, lower_bound=lower_bound, scale=scale,
                                        states=states, slots=slots)
    o, state = recurrent_kda_with_gate(q, k, v, g, beta, A_log, dt_bias, lower_bound=lower_bound, scale=scale,
                                       initial_state=states[slots], output_final_state=True)
    states.index_copy_(0, slots, state.to(states.dtype))
    return o


def supports_checkpoints(v: Tensor) -> bool:
    """Whether `chunk_kda_with_gate_checkpoints` can run on tensors like `v` (the reference can; fla's
    kernels keep their chunk states internal, so on CUDA a serving engine snapshots at chunk ends only)."""
    return not use_fast(v, "kda")


def chunk_kda_with_gate_checkpoints(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, A_log: Tensor,
                                    dt_bias: Tensor, *, lower_bound: float, offsets: list[list[int]],
                                    scale: float | None = None, initial_state: Tensor | None = None,
                                    cu_seqlens: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """`chunk_kda_with_gate` that also returns the states at CHUNK_SIZE-grid `offsets` inside each sequence
    (reference backend only, see `supports_checkpoints`): (o, final_state [N, H, K, V], checkpoints
    [M, H, K, V] in (sequence, offset) order). Offsets count from each sequence's start in this call."""
    if not supports_checkpoints(v):
        raise ValueError("interior KDA checkpoints need the reference backend (fla keeps its chunk states)")
    q, k, g, beta = reference.gate_inputs(q, k, g, beta, A_log, dt_bias, lower_bound)
    return reference.chunk_kda_checkpoints(q, k, v, g, beta, offsets=offsets, scale=scale,
                                           initial_state=initial_state, cu_seqlens=cu_seqlens)


def _with_gate(fast, ref, q, k, v, g, beta, A_log, dt_bias, lower_bound, **kw):
    """fla's fused kernel on CUDA; elsewhere the activations in torch, then the reference delta rule."""
    if use_fast(v, "kda"):
        require(has_fla(), "KDA", "fla-core")  # the reference is far slower on a GPU: never fall back silently
        return fast(q, k, v, g, beta, A_log, dt_bias, lower_bound=lower_bound, **kw)
    q, k, g, beta = reference.gate_inputs(q, k, g, beta, A_log, dt_bias, lower_bound)
    return ref(q, k, v, g, beta, **kw)
