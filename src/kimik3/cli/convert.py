"""`kimik3 convert SRC DST --experts bf16|mxfp4`: stream-load a checkpoint folder and write it again."""

from __future__ import annotations

import sys


def add_parser(sub) -> None:
    p = sub.add_parser("convert", help="rewrite a checkpoint folder with MXFP4 or bf16 routed experts")
    p.add_argument("src", help="source checkpoint folder")
    p.add_argument("dst", help="destination folder (replaced atomically if it is a checkpoint folder)")
    p.add_argument("--experts", choices=("bf16", "mxfp4"), required=True,
                   help="how the routed experts are stored (mxfp4 = as released)")
    p.add_argument("--max-shard-size", default="5GB", help="shard size limit, e.g. 5GB, 500MB (default 5GB)")
    p.add_argument("--dtype", default=None, choices=("bfloat16", "float32", "float16"),
                   help="stored dtype outside the fp32 islands (default: the source config's)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(run=run)


def run(args) -> int:
    from kimik3.checkpoint import load, save, vision_by_default
    from kimik3.config import K3Config

    # mxfp4 -> mxfp4 copies the packed bytes; everything else goes through the dense weights
    model = load(args.src, dtype=args.dtype, experts="mxfp4" if args.experts == "mxfp4" else "dequantize",
                 quiet=args.quiet)
    src_cfg = K3Config.from_file(args.src)
    if src_cfg.vision is not None and not vision_by_default(src_cfg):
        print(f"kimik3 convert: note: {args.src} has a vision tower; it is not converted yet (text only)",
              file=sys.stderr)
    save(model, args.dst, experts=args.experts, max_shard_size=args.max_shard_size, dtype=args.dtype,
         quiet=args.quiet)
    print(f"wrote {args.dst}")
    return 0
