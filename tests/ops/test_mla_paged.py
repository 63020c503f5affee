"""Absorbed MLA over the paged latent cache: the reference against `mla_latent_attention` (and expanded attention)
on the same keys, the split-K Triton kernel against the reference.

CPU: the kernel under Triton's interpreter (switched on in tests/conftest.py) when triton is installed, else
skipped. GPU (`-m gpu`): K3's MLA dims in bf16 on CUDA. Pool rows past each length are NaN (never in the output).
Bounds (design.md §3): fp32 < 1e-5 relative; bf16 < 2e-2 (bf16 queries, latents and o_lat; fp32 softmax).
"""

import pytest
import torch

from kimik3.ops import mla
from kimik3.ops.mla import reference
from tests.helpers import interpret_triton, patch_interpreter_index, rel_err, requires_cuda

INTERPRET = not torch.cuda.is_available() and interpret_triton()
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
# pairwise-distinct small dims: latent C, shared key R, nope N, value V, heads H
C, R, NOPE, V, H = 48, 16, 24, 20, 3


@pytest.fixture(scope="module")
def fast():
    """`kimik3.ops.mla.paged_triton` in Triton's interpreter on CPU tensors (its loop over each query's key blocks
    has runtime bounds: `patch_interpreter_index`)."""
    if not INTERPRET:
        pytest.skip("needs triton, no CUDA, and triton not imported before this module")
    from kimik3.ops.mla import paged_triton

    with pytest.MonkeyPatch.context() as mp:
        patch_interpreter_index(mp)
        yield paged_triton


