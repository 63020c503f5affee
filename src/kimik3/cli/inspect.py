"""`kimik3 inspect PATH [--json]`: a checkpoint folder's headers against its config.json (no tensor data read)."""

from __future__ import annotations

import json
import time


def add_parser(sub) -> None:
    p = sub.add_parser("inspect", help="shards, tensors, parameters and differences from config.json, "
                                       "from the safetensors headers alone")
    p.add_argument("path", help="checkpoint folder (config.json + model.safetensors.index.json + shards)")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON (every difference)")
    p.set_defaults(run=run)


def run(args) -> int:
    """Exit status 0 when the checkpoint matches its config, 1 when anything differs."""
    from kimik3.checkpoint import inspect_checkpoint

    t0 = time.perf_counter()
    report = inspect_checkpoint(args.path)
    seconds = time.perf_counter() - t0
    if args.json:
        print(json.dumps({**report.to_json(), "seconds": round(seconds, 3)}, indent=2))
    else:
        print("\n".join(report.lines()))
        print(f"  ({seconds:.2f} s, headers only)")
    return 0 if report.ok else 1
