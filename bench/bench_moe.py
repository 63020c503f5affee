"""Routed experts at K3 size on one GPU: both MXFP4 W4A16 backends (our Triton kernels, Humming's MoE GEMM)
vs the bf16 torch._grouped_mm path.

Builds K3's 896 experts (L=3584 -> 2 x F=3072 -> L, top-16) chunk by chunk on the GPU from random normal
weights (MXFP4-encoded once; the bf16 copies are their exact decode), draws one random routing per size,
checks each W4A16 backend's output against the grouped bf16 output, and times all three (median of
triton.testing.do_bench, eager and CUDA-graph replay) at N = 16, 256, 4096 tokens against two floors: the bytes
of the experts the routing touches over the measured copy bandwidth, and 2*N*A*3*F*L over the measured bf16
matmul rate. Humming runs where humming-kernels imports (its one-time weight re-layout and first-call JIT are
reported apart); `kimik3.ops.moe` picks between the two backends from these numbers.

    python bench/bench_moe.py            # table + $OUT/bench_moe.json (out/bench/ without $OUT)
    python bench/bench_moe.py --sweep    # also time each candidate tile config of the Triton kernels
"""

from __future__ import annotations

import argparse
import json
import os
import time
from importlib.metadata import version

import torch
from triton.testing import do_bench, do_bench_cudagraph

from kimik3.ops.moe import grouped, has_humming, triton_mxfp4
from kimik3.ops.mxfp4 import decode, encode

E, L, F, A = 896, 3584, 3072, 16
BETA, LINEAR_BETA = 4.0, 25.0
COPY_BW = 4.25e12  # B/s, device-to-device copy measured on this H200 (design.md section 6)
MATMUL = 692e12  # FLOP/s, bf16 8192^3 matmul measured there
SIZES = (16, 256, 4096)
SWEEP = {  # (BM, BN, BK, SWAP, num_warps, num_stages), used for both stages; the first is the default
    "small": [(16, 64, 128, True, 2, 3), (16, 64, 256, False, 4, 3), (16, 64, 128, True, 2, 4),
              (16, 64, 256, False, 4, 4)],
    "large": [(128, 64, 128, True, 4, 3), (128, 128, 128, True, 8, 3), (128, 64, 64, True, 4, 4)],
}


