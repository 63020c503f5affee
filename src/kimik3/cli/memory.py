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
    t = p.add_argument_group("expert tiering plan (docs/tiering.md): given --gpus, where the bytes go")
    t.add_argument("--gpus", type=int, default=None,
                   help="devices (the trunk tensor-parallel, the experts expert-parallel)")
    t.add_argument("--gpu-gib", type=float, default=141.0, help="memory of one device (default 141: an H200)")
    t.add_argument("--host-gib", type=float, default=2048.0, help="host memory (default 2048)")
    t.add_argument("--link-gbps", type=float, default=52.2,
                   help="host->device copy GB/s of one device (default 52.2: pinned experts, measured on an H200 "
                        "machine in kimik3's calibration)")
    t.add_argument("--host-gbps", type=float, default=96.0,
                   help="host memory read GB/s, shared by copies and the host kernel (default 96: the H200 "
                        "machine's 16 Xeon cores, measured)")
    t.add_argument("--host-kernel-gbps", type=float, default=15.8,
                   help="GB/s of experts the host kernel computes through on all cores (default 15.8: measured "
                        "during decode on the H200 machine)")
    t.add_argument("--hbm-gbps", type=float, default=4250.0, help="device memory GB/s (default 4250: H200, measured)")
    p.set_defaults(run=run)


DEFAULT_CONTEXT = 131072


def _gib(n: int) -> str:
    return f"{n / 2**30:,.2f} GiB"


def run(args) -> int:

    from kimik3.inference.memory import memory_report
    from kimik3.presets import load_config

    cfg = load_config(args.config)
    positions = cfg.text.max_position_embeddings
    context = args.context if args.context is not None else min(DEFAULT_CONTEXT, positions or DEFAULT_CONTEXT)
    if positions is not None and context > positions:  # no sequence of the model can hold them
        raise ValueError(f"--context {context:,} exceeds the model's {positions:,} positions "
                         "(max_position_embeddings in its config.json)")
    if args.gpus is not None:
        return _plan(cfg, args, context)
    r = memory_report(cfg, context, args.batch)
    rows = [("weights", r.weights), ("KDA state (per sequence)", r.kda_state_per_sequence),
            (f"KDA state x {r.batch}", r.kda_state), ("MLA latent (per token)", r.mla_bytes_per_token),
            (f"MLA cache x {r.batch} x {r.context:,} tokens", r.mla_cache), ("total", r.total)]
    if args.json:
        print(json.dumps({name: n for name, n in rows}, indent=2))
        return 0
    _print_bytes(f"memory: batch {r.batch}, context {r.context:,}", "item", rows)
    return 0


def _print_bytes(title: str, first: str, rows: list[tuple[str, int]]) -> None:
    """A table of (name, bytes) rows with each size in GiB beside it."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    table.add_column(first)
    table.add_column("bytes", justify="right")
    table.add_column("", justify="right")
    for name, n in rows:
        table.add_row(name, f"{n:,}", _gib(n))
    Console().print(table)


def _plan(cfg, args, context: int) -> int:
    from kimik3.inference.memory import tier_plan

    g = 1e9
    t = tier_plan(cfg, args.gpus, int(args.gpu_gib * 2**30), int(args.host_gib * 2**30), context, args.batch,
                  args.link_gbps * g, args.host_gbps * g, args.host_kernel_gbps * g, args.hbm_gbps * g)
    p = t.plan
    rows = [("device: trunk (every weight but the routed experts)", t.trunk),
            (f"device: KDA state + MLA cache ({t.batch} x {t.context:,} tokens)", t.state),
            ("device: workspace", t.workspace),
            (f"device: expert cache, {p.slots} of {p.num_experts} experts a layer x {p.moe_layers} + staging",
             p.device_bytes),
            (f"host: routed experts of all {t.gpus} devices" if p.tiered else "host: nothing (every expert fits)",
             t.host_needed)]
    summary = {"experts_per_layer_on_device": p.slots, "experts_per_layer": p.num_experts, "tiered": p.tiered,
               "uniform_hit_rate": p.uniform_hit_rate, "missed_bytes_per_step": t.missed_bytes,
               "hbm_ms": t.hbm_seconds * 1e3, "miss_ms": t.miss_seconds * 1e3, "decode_tokens_per_s": t.tokens_per_s}
    if args.json:
        print(json.dumps({**{name: n for name, n in rows}, **summary}, indent=2))
        return 0
    _print_bytes(f"expert tiering: {t.gpus} x {args.gpu_gib:g} GiB devices, {args.host_gib:g} GiB host", "where", rows)
    print(f"hit rate under uniform routing: {p.uniform_hit_rate:.1%}; decode at batch {t.batch}: "
          f"{t.missed_bytes / 1e9:.2f} GB of misses a step and device ({t.miss_seconds * 1e3:.1f} ms at "
          f"{args.link_gbps:g} GB/s link, {args.host_gbps:g} GB/s host memory, {args.host_kernel_gbps:g} GB/s host "
          f"kernel), {t.hbm_seconds * 1e3:.1f} ms of device "
          f"reads: at most {t.tokens_per_s:.1f} tokens/s")
    return 0
