"""`kimik3 lora merge BASE ADAPTER OUT [--experts bf16|mxfp4]`: fold a LoRA adapter into a full checkpoint."""

from __future__ import annotations


def add_parser(sub) -> None:
    p = sub.add_parser("lora", help="LoRA adapters: merge one into its base (docs/lora.md)")
    verbs = p.add_subparsers(dest="verb", required=True)
    m = verbs.add_parser("merge", help="write BASE + ADAPTER as a full checkpoint folder")
    m.add_argument("base", help="the base checkpoint folder the adapter was trained on")
    m.add_argument("adapter", help="adapter folder (adapter_config.json + adapter_model.safetensors), e.g. "
                                   "RUN/checkpoints/step-*/adapter")
    m.add_argument("out", help="destination checkpoint folder (replaced atomically if it is one), or OUT.gguf for "
                               "llama.cpp's kimi-k3 GGUF (docs/gguf.md)")
    m.add_argument("--experts", choices=("bf16", "mxfp4"), default="bf16",
                   help="routed experts merged dense (bf16, default) or re-encoded to MXFP4 (lossy: the relative "
                        "error is printed)")
    m.add_argument("--dtype", default=None, choices=("bfloat16", "float32", "float16"),
                   help="stored dtype outside the fp32 islands (default: the base config's); the merge itself is fp32")
    m.add_argument("--quiet", action="store_true", help="no progress bars")
    m.set_defaults(run=run_merge)


def run_merge(args) -> int:
    import torch

    from kimik3.lora import merge_checkpoint

    dtype = getattr(torch, args.dtype) if args.dtype else None
    report = merge_checkpoint(args.base, args.adapter, args.out, experts=args.experts, dtype=dtype, quiet=args.quiet)
    print(f"merged {report['modules']} LoRA modules into {args.out} (routed experts {report['experts']})")
    if report["reencode_rel_err"] is not None:
        print(f"MXFP4 re-encoding of the merged experts: relative error {report['reencode_rel_err']:.3e} "
              "(||decode(encode(M)) - M|| / ||M|| against the fp32 merge M; --experts bf16 keeps it exact)")
    return 0
