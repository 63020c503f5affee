"""AttnRes depth mix on the GPU: the fused Triton kernels against the torch reference, at K3 shapes.

Checks, then times (triton.testing.do_bench medians) the public op forward and forward+backward for both
backends, sweeps the kernels' launch shapes, and compares each with the bytes floor:
    forward  (S reads + 1 write) * N * D * 2 bytes,   backward (1 + S reads + S writes) * N * D * 2 bytes
over the measured copy bandwidth (4.25e12 B/s on the H200, design.md 6; re-measured here and printed).
Prints a ratio table last and writes everything to $OUT/bench_attnres.json (out/bench/ when OUT is unset).

    python bench/bench_attnres.py [--tokens 8192] [--blocks 1 4 8] [--no-sweep]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
from pathlib import Path

import torch
import triton
from triton.testing import do_bench

from kimik3.ops.attnres import attn_res_mix
from kimik3.ops.attnres import triton as fast
from kimik3.ops.backend import use_backend

DEVICE = "cuda"
D = 7168
EPS = 1e-5
COPY_BW = 4.25e12
SWEEP = [  # Config fields: block_d, num_warps, programs_per_sm (64: in effect a program per row), evict_first
    (1024, 4, 2), (1024, 4, 4), (1024, 4, 8), (1024, 4, 64), (2048, 8, 1), (2048, 8, 2), (2048, 8, 4),
    (2048, 8, 64), (4096, 16, 1), (4096, 16, 2), (8192, 16, 1), (8192, 32, 1),
    (1024, 4, 2, False), (1024, 4, 4, False), (2048, 8, 2, False), (2048, 8, 4, False),
]


def median_ms(fn) -> float:
    return do_bench(fn, warmup=25, rep=200, return_mode="median")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item() if torch.isfinite(a).all() else float("nan")


def inputs(M: int, N: int, dtype=torch.bfloat16):
    """Random sources of growing, per-row-varying scale; a pseudo-query that gives a mixing softmax."""
    blocks = torch.randn(M, N, D, device=DEVICE) * (1 + torch.arange(M, device=DEVICE)[:, None, None])
    blocks = blocks * (0.5 + torch.rand(M, N, 1, device=DEVICE))
    partial = torch.randn(N, D, device=DEVICE)
    nw = 1 + 0.2 * torch.randn(D, device=DEVICE)
    pw = 3 * torch.randn(1, D, device=DEVICE) / D**0.5
    return [t.to(dtype) for t in (blocks, partial, nw, pw)]


def copy_bandwidth() -> float:
    x = torch.randn(1 << 28, device=DEVICE)  # 1 GiB
    y = torch.empty_like(x)
    return 2 * x.numel() * x.element_size() / (median_ms(lambda: y.copy_(x)) * 1e-3)


def fwd_bwd(backend: str, xs, grad):
    def run():
        with use_backend(backend):
            out = attn_res_mix(*xs, EPS)
            return torch.autograd.grad(out, xs, grad)
    return run


def check(M: int, N: int) -> dict:
    """Fused vs reference: rel errors of the output and the four gradients (bf16 inputs)."""
    xs = [t.requires_grad_() for t in inputs(M, N)]
    grad = torch.randn(N, D, device=DEVICE, dtype=torch.bfloat16)
    with use_backend("torch"):
        ref = attn_res_mix(*xs, EPS)
        ref_grads = torch.autograd.grad(ref, xs, grad)
    out = attn_res_mix(*xs, EPS)
    grads = torch.autograd.grad(out, xs, grad)
    names = ["out", "blocks", "partial", "norm_weight", "proj_weight"]
    return dict(zip(names, (rel(a, b) for a, b in zip([out, *grads], [ref, *ref_grads]))))


def time_op(M: int, N: int) -> dict:
    xs = inputs(M, N)
    grad = torch.randn(N, D, device=DEVICE, dtype=torch.bfloat16)
    res = {}
    with torch.no_grad():
        res["fused_fwd_ms"] = median_ms(lambda: attn_res_mix(*xs, EPS))
        with use_backend("torch"):
            res["ref_fwd_ms"] = median_ms(lambda: attn_res_mix(*xs, EPS))
    xs = [t.requires_grad_() for t in xs]
    res["fused_fwdbwd_ms"] = median_ms(fwd_bwd("auto", xs, grad))
    res["ref_fwdbwd_ms"] = median_ms(fwd_bwd("torch", xs, grad))
    return res


def sweep(M: int, N: int) -> dict:
    """Kernel-only times of every launch shape; each checked against the default shape's result first."""
    blocks, partial, nw, pw = inputs(M, N)
    pw = pw.reshape(-1)
    grad = torch.randn(N, D, device=DEVICE, dtype=torch.bfloat16)
    out0, stats0 = fast.mix_forward(blocks, partial, nw, pw, EPS)
    gb0, gp0, dw0 = fast.mix_backward(grad, blocks, partial, nw, pw, stats0)
    rows = []
    for shape in SWEEP:
        cfg = fast.Config(*shape)
        out, stats = fast.mix_forward(blocks, partial, nw, pw, EPS, cfg)
        gb, gp, dw = fast.mix_backward(grad, blocks, partial, nw, pw, stats0, cfg)
        err = max(rel(out, out0), rel(gb, gb0), rel(gp, gp0), rel(dw, dw0))
        rows.append({"config": shape, "max_rel_vs_default": err,
                     "fwd_ms": median_ms(lambda: fast.mix_forward(blocks, partial, nw, pw, EPS, cfg)),
                     "bwd_ms": median_ms(lambda: fast.mix_backward(grad, blocks, partial, nw, pw, stats0, cfg))})
    default = {"fwd": fast.default_config(M, False), "bwd": fast.default_config(M, True)}
    return {"default": {k: list(vars(v).values()) for k, v in default.items()},
            "default_fwd_ms": median_ms(lambda: fast.mix_forward(blocks, partial, nw, pw, EPS)),
            "default_bwd_ms": median_ms(lambda: fast.mix_backward(grad, blocks, partial, nw, pw, stats0)),
            "rows": rows}


