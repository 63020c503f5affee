"""Absorbed MLA decode over the paged latent cache: `paged_latent_attention`'s Triton kernel (CUDA-graphed) vs
gathering the latents and `mla_latent_attention` (bf16 fast path), at K3's MLA dims (H 96, C 512, R 64, nope 128,
V 128, blocks of 64, bf16), contexts 1k / 32k / 128k for 1 / 8 / 64 sequences, one query each. Block tables are
sized for 1,048,576 positions (16,384 blocks, junk past each sequence's blocks) as the engine's: the kernel's
time should follow the context, not the table. Gathers: over the context ("gather ctx", the best a gather can do)
and over the whole table ("gather table", today's engine step; skipped past 24 GB). Bytes floor: the live latents
read once (N * ctx * 576 * 2 B) at the copy bandwidth measured in the same run (4.25e12 B/s on the H200).

    PYTHONPATH=src:. python3 bench/bench_mla_paged.py            # device: table + $OUT/bench_mla_paged.json
    PYTHONPATH=src:. python3 bench/bench_mla_paged.py --smoke    # CPU check of this script at toy sizes
"""

from __future__ import annotations

import torch

from bench.common import DEVICE, ceilings, environment, graphed, median_ms, table, write_json
from kimik3.ops.backend import use_backend
from kimik3.ops.mla import mla_latent_attention, paged_latent_attention

TABLE_POSITIONS = 1 << 20
GATHER_BYTES_LIMIT = 24e9


def gather_decode(q, pool, w, table_NM, seq_lens, span, bs, nope, scale):
    """Today's path: the [N, span, C+R] latents gathered through the table, then absorbed attention over them."""
    pos = torch.arange(span, device=pool.device)
    lat = pool[table_NM[:, pos // bs].long() * bs + pos % bs]
    mask = (pos[None] < seq_lens[:, None])[:, None]
    return mla_latent_attention(q[:, None], lat, w, qk_nope_head_dim=nope, scale=scale, mask=mask)[:, 0]


def one_case(N, ctx, w, dims, table_blocks, copy):
    """Medians (ms) of the paged op graphed and of the two gathers, the floor and the error, at N sequences of ctx."""
    H, C, R, NOPE, BS = dims
    scale = (NOPE + R) ** -0.5
    live = -(-ctx // BS)
    pool = torch.randn(N * live * BS, C + R, device=DEVICE, dtype=torch.bfloat16)
    table_NM = torch.randint(0, N * live, (N, table_blocks), device=DEVICE, dtype=torch.int32)
    table_NM[:, :live] = torch.randperm(N * live, device=DEVICE, dtype=torch.int32).view(N, live)
    seq_lens = torch.full((N,), ctx, device=DEVICE)
    q = torch.randn(N, H, NOPE + R, device=DEVICE, dtype=torch.bfloat16)
    kw = dict(block_tables_NM=table_NM, cu_seqlens_q=torch.arange(N + 1, device=DEVICE), seq_lens_N=seq_lens,
              block_size=BS, qk_nope_head_dim=NOPE, scale=scale, max_seq_len=ctx)

    def gather(span):
        return lambda: gather_decode(q, pool, w, table_NM, seq_lens, span, BS, NOPE, scale)

    res = {"paged ms": median_ms(graphed(lambda: paged_latent_attention(q, pool, w, **kw)), 5, 30),
           "gather ctx ms": median_ms(gather(ctx), 3, 10)}
    whole = table_blocks * BS
    res["gather table ms"] = median_ms(gather(whole), 2, 5) if N * whole * (C + R) * 2 <= GATHER_BYTES_LIMIT else None
    res["floor ms"] = N * ctx * (C + R) * 2 / copy * 1e3
    if N * ctx <= 65536:  # the fp32 reference's gathers fit
        out = paged_latent_attention(q, pool, w, **kw).float()
        with use_backend("torch"):
            ref = paged_latent_attention(q.float(), pool.float(), w.float(), **kw)
        res["rel err"] = float((out - ref).norm() / ref.norm())
    return res


def main(smoke: bool = False):
    copy = 4.25e12 if smoke else ceilings()["copy_bytes_per_s"]
    H, C, R, NOPE, V, BS = (4, 32, 16, 16, 16, 16) if smoke else (96, 512, 64, 128, 128, 64)
    contexts, batches = ((100, 300), (1, 3)) if smoke else ((1024, 32768, 131072), (1, 8, 64))
    table_blocks = (4096 if smoke else TABLE_POSITIONS) // BS
    w = torch.randn(H * (NOPE + V), C, device=DEVICE, dtype=torch.bfloat16) * C**-0.5
    rows, results = [], {}
    for N in batches:
        for ctx in contexts:
            res = results[f"N={N} ctx={ctx}"] = one_case(N, ctx, w, (H, C, R, NOPE, BS), table_blocks, copy)
            tab = res["gather table ms"]
            rows.append([N, ctx, f"{res['paged ms']:.3f}", f"{res['gather ctx ms']:.3f}",
                         "-" if tab is None else f"{tab:.3f}", f"{res['floor ms'] * 1e3:.1f}",
                         f"{res['floor ms'] / res['paged ms']:.0%}",
                         f"{res['rel err']:.1e}" if "rel err" in res else "-"])
    table(f"paged MLA decode, K3 dims, bf16, tables of {table_blocks * BS} positions (copy {copy / 1e12:.2f} TB/s), "
          "median ms", ["N", "ctx", "paged", "gather ctx", "gather table", "floor us", "of floor", "rel err"], rows)
    write_json("bench_mla_paged", {"env": environment(), "results": results})


if __name__ == "__main__":
    import sys

    main(smoke="--smoke" in sys.argv[1:])
