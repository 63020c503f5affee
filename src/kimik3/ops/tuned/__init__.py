"""fla's autotuning choices shipped with the package, so a new machine does not time every config of its kernels.

fla's KDA kernels (and their norms) autotune: the first time a process meets a shape key, Triton compiles and times
each config of the kernel. On a new H200 that was ~8 s of the demo's first `kimik3 generate` and 7-10 s of the
slice's warm-up before `kimik3 serve` answered (bench_startup, BENCHMARKS.md). `<GPU>.json` (the GPU's name as
torch reports it, non-alphanumerics as "_") holds the choices that GPU made: per kernel (its fla module and name)
and exact autotune key, the config Triton chose. The key is the one Triton builds at the call (the kernel's key
arguments, then the dtype of each tensor argument), so a choice is used only at the very shape it was tuned at.

`seed_fla()` puts them in the kernels' autotuners before their first call (`Autotuner.cache`: the table Triton
reads before it times anything, which fla's own config cache fills too), when the fla-core version matches the
table's, the GPU is the table's (or of its compute capability, where no table names it) and the config is one of the
kernel's own (compared as Triton prints it); any other kernel, shape or machine tunes as before.

Why not Triton's own results: an earlier version copied the `*.autotune.json` files Triton writes into its cache
directory. Their folder names hash Triton's, ptxas' and the kernel's fingerprints, and on new H200s the eight
kernels they covered still timed their configs (1-1.5 s each in bench_startup's new-machine runs after the files
shipped): a name that does not match is never read. This table depends on no such hash.

Refresh it from a device run: bench/device_suite.sh packs the machine's Triton results into $OUT/tune.tgz, and
`python tools/tuned_configs.py tune.tgz --gpu "NVIDIA H200" --capability 9.0` merges their choices into the table.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import re
from functools import cache
from pathlib import Path

SHIPPED = Path(__file__).parent


def table_path(gpu: str) -> Path:
    """The shipped table of the GPU torch names `gpu` ("NVIDIA H200" -> NVIDIA_H200.json)."""
    return SHIPPED / (re.sub(r"[^0-9A-Za-z]+", "_", gpu).strip("_") + ".json")


@cache
def seed_fla() -> int:
    """Put this GPU's shipped choices in fla's autotuners (once per process; call it before fla's kernels run).
    Returns how many it put in place: 0 without CUDA, fla-core or a table for this GPU (`table_for`)."""
    import torch

    if not torch.cuda.is_available():
        return 0
    try:
        version = importlib.metadata.version("fla-core")
    except importlib.metadata.PackageNotFoundError:
        return 0
    table = table_for(torch.cuda.get_device_name(), list(torch.cuda.get_device_capability()), version)
    return apply(table) if table is not None else 0


def table_for(gpu: str, capability: list[int], fla_version: str) -> dict | None:
    """The shipped table of this fla-core version for `gpu`, else one for a GPU of the same compute capability
    (an H200's choices on an H100: the same SM, the same shared memory, so every config compiles as it did; their
    timings may rank a little differently there, which costs speed, never correctness)."""
    tables = [json.loads(f.read_text()) for f in sorted(SHIPPED.glob("*.json"))]
    tables = [t for t in tables if t["fla-core"] == fla_version]
    return next((t for t in tables if t["gpu"] == gpu), None) or next(
        (t for t in tables if t["capability"] == capability), None)


def apply(table: dict) -> int:
    """Put `table`'s choices ({"kernels": {"module.kernel": [{"key": [...], "config": "<as Triton prints it>"}]}})
    in the autotuners of the kernels it names, never over a choice already made in this process; returns how many.
    A kernel that is not there or not autotuned, and a config the kernel does not have, are passed over."""
    from triton.runtime.autotuner import Autotuner

    placed = 0
    for name, entries in table["kernels"].items():
        module, _, attr = name.rpartition(".")
        try:
            tuner = getattr(importlib.import_module(module), attr, None)
        except ImportError:
            continue
        while tuner is not None and not isinstance(tuner, Autotuner):  # under @triton.heuristics, say
            tuner = getattr(tuner, "fn", None)
        if tuner is None:
            continue
        own = {str(c): c for c in tuner.configs}
        for entry in entries:
            key, config = tuple(entry["key"]), own.get(entry["config"])
            if config is not None and key not in tuner.cache:
                tuner.cache[key] = config
                placed += 1
    return placed
