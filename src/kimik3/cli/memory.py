"""`kimik3 memory [CONFIG] --context N --batch B`: bytes for weights, KDA state and the MLA cache."""

from __future__ import annotations

import json
import sys


def add_parser(sub) -> None:
    p = sub.add_parser("memory", help="memory needed to serve a config at a context length and batch size")
    p.add_argument("config", nargs="?", default="k3", help="config.json, checkpoint folder or preset name")
    p.add_argument("--context", type=int, default=131072, help="tokens per sequence (default 131072)")
    p.add_argument("--batch", type=int, default=1, help="sequences (default 1)")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    p.set_defaults(run=run)


def _gib(n: int) -> str:
    return f"{n / 2**30:,.2f} GiB"


def run(args) -> int:
    from rich.console import Console
    from rich.table import Table

    from kimik3.inference.memory import memory_report
    from kimik3.presets import load_config

    cfg = load_config(args.config)
    r = memory_report(cfg, args.context, args.batch)
    positions = cfg.text.max_position_embeddings
    if positions is not None and args.context > positions:
        print(f"kimik3 memory: note: {args.context:,} tokens exceed the model's {positions:,} positions "
              "(max_position_embeddings); generation stops there", file=sys.stderr)
    rows = [("weights", r.weights), ("KDA state (per sequence)", r.kda_state_per_sequence),
            (f"KDA state x {r.batch}", r.kda_state), ("MLA latent (per token)", r.mla_bytes_per_token),
            (f"MLA cache x {r.batch} x {r.context:,} tokens", r.mla_cache), ("total", r.total)]
    if args.json:
        print(json.dumps({name: n for name, n in rows}, indent=2))
        return 0
    table = Table(title=f"memory: batch {r.batch}, context {r.context:,}")
    table.add_column("item")
    table.add_column("bytes", justify="right")
    table.add_column("", justify="right")
    for name, n in rows:
        table.add_row(name, f"{n:,}", _gib(n))
    Console().print(table)
    return 0
