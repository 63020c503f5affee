"""`kimik3 convert SRC DST --experts bf16|mxfp4`: stream-load a checkpoint folder and write it again."""

from __future__ import annotations


def add_parser(sub) -> None:
    p = sub.add_parser("convert", help="rewrite a checkpoint folder with MXFP4 or bf16 routed experts")
    p.add_argument("src", help="source checkpoint folder")
    p.add_argument("dst", help="destination folder, apart from SRC (not SRC, inside it or around it); an existing "
                               "checkpoint folder there is replaced atomically, keeping its non-weight files")
    p.add_argument("--experts", choices=("bf16", "mxfp4"), required=True,
                   help="how the routed experts are stored (mxfp4 = as released)")
    p.add_argument("--max-shard-size", default="5GB", help="shard size limit, e.g. 5GB, 500MB (default 5GB)")
    p.add_argument("--dtype", default=None, choices=("bfloat16", "float32", "float16"),
                   help="stored dtype outside the fp32 islands (default: the source config's)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(run=run)


def run(args) -> int:
    from kimik3.checkpoint import load, save
    from kimik3.cli.outputs import check_output

    check_output(args.dst, "DST", {"SRC": args.src})
    # the tokenizer, model card and generation_config.json come along from SRC (`save`'s source, the loaded
    # folder). mxfp4 -> mxfp4 copies the packed bytes; everything else goes through the dense weights
    model = load(args.src, dtype=args.dtype, keep_experts_packed=args.experts == "mxfp4", quiet=args.quiet)
    save(model, args.dst, experts=args.experts, max_shard_size=args.max_shard_size, dtype=args.dtype,
         quiet=args.quiet)
    print(f"wrote {args.dst}")
    return 0