def compiled_kernels() -> list[dict]:
    """Registers and spills of every compiled variant (best effort: Triton's cache layout is internal)."""
    found = []
    for kernel in (fast._fwd_kernel, fast._bwd_kernel):
        try:
            for cache in kernel.device_caches.values():
                for compiled in cache[0].values():
                    found.append({"name": compiled.name, "constants": str(getattr(compiled.src, "constants", "")),
                                  "num_warps": compiled.metadata.num_warps, "n_regs": compiled.n_regs,
                                  "n_spills": compiled.n_spills})
        except Exception as e:  # noqa: BLE001 - a report, never a failure
            found.append({"error": repr(e)})
    return found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--blocks", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--no-sweep", action="store_true")
    args = ap.parse_args()
    torch.manual_seed(0)
    N = args.tokens
    bw = copy_bandwidth()
    result = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
              "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "tokens": N, "hidden": D, "dtype": "bfloat16", "copy_bw_measured": bw, "copy_bw_used": COPY_BW,
              "blocks": {}}
    print(f"{result['gpu']}  torch {torch.__version__}  triton {triton.__version__}  copy {bw / 1e12:.2f} TB/s "
          f"(floors use {COPY_BW / 1e12:.2f})")
    for M in args.blocks:
        S = M + 1
        row = {"errors": check(M, N), **time_op(M, N)}
        unit = N * D * 2
        row["floor_fwd_ms"] = (S + 1) * unit / COPY_BW * 1e3
        row["floor_fwdbwd_ms"] = ((S + 1) + (2 * S + 1)) * unit / COPY_BW * 1e3
        if not args.no_sweep:
            row["sweep"] = sweep(M, N)
        result["blocks"][M] = row
        print(f"M={M} errors " + " ".join(f"{k} {v:.1e}" for k, v in row["errors"].items()))
        if "sweep" in row:
            sw = row["sweep"]
            print(f"  sweep (kernel only) default fwd {sw['default_fwd_ms']:.3f} ms, bwd {sw['default_bwd_ms']:.3f} ms")
            for r in sw["rows"]:
                print(f"    {str(r['config']):25s} fwd {r['fwd_ms']:.3f}  bwd {r['bwd_ms']:.3f}  "
                      f"rel vs default {r['max_rel_vs_default']:.1e}")
    result["compiled"] = compiled_kernels()
    out_dir = Path(os.environ.get("OUT", "out/bench"))  # out/ is git-ignored
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bench_attnres.json").write_text(json.dumps(result, indent=1, default=str))

    print(f"\nAttnRes mix, bf16, N={N}, D={D}: ms (median); roofline = bytes floor / time")
    print(f"{'M':>2} {'ref fwd':>8} {'fused fwd':>9} {'speedup':>7} {'roofline':>8} | "
          f"{'ref f+b':>8} {'fused f+b':>9} {'speedup':>7} {'roofline':>8} | max rel err")
    for M, r in result["blocks"].items():
        print(f"{M:>2} {r['ref_fwd_ms']:8.3f} {r['fused_fwd_ms']:9.3f} {r['ref_fwd_ms'] / r['fused_fwd_ms']:7.2f} "
              f"{r['floor_fwd_ms'] / r['fused_fwd_ms']:8.0%} | {r['ref_fwdbwd_ms']:8.3f} {r['fused_fwdbwd_ms']:9.3f} "
              f"{r['ref_fwdbwd_ms'] / r['fused_fwdbwd_ms']:7.2f} {r['floor_fwdbwd_ms'] / r['fused_fwdbwd_ms']:8.0%} | "
              f"{max(r['errors'].values()):.1e}")


if __name__ == "__main__":
    main()
