"""Autotuning results shipped with the package, so a new machine does not benchmark every config of fla's kernels.

fla's Triton kernels autotune: the first time a process meets a shape key, each config is compiled and timed, unless
Triton's cache directory already holds the choice (`<hash>/<kernel>.autotune.json`). On a new H200 that was 32 s of
the demo's first `kimik3 generate` and 19 s of the slice's warm-up before `kimik3 serve` answered (bench_startup,
BENCHMARKS.md). `h200/` holds those files as an H200 wrote them, for the shapes the demo and K3's real widths (the
slice-12 engine: prefill chunks, decode, verification) meet. Triton names each file by a hash of its own version,
the GPU target, the kernel's source, the shape key and the configs, so a file is read only where all of these
match: elsewhere (another GPU, Triton or fla) nothing is read and the kernels tune as before.

`seed_autotune()` copies the missing files into Triton's cache directory (`TRITON_CACHE_DIR`, default
~/.triton/cache); it never overwrites one there. Refresh them from a device run: `bench/device_suite.sh` packs the
machine's `*.autotune.json` into `$OUT/tune.tgz`.
"""

from __future__ import annotations

import os
import shutil
from functools import cache
from pathlib import Path

SEEDS = Path(__file__).parent


@cache
def seed_autotune() -> int:
    """Copy the shipped autotuning results Triton's cache lacks (once per process); returns how many were copied.
    Nothing happens without Triton or when the cache directory cannot be written (a read-only home: it tunes)."""
    try:
        from triton import knobs
    except ImportError:
        return 0
    target = Path(knobs.cache.dir)
    copied = 0
    for src in SEEDS.glob("*/*/*.autotune.json"):
        dst = target / src.parent.name / src.name
        if dst.exists():
            continue
        try:
            dst.parent.mkdir(parents=True, exist_ok=True)
            tmp = dst.with_suffix(f".tmp.{os.getpid()}")
            shutil.copyfile(src, tmp)
            os.replace(tmp, dst)  # atomic: a process reading the cache meanwhile sees the whole file or none
        except OSError:
            return copied
        copied += 1
    return copied
