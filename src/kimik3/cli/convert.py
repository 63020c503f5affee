"""`kimik3 convert SRC DST`: stream-load a checkpoint folder or GGUF and write it again (a folder, or GGUF)."""

from __future__ import annotations


def add_parser(sub) -> None:
    p = sub.add_parser("convert", help="rewrite a checkpoint: folder <-> GGUF, MXFP4 or bf16 routed experts")
    p.add_argument("src", help="source checkpoint folder, or a .gguf file (one, or any part of a gguf-split set)")
    p.add_argument("dst", help="destination, apart from SRC (not SRC, inside it or around it): a folder (an existing "
                               "checkpoint folder there is replaced atomically, keeping its non-weight files), or "
                               "OUT.gguf for llama.cpp's kimi-k3 GGUF (docs/gguf.md)")
    p.add_argument("--to", choices=("safetensors", "gguf"), default=None,
                   help="output format (default: gguf when DST ends in .gguf, else a safetensors folder)")
    p.add_argument("--experts", choices=("bf16", "mxfp4"), default=None,
                   help="how the routed experts are stored (mxfp4 = as released; default: as SRC stores them)")
    p.add_argument("--max-shard-size", default=None,
                   help="shard size limit, e.g. 5GB, 500MB (folders: default 5GB; GGUF: default one file, else "
                        "gguf-split parts OUT-0000i-of-0000n.gguf)")
    p.add_argument("--dtype", default=None, choices=("bfloat16", "float32", "float16"),
                   help="stored dtype outside the fp32 islands (default: the source config's)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(run=run)


def run(args) -> int:
    from kimik3.checkpoint import load, save
    from kimik3.checkpoint.hub import resolve
    from kimik3.checkpoint.source import is_gguf, read_config
    from kimik3.cli.outputs import check_output

    to = args.to or ("gguf" if str(args.dst).endswith(".gguf") else "safetensors")
    if to == "gguf" and not str(args.dst).endswith(".gguf"):
        raise ValueError(f"--to gguf: DST must be a file name ending in .gguf, got {args.dst}")
    check_output(args.dst, "DST", {"SRC": args.src})
    experts = args.experts
    if experts is None and (is_gguf(args.src) or (resolve(args.src) / "config.json").is_file()):
        experts = read_config(args.src if is_gguf(args.src) else resolve(args.src)).storage.experts
    # the tokenizer, model card and generation_config.json come along from SRC (`save`'s source, the loaded
    # folder). MXFP4 -> MXFP4 copies the packed bytes; everything else goes through the dense weights
    model = load(args.src, dtype=args.dtype, keep_experts_packed=experts == "mxfp4", quiet=args.quiet)
    if to == "gguf":
        from kimik3.checkpoint.gguf_write import save_gguf

        files = save_gguf(model, args.dst, experts=experts, dtype=args.dtype, max_shard_size=args.max_shard_size,
                          quiet=args.quiet)
        print(f"wrote {', '.join(str(f) for f in files)}")
        return 0
    save(model, args.dst, experts=experts, max_shard_size=args.max_shard_size or "5GB", dtype=args.dtype,
         quiet=args.quiet)
    print(f"wrote {args.dst}")
    return 0