def build(chunk: int = 16):
    """(packed, scales, bf16 weights) of E random experts, made on the GPU a few experts at a time."""
    shapes = ((F, L), (F, L), (L, F))
    packed = [torch.empty(E, o, i // 2, dtype=torch.uint8, device="cuda") for o, i in shapes]
    scales = [torch.empty(E, o, i // 32, dtype=torch.uint8, device="cuda") for o, i in shapes]
    dense = [torch.empty(E, o, i, dtype=torch.bfloat16, device="cuda") for o, i in shapes]
    gen = torch.Generator(device="cuda").manual_seed(0)
    for k, (o, i) in enumerate(shapes):
        for e0 in range(0, E, chunk):
            p, s = encode(torch.randn(chunk, o, i, device="cuda", generator=gen) / i ** 0.5)
            packed[k][e0:e0 + chunk], scales[k][e0:e0 + chunk] = p, s
            dense[k][e0:e0 + chunk] = decode(p, s, torch.bfloat16)
    return tuple(packed), tuple(scales), dense


def rel_err(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item() if torch.isfinite(a).all() else float("nan")


def time_ms(fn, graph: bool) -> float:
    if graph:
        return do_bench_cudagraph(fn, rep=200, return_mode="median")
    return do_bench(fn, warmup=25, rep=200, return_mode="median")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true")
    args = ap.parse_args()
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  building {E} experts ...", flush=True)
    packed, scales, dense = build()
    humming, setup = None, {}
    if has_humming():
        from kimik3.ops.moe import humming

        setup["humming_kernels"] = version("humming-kernels")
        t0 = time.perf_counter()
        humming._prepared(packed, scales)
        torch.cuda.synchronize()
        setup["humming_relayout_s"] = time.perf_counter() - t0
        print(f"humming: weights re-laid out in {setup['humming_relayout_s']:.1f} s", flush=True)
    else:
        print("humming-kernels is not installed: Triton and bf16 only", flush=True)
    mx_expert = 3 * F * L * (0.5 + 1 / 32)
    bf_expert = 3 * F * L * 2
    rows, results = [], []
    for N in SIZES:
        z = torch.randn(N, L, device="cuda").bfloat16()
        idx = torch.rand(N, E, device="cuda").topk(A, dim=1).indices
        tw = torch.softmax(torch.randn(N, A, device="cuda"), dim=1)

        def mx(c=None):
            if c is None:
                return triton_mxfp4.routed_experts_mxfp4(z, idx, tw, packed, scales, BETA, LINEAR_BETA)
            return triton_mxfp4.routed_experts_mxfp4(z, idx, tw, packed, scales, BETA, LINEAR_BETA, configs=(c, c))

        def bf():
            return grouped.routed_experts(z, idx, tw, *dense, BETA, LINEAR_BETA)

        def hm():
            return humming.routed_experts_mxfp4(z, idx, tw, packed, scales, BETA, LINEAR_BETA)

        err = rel_err(mx(), bf())
        touched = torch.unique(idx).numel()
        res = dict(N=N, touched=touched, rel_err=err, mem_floor_mx_ms=touched * mx_expert / COPY_BW * 1e3,
                   mem_floor_bf16_ms=touched * bf_expert / COPY_BW * 1e3,
                   flop_floor_ms=2 * N * A * 3 * F * L / MATMUL * 1e3)
        cases = [("mx", mx), ("bf16", bf)]
        if humming is not None:
            t0 = time.perf_counter()
            res["hm_rel_err"] = rel_err(hm(), bf())  # the first call at this size picks tiles and JIT-compiles
            res["hm_first_call_s"] = time.perf_counter() - t0
            cases.append(("hm", hm))
        for name, fn in cases:
            res[f"{name}_ms"] = time_ms(fn, graph=False)
            try:
                res[f"{name}_graph_ms"] = time_ms(fn, graph=True)
            except Exception as exc:  # a path that cannot be captured is reported, not fatal
                res[f"{name}_graph_ms"] = float("nan")
                print(f"  {name} N={N}: CUDA graph capture failed: {exc!r}"[:200])
        res["default_config"] = [list(c) for c in triton_mxfp4._pick(N * A / E)]
        if args.sweep:
            res["sweep"] = {}
            for c in SWEEP["small" if N * A / E <= 24 else "large"]:
                try:
                    e = rel_err(mx(c), bf())
                    t = time_ms(lambda c=c: mx(c), graph=True)
                except Exception as exc:
                    print(f"  config {c}: {exc!r}"[:300])
                    continue
                res["sweep"][str(c)] = dict(ms=t, rel_err=e)
                print(f"  N={N:5d} config {c}: {t:.3f} ms (graph), rel err {e:.1e}", flush=True)
        results.append(res)
        floor = max(res["mem_floor_mx_ms"], res["flop_floor_ms"])
        nan = float("nan")
        hm_graph = res.get("hm_graph_ms", nan)
        rows.append(f"{N:6d} {touched:5d} {err:9.1e} {res['mx_ms']:8.3f} {res['mx_graph_ms']:8.3f} "
                    f"{res.get('hm_rel_err', nan):9.1e} {res.get('hm_ms', nan):8.3f} {hm_graph:8.3f} "
                    f"{res['mx_graph_ms'] / hm_graph:6.2f}x "
                    f"{res['bf16_ms']:8.3f} {res['bf16_graph_ms']:8.3f} {res['bf16_ms'] / res['mx_ms']:6.2f}x "
                    f"{res['mem_floor_mx_ms']:7.3f} {res['mem_floor_bf16_ms']:7.3f} {res['flop_floor_ms']:7.3f} "
                    f"{floor / res['mx_graph_ms']:6.1%} {floor / hm_graph:6.1%}")
    os.makedirs(out_dir := os.environ.get("OUT", "out/bench"), exist_ok=True)  # out/ is git-ignored
    out = os.path.join(out_dir, "bench_moe.json")
    with open(out, "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, E=E, L=L, F=F, A=A,
                       copy_bw=COPY_BW, matmul=MATMUL, **setup,
                       results=results), f, indent=1)
    print("\n     N  touch   relerr    mx ms  mx grph hm relerr    hm ms  hm grph  mx/hm  bf16 ms bf16 grph  "
          "bf/mx  mxmemF  bfmemF  flopF mx/floor hm/floor\n" + "\n".join(rows) + f"\n(json: {out})")


if __name__ == "__main__":
    main()