def case(seq_lens, q_lens, block_size, dtype, *, c=C, r=R, nope=NOPE, v=V, h=H, seed=0, device="cpu"):
    """Random queries, weights and a shuffled paged pool: sequences own distinct blocks except that every one
    shares block table entry 0's block with sequence 0 (a shared prefix block), table entries past each sequence's
    blocks are random valid ids, and every pool row at a position >= its sequence's length is NaN."""
    gen = torch.Generator().manual_seed(seed)
    n = len(seq_lens)
    blocks = [-(-s // block_size) for s in seq_lens]
    m = max(blocks)
    X_blocks = sum(blocks) + 3
    perm = torch.randperm(X_blocks, generator=gen)
    table = torch.randint(0, X_blocks, (n, m), generator=gen)
    at = 0
    for i, b in enumerate(blocks):
        table[i, :b] = perm[at:at + b]
        at += b
    pool = torch.randn(X_blocks * block_size, c + r, generator=gen)
    live = torch.zeros(X_blocks * block_size, dtype=torch.bool)
    for i, s in enumerate(seq_lens):
        pos = torch.arange(s)
        live[table[i, pos // block_size] * block_size + pos % block_size] = True
    # a block shared by two sequences: sequence 1 (when long enough) reads sequence 0's first block as its own
    if n > 1 and seq_lens[0] >= block_size and seq_lens[1] >= block_size:
        table[1, 0] = table[0, 0]
    pool[~live] = float("nan")
    T = sum(q_lens)
    q = torch.randn(T, h, nope + r, generator=gen)
    w = torch.randn(h * (nope + v), c, generator=gen) * c**-0.5
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()])
    to = dict(device=device)
    return (q.to(dtype=dtype, **to), pool.to(dtype=dtype, **to), w.to(dtype=dtype, **to),
            dict(block_tables_NM=table.to(torch.int32).to(**to), cu_seqlens_q=cu.to(**to),
                 seq_lens_N=torch.tensor(seq_lens).to(**to), block_size=block_size, qk_nope_head_dim=nope,
                 scale=(nope + r) ** -0.5))


def gathered(q, pool, w, kw):
    """`mla_latent_attention` per sequence on its keys gathered from the table (rows past its length never read)."""
    outs, cu, bs = [], kw["cu_seqlens_q"].tolist(), kw["block_size"]
    for i, s in enumerate(kw["seq_lens_N"].tolist()):
        pos = torch.arange(s)
        lat = pool[kw["block_tables_NM"][i, pos // bs].long() * bs + pos % bs][None]
        qn = q[cu[i]:cu[i + 1]][None]
        t = qn.shape[1]
        mask = pos[None] <= torch.arange(s - t, s)[:, None]
        outs.append(reference.mla_latent_attention(qn, lat, w, qk_nope_head_dim=kw["qk_nope_head_dim"],
                                                   scale=kw["scale"], mask=mask[None])[0])
    return torch.cat(outs)


CASES = [  # (seq_lens, q_lens, block_size)
    ([1], [1], 4),
    ([7, 13, 4], [1, 1, 1], 4),
    ([9, 2, 16, 30], [2, 2, 1, 5], 8),
    ([33, 5], [5, 5], 4),
]


@pytest.mark.parametrize("seq_lens,q_lens,bs", CASES)
def test_reference_is_latent_attention(seq_lens, q_lens, bs):
    q, pool, w, kw = case(seq_lens, q_lens, bs, torch.float32)
    out = reference.paged_latent_attention(q, pool, w, **kw)
    assert out.shape == (sum(q_lens), H, V) and torch.isfinite(out).all()
    assert rel_err(out, gathered(q, pool, w, kw)) < 1e-6
    # a larger host bound (gathers more, masked) changes nothing
    assert rel_err(reference.paged_latent_attention(q, pool, w, **kw, max_seq_len=max(seq_lens) + 2 * bs), out) < 1e-6


def test_reference_is_expanded_attention():
    """The absorbed math equals expanded attention with K = [W_kb c ; k_r], V = W_vb c (fp32 rounding)."""
    seq_lens, q_lens, bs = [11], [3], 4
    q, pool, w, kw = case(seq_lens, q_lens, bs, torch.float32)
    pos = torch.arange(11)
    lat = pool[kw["block_tables_NM"][0, pos // bs].long() * bs + pos % bs]
    w_HXC = w.view(H, NOPE + V, C)
    k = torch.cat([torch.einsum("hnc,sc->shn", w_HXC[:, :NOPE], lat[:, :C]), lat[:, None, C:].expand(-1, H, -1)], -1)
    v = torch.einsum("hvc,sc->shv", w_HXC[:, NOPE:], lat[:, :C])
    mask = pos[None] <= torch.arange(8, 11)[:, None]
    want = reference.mla_attention(q[None], k[None], v[None], scale=kw["scale"], mask=mask[None])[0]
    assert rel_err(reference.paged_latent_attention(q, pool, w, **kw), want) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seq_lens,q_lens,bs", CASES)
def test_kernel_is_reference(fast, monkeypatch, seq_lens, q_lens, bs, dtype):
    """Every buffer the op allocates (stage-1 partials, o_lat) starts NaN: each must be written before it is read."""
    q, pool, w, kw = case(seq_lens, q_lens, bs, dtype, seed=1)
    empty = torch.empty
    monkeypatch.setattr(fast.torch, "empty", lambda *a, **k: empty(*a, **k).fill_(float("nan")))
    out = fast.paged_latent_attention(q, pool, w, **kw)
    monkeypatch.undo()
    want = reference.paged_latent_attention(q.float(), pool.float(), w.float(), **kw)
    assert out.dtype == dtype and out.shape == want.shape
    assert rel_err(out.float(), want) < TOL[dtype]


def test_kernel_work_ignores_table_width(fast, monkeypatch):
    """A table padded from M to 16*M with junk ids launches the same grid over the same inputs but the table, and
    gives the same output: the kernel walks each sequence's live blocks, not the table."""
    launches = []
    real = fast.launch_shape

    def spy(*args):
        launches.append((args, real(*args)))
        return launches[-1][1]

    monkeypatch.setattr(fast, "launch_shape", spy)
    seq_lens, q_lens, bs = [9, 2, 16, 30], [2, 2, 1, 5], 8
    q, pool, w, kw = case(seq_lens, q_lens, bs, torch.float32, seed=2)
    table = kw["block_tables_NM"]
    junk = torch.randint(0, pool.shape[0] // bs, (table.shape[0], 15 * table.shape[1]), dtype=table.dtype)
    wide = {**kw, "block_tables_NM": torch.cat([table, junk], dim=1)}
    out_narrow = fast.paged_latent_attention(q, pool, w, **kw, max_seq_len=32)
    out_wide = fast.paged_latent_attention(q, pool, w, **wide, max_seq_len=32)
    assert launches[0] == launches[1]
    assert torch.equal(out_narrow, out_wide)


def test_dispatch_on_cpu_is_reference():
    q, pool, w, kw = case([7, 13], [1, 2], 4, torch.float32)
    assert torch.equal(mla.paged_latent_attention(q, pool, w, **kw), reference.paged_latent_attention(q, pool, w, **kw))
    with pytest.raises(ValueError, match="block_size"):
        mla.paged_latent_attention(q, pool, w, **{**kw, "block_size": 6})


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("q_len", [1, 2, 5])
def test_k3_dims_bf16_gpu(q_len):
    """K3's MLA dims (C 512, R 64, nope 128, V 128, H 96, blocks of 64) in bf16 on CUDA, eager and from a CUDA
    graph, against the fp32 reference."""
    seq_lens = [max(q_len, n) for n in (1, 63, 64, 65, 1000, 4097)]  # every query sees a key (the op's contract)
    q, pool, w, kw = case(seq_lens, [q_len] * len(seq_lens), 64, torch.bfloat16, c=512, r=64, nope=128, v=128,
                          h=96, device="cuda")
    want = reference.paged_latent_attention(q.float(), pool.float(), w.float(), **kw)
    out = mla.paged_latent_attention(q, pool, w, **kw, max_seq_len=8192)
    assert rel_err(out.float(), want) < TOL[torch.bfloat16]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replay = mla.paged_latent_attention(q, pool, w, **kw, max_seq_len=8192)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(replay, out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_is_batch_invariant(dtype):
    """A query row's output is bitwise the same whatever the step's other sequences are: however far they reach
    (the key span the reference gathers) and however many rows there are, one included."""
    q, pool, w, kw = case([300, 1500, 9], [1, 1, 1], 16, dtype, seed=3)
    alone = dict(kw, block_tables_NM=kw["block_tables_NM"][:1], cu_seqlens_q=kw["cu_seqlens_q"][:2],
                 seq_lens_N=kw["seq_lens_N"][:1])
    want = reference.paged_latent_attention(q[:1], pool, w, **alone)
    for span in (None, 305, 2000):  # the bound the step passes: its own length, a little over it, far over it
        assert torch.equal(reference.paged_latent_attention(q[:1], pool, w, **alone, max_seq_len=span), want)
    assert torch.equal(reference.paged_latent_attention(q, pool, w, **kw)[:1], want)  # beside a 1,500-key row


def _first_row_beside(op, q, pool, w, kw, others: list[int], span: int):
    """Sequence 0's output (one query row) in a step with sequences 1.. cut to `others` of them, under host bound
    `span`: the step's size and reach change, sequence 0 does not."""
    n = 1 + len(others)
    step = dict(kw, block_tables_NM=kw["block_tables_NM"][:n], cu_seqlens_q=kw["cu_seqlens_q"][:n + 1],
                seq_lens_N=kw["seq_lens_N"][:n])
    return op(q[:n], pool, w, **step, max_seq_len=span)[:1]


def test_invariant_splits_follow_each_row_alone(fast, monkeypatch):
    """In batch-invariant mode a row's key ranges follow its own length: beside a short or a long sequence, under
    a bound of its own length or far past it (other grids), its output is the same bits, near the reference. The
    products around the kernel are CPU torch here, so the query row count stays 2 (T changes the absorption GEMM's
    shape, which is the products' half of the mode, tested in test_matmul.py)."""
    from kimik3.ops.backend import use_backend

    monkeypatch.setattr(fast, "INVARIANT_SPLIT_KEYS", 16)  # 4 blocks a range: the 60-key row gets several
    q, pool, w, kw = case([60, 5, 900], [1, 1, 1], 4, torch.float32, seed=4)
    with use_backend(batch_invariant=True):
        grids = [fast.split_rule(2, H, span, 4)[0] for span in (60, 900, 4000)]
        assert len({g[2] for g in grids}) == 3  # three grids, one answer
        outs = [fast.paged_latent_attention(q[:2], pool, w, **dict(kw, block_tables_NM=kw["block_tables_NM"][i],
                                                                   cu_seqlens_q=kw["cu_seqlens_q"][:3],
                                                                   seq_lens_N=kw["seq_lens_N"][i]),
                                            max_seq_len=span)[:1]
                for i, span in (([0, 1], 60), ([0, 1], 4000), ([0, 2], 900), ([0, 2], 4000))]
    for out in outs[1:]:
        assert torch.equal(out, outs[0])
    want = reference.paged_latent_attention(q[:1], pool, w, **dict(kw, block_tables_NM=kw["block_tables_NM"][:1],
                                                                      cu_seqlens_q=kw["cu_seqlens_q"][:2],
                                                                      seq_lens_N=kw["seq_lens_N"][:1]))
    assert rel_err(outs[0], want) < 1e-5


def test_split_rule_covers_every_row():
    """In batch-invariant mode every row's ranges fit the grid, at most MAX_SPLITS of them, for any length up to
    the bound; by default the grid is `launch_shape`'s and the divisor its split count."""
    from kimik3.ops.backend import use_backend
    from kimik3.ops.mla import paged_triton as pt

    bs = 64
    for span in (1, 64, 300, 4096, 70_000, 1 << 20):
        grid, divisor, min_blocks = pt.split_rule(8, 96, span, bs)
        assert grid == pt.launch_shape(8, 96, span, bs) and (divisor, min_blocks) == (grid[2], 1)
        with use_backend(batch_invariant=True):
            grid, divisor, min_blocks = pt.split_rule(8, 96, span, bs)
        assert divisor == pt.MAX_SPLITS and min_blocks == pt.INVARIANT_SPLIT_KEYS // bs
        for length in {1, span // 3 + 1, span}:
            blocks = -(-length // bs)
            per = max(-(-blocks // divisor), min_blocks)
            assert -(-blocks // per) <= grid[2] <= pt.MAX_SPLITS


@pytest.mark.gpu
@requires_cuda
def test_k3_dims_batch_invariant_gpu():
    """K3's dims in bf16 on CUDA inside `batch_invariant`: sequence 0's row alone, beside 1 to 63 others of up to
    20k keys (other row counts, grids and key spans), eager and from a graph, is the same bits; near the
    reference."""
    from kimik3.ops.matmul import batch_invariant

    gen = torch.Generator().manual_seed(7)
    lens = [777] + torch.randint(1, 20_000, (63,), generator=gen).tolist()
    q, pool, w, kw = case(lens, [1] * 64, 64, torch.bfloat16, c=512, r=64, nope=128, v=128, h=96, device="cuda")
    with batch_invariant():
        want = _first_row_beside(mla.paged_latent_attention, q, pool, w, kw, [], 777)
        for n, span in ((1, 1024), (7, 20_000), (63, 20_000), (63, 1 << 20)):
            got = _first_row_beside(mla.paged_latent_attention, q, pool, w, kw, list(range(n)), span)
            assert torch.equal(got, want), (n, span)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            replay = _first_row_beside(mla.paged_latent_attention, q, pool, w, kw, list(range(15)), 1 << 17)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(replay, want)
    ref = reference.paged_latent_attention(q[:1].float(), pool.float(), w.float(),
                                           **dict(kw, block_tables_NM=kw["block_tables_NM"][:1],
                                                  cu_seqlens_q=kw["cu_seqlens_q"][:2], seq_lens_N=kw["seq_lens_N"][:1]))
    assert rel_err(want.float(), ref) < TOL[torch.bfloat16]
