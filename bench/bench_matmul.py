"""The batch-invariant GEMM (`kimik3.ops.matmul`) against cuBLAS on the products one slice-12 decode step makes.

The shapes are recorded, not listed: one engine step at one sequence runs under a dispatch mode that notes every
CUDA mm / addmm / bmm (operand shapes, strides and dtypes, and how often per step). Each distinct product is then
timed at M = 1, 64 and 2,048 rows with torch (cuBLAS) and with ours under each candidate tiling in CONFIGS (each
product REPEATS times in a CUDA graph, as the engine's steps replay them); a step's total is the sum over products
of count x time, beside the bytes floor (each weight read once at the measured copy rate). A tiling may follow M
only where a row's bits do not follow it: `same bits` compares each candidate's outputs with the shipped rule's.

    PYTHONPATH=src:. python3 bench/bench_matmul.py            # device: table + $OUT/bench_matmul.json
    PYTHONPATH=src:. python3 bench/bench_matmul.py --smoke    # CPU check of the recording and the tables
"""

from __future__ import annotations

import sys
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from bench.common import (
    DEVICE,
    ceilings,
    decoding_engine,
    environment,
    graphed,
    median_ms,
    smoke_config,
    table,
    write_json,
)
from kimik3.model import K3ForCausalLM
from kimik3.presets import load_config

aten = torch.ops.aten
PRODUCTS = (aten.mm.default, aten.mm.dtype, aten.bmm.default, aten.addmm.default)
# (BM, BN, BK, warps, stages, programs at one row tile), each at every M, beside the shipped rule (None: the tile by
# M of kimik3.ops.matmul.triton.TILES, BK 64, 256 programs). Those with BK 64 and 256 programs split K as the rule
# does: `same bits` says whether their rows equal the rule's bit for bit (whether a tile may follow M)
CONFIGS = (None, (64, 64, 64, 4, 4, 256), (128, 128, 64, 8, 3, 256))
REPEATS = 10  # calls of one product per CUDA graph replay: launch costs out, as in the engine's graphed steps
ROWS = (1, 64, 2048)


class _Recorder(TorchDispatchMode):
    """Counts the CUDA products by (op, the operands' shapes and strides without M, dtypes)."""

    def __init__(self):
        super().__init__()
        self.seen: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in PRODUCTS:
            a, b = (args[1], args[2]) if func is aten.addmm.default else (args[0], args[1])
            out = args[2] if func is aten.mm.dtype else None
            self.seen[(str(func), a.shape[-1], tuple(b.shape), tuple(b.stride()), b.dtype, out,
                       a.shape[0] if a.dim() == 3 else 0)] += 1
        return func(*args, **(kwargs or {}))


def operands(key, M: int):
    """Random a [M, K] (or [B, M, K]) and b with the recorded shape and strides."""
    _, K, bshape, bstride, dtype, _, batch = key
    a = torch.randn(*((batch,) if batch else ()), M, K, device=DEVICE).to(dtype)
    b = torch.empty_strided(bshape, bstride, dtype=dtype, device=DEVICE).normal_()
    return a, b


def per_call(fn) -> float:
    """Device ms of one fn() call: REPEATS calls captured in a CUDA graph, its replay timed (eager on the CPU)."""
    replay = graphed(lambda: [fn() for _ in range(REPEATS)])
    return median_ms(replay, warmup=3, rep=20) / REPEATS


def set_config(fast, cfg, shipped) -> None:
    """One tiling at every M (cfg), or the shipped rule (cfg None; shipped: the module's TILES, BK, TARGET_PROGRAMS
    as imported)."""
    if cfg is None:
        fast.TILES, fast.BK, fast.TARGET_PROGRAMS = shipped
    else:
        fast.TILES, fast.BK, fast.TARGET_PROGRAMS = ((2**62, *cfg[:2], *cfg[3:5]),), cfg[2], cfg[5]


