"""`kimik3 lora merge BASE ADAPTER OUT [--experts bf16|mxfp4]`: fold a LoRA adapter into a full checkpoint (a folder
or a GGUF); `kimik3 lora export ADAPTER OUT.gguf`: a routed-expert adapter as llama.cpp's LoRA GGUF."""

from __future__ import annotations


def add_parser(sub) -> None:
    p = sub.add_parser("lora", help="LoRA adapters: merge one into its base, export one to GGUF (docs/lora.md)")
    verbs = p.add_subparsers(dest="verb", required=True)
    m = verbs.add_parser("merge", help="write BASE + ADAPTER as a full checkpoint folder")
    m.add_argument("base", help="the base checkpoint folder the adapter was trained on")
    m.add_argument("adapter", help="adapter folder (adapter_config.json + adapter_model.safetensors), e.g. "
                                   "RUN/checkpoints/step-*/adapter")
    m.add_argument("out", help="destination checkpoint folder, apart from BASE and ADAPTER (replaced atomically if "
                               "it is one), or OUT.gguf for llama.cpp's kimi-k3 GGUF (docs/gguf.md)")
    m.add_argument("--experts", choices=("bf16", "mxfp4"), default="bf16",
                   help="routed experts merged dense (bf16, default) or re-encoded to MXFP4 (lossy: the relative "
                        "error is printed)")
    m.add_argument("--dtype", default=None, choices=("bfloat16", "float32", "float16"),
                   help="stored dtype outside the fp32 islands (default: the base config's); the merge itself is fp32")
    m.add_argument("--quiet", action="store_true", help="no progress bars")
    m.set_defaults(run=run_merge)
    x = verbs.add_parser("export", help="write a routed-expert adapter as llama.cpp's LoRA GGUF (docs/gguf.md)")
    x.add_argument("adapter", help="adapter folder (adapter_config.json + adapter_model.safetensors)")
    x.add_argument("out", help="destination file, e.g. adapter.gguf (llama.cpp: --lora; llama-cpp-python: lora_path)")
    x.add_argument("--base", default=None,
                   help="the base model (folder or .gguf) the adapter was trained on; default: the adapter's "
                        "base_model_name_or_path")
    x.set_defaults(run=run_export)


def run_merge(args) -> int:
    import torch

    from kimik3.cli.outputs import check_output
    from kimik3.lora import merge_checkpoint

    check_output(args.out, "OUT", {"BASE": args.base, "ADAPTER": args.adapter})
    dtype = getattr(torch, args.dtype) if args.dtype else None
    report = merge_checkpoint(args.base, args.adapter, args.out, experts=args.experts, dtype=dtype, quiet=args.quiet)
    print(f"merged {report['modules']} LoRA modules into {args.out} (routed experts {report['experts']})")
    if report["reencode_rel_err"] is not None:
        print(f"MXFP4 re-encoding of the merged experts: relative error {report['reencode_rel_err']:.3e} "
              "(||decode(encode(M)) - M|| / ||M|| against the fp32 merge M; --experts bf16 keeps it exact)")
    return 0


def run_export(args) -> int:
    import json
    from pathlib import Path

    from kimik3.checkpoint.source import read_config
    from kimik3.cli.outputs import check_output
    from kimik3.lora.gguf_export import export_gguf
    from kimik3.lora.peft import CONFIG

    base = args.base
    if base is None:
        config = Path(args.adapter) / CONFIG
        base = json.loads(config.read_text()).get("base_model_name_or_path") if config.is_file() else None
        if not base:
            raise ValueError(f"{args.adapter}: the adapter does not name its base model; pass --base BASE")
    check_output(args.out, "OUT", {"ADAPTER": args.adapter, "--base": base})
    out = export_gguf(args.adapter, args.out, read_config(base).text.moe.num_experts)
    print(f"wrote {out}")
    return 0
