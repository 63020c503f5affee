"""The LoRA memory table of BENCHMARKS.md (CPU, seconds): `kimik3.lora.memory` on the released config and tensor
inventory, for the benchmark's adapter and two lighter expert layouts.

    PYTHONPATH=src python3 bench/lora_memory.py [--config configs/k3.json] [--tensors tests/data/k3_tensors.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from kimik3.lora.memory import lora_memory, markdown  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(ROOT / "configs" / "k3.json"))
    ap.add_argument("--tensors", default=str(ROOT / "tests" / "data" / "k3_tensors.json"))
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=8192)
    args = ap.parse_args()
    config, inventory = json.loads(Path(args.config).read_text()), json.loads(Path(args.tensors).read_text())
    report = lora_memory(config, inventory, rank=args.rank, tokens=args.tokens)
    print(markdown(report))
    print("\n| expert layout | adapter parameters | fixed GiB | host GiB |\n|---|---:|---:|---:|")
    for label, kw in (("per_expert", {}), ("shared_outer", {"experts": "shared_outer"}),
                      ("shared_a", {"experts": "shared_a"}), ("per_expert, rank / top_k", {"rank_scaling": True})):
        r = lora_memory(config, inventory, rank=args.rank, tokens=args.tokens, **kw)
        print(f"| {label} | {r['adapter_params']:,} | {r['fixed'] / 2**30:,.1f} | {r['host'] / 2**30:,.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
