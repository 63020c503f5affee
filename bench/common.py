"""Shared by the GPU benchmarks: ceilings measured in the same run, median timing, tables, JSON results.

Run on the device from the repository root, e.g. `PYTHONPATH=src:. python3 bench/bench_layer.py`.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
from pathlib import Path

import torch


def median_ms(fn, warmup: int = 10, rep: int = 50) -> float:
    """Median wall time of fn() in milliseconds, timed with CUDA events around each call."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(rep):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def graphed(fn):
    """Capture fn() (static shapes, no host syncs) in a CUDA graph; returns replay (for decode timing)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def ceilings() -> dict:
    """Measured device-to-device copy bandwidth (bytes read + written per second) and bf16 matmul rate."""
    x = torch.empty(2**31 // 2, dtype=torch.bfloat16, device="cuda").normal_()
    y = torch.empty_like(x)
    copy_ms = median_ms(lambda: y.copy_(x), 3, 20)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    mm_ms = median_ms(lambda: a @ b, 3, 20)
    return {"copy_bytes_per_s": 2 * 2**31 / (copy_ms * 1e-3), "bf16_flops_per_s": 2 * 8192**3 / (mm_ms * 1e-3)}


def environment() -> dict:
    import triton

    try:
        import fla

        fla_version = getattr(fla, "__version__", "0.6.0")
    except ImportError:
        fla_version = None
    return {"date": datetime.date.today().isoformat(), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": triton.__version__, "fla": fla_version, "python": platform.python_version()}


def table(title: str, headers: list[str], rows: list[list]) -> str:
    cells = [[str(c) for c in r] for r in [headers, *rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = [title] + ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells]
    text = "\n".join(lines)
    print(text, flush=True)
    return text


def write_json(name: str, data: dict) -> Path:
    out = Path(os.environ.get("OUT", "bench/results"))
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    path.write_text(json.dumps(data, indent=2))
    return path
