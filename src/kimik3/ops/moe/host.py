"""Routed experts computed on the host's cores from MXFP4 weights in host memory (a tier's misses).

Legend: J jobs (one expert and its rows each), R rows over all jobs, L latent width, F expert width.

    expert_rows(x [R, L], weights (J experts' six tensors), counts [J], beta, linear_beta, dtype) -> y [R, L]

Row r of job j is expert j's output for x[r], as `reference.rows` computes it for that expert: each matmul rounded
to `dtype` (bf16 or fp32), SiTU in fp32. The weights are read where they lie (pinned host memory), never decoded
to a buffer: `host_experts.c`, built at first use with the machine's C compiler into kimik3's cache folder and
called through ctypes (the GIL is released for the call, its own threads do the work). Without a compiler (or for
fp16) `rows_torch` computes the same function with torch (decoding one expert at a time): slower, same values up
to the order of fp32 sums.

Why not a torch C++ extension or KTransformers' kt-kernel: docs/tiering.md gives the measurements.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from functools import cache
from pathlib import Path

import torch
from torch import Tensor

from kimik3.ops.mxfp4 import decode
from kimik3.ops.situ.reference import situ_glu

SOURCE = Path(__file__).with_name("host_experts.c")
ExpertTensors = tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]  # w1 codes, w1 scales, w3 .., w2 ..


def cache_dir() -> Path:
    root = os.environ.get("KIMIK3_CACHE") or os.path.join(os.environ.get("XDG_CACHE_HOME") or
                                                          os.path.expanduser("~/.cache"), "kimik3")
    return Path(root) / "ext"


@cache
def library() -> ctypes.CDLL | None:
    """The compiled kernel (built once per source and machine), or None where no C compiler works here."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        return None
    flags = ["-O3", "-march=native", "-fPIC", "-shared", "-pthread"]
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join([cc, *flags, os.uname().machine]).encode()).hexdigest()[:16]
    so = cache_dir() / f"host_experts-{key}.so"
    if not so.exists():
        so.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=so.parent)
        os.close(fd)
        try:
            done = subprocess.run([cc, *flags, "-o", tmp, str(SOURCE), "-lm"], capture_output=True, text=True)
            if done.returncode != 0:
                print(f"kimik3: note: the host expert kernel did not compile ({cc}: {done.stderr.strip()[:200]}); "
                      "host misses run through torch", file=sys.stderr)
                return None
            os.replace(tmp, so)  # atomic: a reader never sees half a library
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    lib = ctypes.CDLL(str(so))
    lib.k3_threads.argtypes, lib.k3_threads.restype = [ctypes.c_int], ctypes.c_int
    lib.k3_has_avx512.restype = ctypes.c_int
    lib.k3_has_bf16_pairs.restype = ctypes.c_int
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.k3_expert_rows.argtypes = [i64, p, p, p, p, p, i64, i64, ctypes.c_float, ctypes.c_float, ctypes.c_int]
    lib.k3_expert_rows.restype = None
    return lib


def set_threads(n: int) -> int:
    """Run the kernel on `n` threads (the caller's included); returns how many it runs on (1 without the kernel)."""
    lib = library()
    return lib.k3_threads(max(1, n)) if lib is not None else 1


def default_threads() -> int:
    """The cores this process may use."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def interleave(x: Tensor) -> Tensor:
    """[R, K] -> [R, K]: each 32-column group as its 16 even columns then its 16 odd ones (the kernel's layout)."""
    R, K = x.shape
    return x.reshape(R, K // 32, 16, 2).transpose(-1, -2).reshape(R, K)


def pair_interleave(x: Tensor) -> Tensor:
    """[R, K] -> [R, K]: per two 32-column groups their 32 even columns, then their 32 odd ones (the kernel's bf16
    layout; K a multiple of 64)."""
    R, K = x.shape
    return x.reshape(R, K // 64, 2, 16, 2).permute(0, 1, 4, 2, 3).reshape(R, K)


def expert_rows(x: Tensor, weights: list[ExpertTensors], counts: list[int], beta: float, linear_beta: float,
                dtype: torch.dtype) -> Tensor:
    """y [R, L] in `dtype`: the rows x [R, L] (host memory, any float dtype; job j's rows follow job j-1's) through
    their jobs' experts. weights[j]: expert j's codes and scales, each [out, in/2] / [out, in/32] uint8 on the host.
    """
    lib = library()
    if lib is None or dtype not in (torch.bfloat16, torch.float32) or not weights:
        return rows_torch(x, weights, counts, beta, linear_beta, dtype)
    R, L = x.shape
    F = weights[0][0].shape[0]
    pairs = dtype == torch.bfloat16 and L % 64 == 0 and F % 64 == 0 and lib.k3_has_bf16_pairs()
    if pairs:
        xi, h, mode = pair_interleave(x.bfloat16()).contiguous(), torch.empty(R, F, dtype=torch.bfloat16), 2
    else:
        xi, h, mode = interleave(x.float()).contiguous(), torch.empty(R, F), int(dtype == torch.bfloat16)
    y = torch.empty(R, L, dtype=torch.float32)
    addr = torch.tensor([[t.data_ptr() for t in w] for w in weights], dtype=torch.int64)
    rows = torch.zeros(len(counts) + 1, dtype=torch.int32)
    rows[1:] = torch.tensor(counts, dtype=torch.int32).cumsum(0)
    assert all(t.is_contiguous() and t.device.type == "cpu" for w in weights for t in w) and int(rows[-1]) == R
    lib.k3_expert_rows(len(weights), addr.data_ptr(), rows.data_ptr(), xi.data_ptr(), h.data_ptr(), y.data_ptr(),
                       L, F, beta, linear_beta, mode)
    return y.to(dtype)


def rows_torch(x: Tensor, weights: list[ExpertTensors], counts: list[int], beta: float, linear_beta: float,
               dtype: torch.dtype) -> Tensor:
    """`expert_rows` in torch: each expert decoded exactly and multiplied as `reference.rows` does."""
    out, start = [], 0
    for w, n in zip(weights, counts):
        w1, w3, w2 = (decode(w[2 * k], w[2 * k + 1], dtype) for k in range(3))
        xs = x[start:start + n].to(dtype)
        out.append(situ_glu(xs @ w1.T, xs @ w3.T, beta, linear_beta) @ w2.T)
        start += n
    return torch.cat(out) if out else x.new_empty(0, x.shape[1], dtype=dtype)
