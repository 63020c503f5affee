"""`kimik3 memory [CONFIG] --context N --batch B`: bytes for weights, KDA state and the MLA cache."""

from __future__ import annotations

import json


def add_parser(sub) -> None:
    p = sub.add_parser("memory", help="memory needed to serve a config at a context length and batch size")
    p.add_argument("config", nargs="?", default="k3", help="config.json, checkpoint folder or preset name")
    p.add_argument("--context", type=int, default=None,
                   help="tokens per sequence, at most the model's max_position_embeddings (default: 131072, or "
                        "the model's positions when fewer)")
    p.add_argument("--batch", type=int, default=1, help="sequences (default 1)")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    p.set_defaults(run=run)


DEFAULT_CONTEXT = 131072


def _gib(n: int) -> str:
    return f"{n / 2**30:,.2f} GiB"


def run(args) -> int:
    from rich.console import Console
    from rich.table import Table

    from kimik3.inference.memory import memory_report
    from kimik3.presets import load_config

    cfg = load_config(args.config)
    positions = cfg.text.max_position_embeddings
    context = args.context if args.context is not None else min(DEFAULT_CONTEXT, positions or DEFAULT_CONTEXT)
    if positions is not None and context > positions:  # no sequence of the model can hold them
        raise ValueError(f"--context {context:,} exceeds the model's {positions:,} positions "
                         "(max_position_embeddings in its config.json)")
    r = memory_report(cfg, context, args.batch)
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