def main(smoke: bool) -> None:
    from bench.bench_engine import SIZES
    from bench.build import materialize
    from kimik3.ops.matmul import matmul

    s = SIZES["smoke" if smoke else "device"]
    if smoke:
        model = K3ForCausalLM(smoke_config("slice-12").text, torch.float32).init_weights(0).eval()
    else:
        with torch.device("meta"):
            model = K3ForCausalLM(load_config("slice-12").text, torch.bfloat16)
        model = materialize(model).eval()
    engine = decoding_engine(model, 1, s, None, graphs=False)
    rec = _Recorder()
    with rec:
        engine.step()
    del engine, model
    if DEVICE.type == "cuda":
        torch.cuda.empty_cache()
    shapes = sorted(rec.seen.items(), key=lambda kv: -kv[1])
    print(f"{sum(rec.seen.values())} products a decode step, {len(shapes)} distinct:", flush=True)
    for key, n in shapes:
        print(f"  {n:4d} x {key[0]} K={key[1]} b={list(key[2])} strides={list(key[3])} {key[4]} out={key[5]}"
              f" batch={key[6]}", flush=True)
    rate = ceilings()["copy_bytes_per_s"]
    fast = None
    if DEVICE.type == "cuda":
        from kimik3.ops.matmul import triton as fast
    shipped = (fast.TILES, fast.BK, fast.TARGET_PROGRAMS) if fast else None
    configs = CONFIGS if fast else (None,)
    rows_out, results = [], {"env": environment(), "products": [[list(map(str, k)), n] for k, n in shapes]}
    for M in (ROWS[:2] if smoke else ROWS):
        cases = [(key, n, *operands(key, M)) for key, n in shapes]
        weights = sum(n * key[2][-1] * key[2][-2] * max(key[6], 1) * key[4].itemsize for key, n, _, _ in cases)
        floor = weights / rate * 1e3
        cublas = [n * per_call(lambda a=a, b=b, k=key: torch.mm(a, b) if not k[6] else torch.bmm(a, b))
                  for key, n, a, b in cases]
        results[f"M={M}"] = {"cublas_ms": sum(cublas), "floor_ms": floor}
        row = [f"M={M}", f"{sum(cublas):.3f}", f"{floor:.3f}"]
        first = None
        for cfg in configs:
            if fast:
                set_config(fast, cfg, shipped)
            outs = [matmul(a, b, key[5]) for key, n, a, b in cases]
            ours = [n * per_call(lambda a=a, b=b, k=key: matmul(a, b, k[5])) for key, n, a, b in cases]
            same = "" if first is None else (" same bits" if all(torch.equal(x, y) for x, y in zip(first, outs))
                                             else " other bits")
            first = outs if first is None else first
            results[f"M={M}"][str(cfg)] = {"ms": sum(ours), "same_bits": same.strip()}
            row.append(f"{sum(ours):.3f} ({sum(ours) / sum(cublas):.2f}x){same}")
            print(f"M={M} {cfg or 'shipped'}: ours {sum(ours):.3f} ms, cuBLAS {sum(cublas):.3f} ms, floor "
                  f"{floor:.3f} ms{same}", flush=True)
            if cfg is None:  # where the step's time goes, product by product
                for (key, n, _, _), o, c in zip(cases, ours, cublas):
                    print(f"    {n:3d} x K={key[1]} N={key[2][-1]} batch={key[6]}: ours {o:.3f} ms, cuBLAS {c:.3f}"
                          f" ms ({o / c:.2f}x)", flush=True)
        rows_out.append(row)
    if fast:
        set_config(fast, None, shipped)
    results["table"] = table("products of a slice-12 decode step at M rows: ms per step (ours / cuBLAS)",
                             ["rows", "cuBLAS", "bytes floor"] + [str(c or "shipped") for c in configs], rows_out)
    write_json("bench_matmul" + ("_smoke" if smoke else ""), results)


if __name__ == "__main__":
    main("--smoke" in sys.argv)
