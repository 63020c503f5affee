"""`kimik3 params [CONFIG] [--json]`: exact parameter accounting, built on the meta device."""

from __future__ import annotations

import json
import time


def add_parser(sub) -> None:
    p = sub.add_parser("params", help="parameter accounting of a config (default: the released K3)")
    p.add_argument("config", nargs="?", default="k3", help="config.json, checkpoint folder or preset name")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    p.set_defaults(run=run)


def run(args) -> int:
    import torch
    from rich.console import Console

    from kimik3.atlas import count_parameters, format_report
    from kimik3.model import K3ForConditionalGeneration
    from kimik3.presets import load_config, resolve_config

    cfg = load_config(args.config)  # first: its errors name what is missing (a folder's config.json)
    path = resolve_config(args.config)
    t0 = time.perf_counter()
    with torch.device("meta"):
        model = K3ForConditionalGeneration(cfg)
    report = count_parameters(model)
    seconds = time.perf_counter() - t0
    if args.json:
        print(json.dumps({"config": str(path), "build_and_count_seconds": round(seconds, 3), **report.to_json()},
                         indent=2))
    else:
        console = Console()
        console.width = max(console.width, 100)
        console.print(format_report(report, title=f"{path.name}: parameters (meta build + count {seconds:.2f} s)"))
    return 0
