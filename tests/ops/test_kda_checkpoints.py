"""KDA states exported at chunk-grid offsets inside a prefill == the final state of a run over that prefix."""

import pytest
import torch

from kimik3.ops.kda import CHUNK_SIZE, chunk_kda_with_gate, chunk_kda_with_gate_checkpoints


def inputs(T, H=2, K=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return (r(1, T, H, K), r(1, T, H, K), r(1, T, H, K), r(1, T, H, K), r(1, T, H), r(H).abs(), r(H * K) * 0.1,
            r(3, H, K, K) * 0.1)


def test_checkpoints_equal_prefix_final_states_bitwise():
    q, k, v, g, b, A_log, dt, s0 = inputs(300)
    cu = torch.tensor([0, 70, 70 + 200, 300])  # three packed sequences, each from its own initial state
    offsets = [[64], [64, 128, 192], []]
    kw = dict(lower_bound=-5.0, initial_state=s0)
    o, final, ckpt = chunk_kda_with_gate_checkpoints(q, k, v, g, b, A_log, dt, offsets=offsets, cu_seqlens=cu, **kw)
    o_ref, final_ref = chunk_kda_with_gate(q, k, v, g, b, A_log, dt, output_final_state=True, cu_seqlens=cu, **kw)
    assert torch.equal(o, o_ref) and torch.equal(final, final_ref)
    assert ckpt.shape == (4, 2, 16, 16)
    expected = [(0, 0, 64), (1, 70, 64), (1, 70, 128), (1, 70, 192)]
    for row, (n, start, off) in zip(ckpt, expected):
        sl = slice(start, start + off)
        _, s = chunk_kda_with_gate(q[:, sl], k[:, sl], v[:, sl], g[:, sl], b[:, sl], A_log, dt, lower_bound=-5.0,
                                   initial_state=s0[n:n + 1], output_final_state=True)
        assert torch.equal(row, s[0]), (n, off)


def test_offsets_off_the_grid_are_refused():
    q, k, v, g, b, A_log, dt, _ = inputs(100)
    with pytest.raises(ValueError, match=f"multiples of {CHUNK_SIZE}"):
        chunk_kda_with_gate_checkpoints(q, k, v, g, b, A_log, dt, lower_bound=-5.0, offsets=[[50]])
