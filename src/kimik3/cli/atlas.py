"""`kimik3 atlas [CONFIG] --out DIR [--serve] [--context N] [--diff OTHER] [--prompt TEXT]`: the architecture
atlas of a config, checkpoint folder or preset, as a static site (works from file:// and offline) + atlas.json."""

from __future__ import annotations

import functools
import http.server
import time
from pathlib import Path


def add_parser(sub) -> None:
    p = sub.add_parser("atlas", help="the architecture atlas (static site + atlas.json) built from the live modules")
    p.add_argument("config", nargs="?", default="k3", help="config.json, checkpoint folder or preset (default k3)")
    p.add_argument("--out", type=Path, default=None, help="output folder (default out/atlas/<name>)")
    p.add_argument("--context", type=int, default=131072, help="context length for memory and FLOPs (131072)")
    p.add_argument("--diff", default=None, metavar="OTHER", help="also write diff.html against another config")
    p.add_argument("--prompt", default=None, help="with a checkpoint: live numbers (expert load, AttnRes depth "
                   "weights, KDA decay) from one forward of this prompt")
    p.add_argument("--checkpoint", default=None, help="checkpoint folder for --prompt (default: CONFIG when it is "
                   "one; 'demo' = the bundled demo model)")
    p.add_argument("--serve", action="store_true", help="serve the site on the loopback address after building")
    p.add_argument("--port", type=int, default=8000, help="port for --serve (0 = any free port)")
    p.add_argument("--force", action="store_true", help="replace --out even when it holds files the atlas did "
                   "not write (by default such a folder is refused)")
    p.set_defaults(run=run)


def _name(arg: str, path: Path) -> str:
    return path.parent.name if path.name == "config.json" and Path(arg).exists() else Path(arg).stem


def build(args):
    """Build the atlas (and diff / live numbers) and write the site; returns (atlas, seconds to build)."""
    from kimik3.atlas.build import build_atlas
    from kimik3.atlas.diff import diff_atlases
    from kimik3.atlas.render import check_replaceable, write_site
    from kimik3.checkpoint import publish_atomically
    from kimik3.cli.outputs import check_output
    from kimik3.presets import DEMO_MODEL, load_config, resolve_config

    if args.context < 1:
        raise ValueError(f"--context must be a positive number of tokens, got {args.context}")
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be 0-65535 (0 = any free port), got {args.port}")
    path = resolve_config(args.config)
    name = _name(args.config, path)
    out = args.out or Path("out") / "atlas" / name
    ckpt = args.checkpoint or (args.config if Path(args.config).is_dir() else None)
    if ckpt == "demo":
        ckpt = DEMO_MODEL
    check_output(out, "--out", {"CONFIG": path.parent if Path(args.config).is_dir() else path,
                                "--diff": resolve_config(args.diff) if args.diff else None,
                                "--checkpoint": ckpt if args.prompt is not None else None})
    t0 = time.perf_counter()
    atlas = build_atlas(load_config(path), name=name, config_path=path, context=args.context)
    seconds = time.perf_counter() - t0
    diff = None
    if args.diff:
        other = resolve_config(args.diff)
        diff = diff_atlases(atlas, build_atlas(load_config(other), name=_name(args.diff, other),
                                               config_path=other, context=args.context))
    live = None
    if args.prompt is not None:
        from kimik3.atlas.live import load_and_run

        if ckpt is None:
            raise ValueError("--prompt needs a checkpoint: pass a checkpoint folder as CONFIG or --checkpoint "
                             "(--checkpoint demo = the bundled demo model)")
        live = load_and_run(Path(ckpt), args.prompt)
    if not args.force:
        check_replaceable(out)
    # the site appears whole or not at all (a Ctrl-C while writing leaves no half site at --out); a folder
    # replaced under --force keeps the files the atlas does not write
    publish_atomically(out, lambda tmp: write_site(atlas, tmp, diff=diff, live=live),
                       carry_over=lambda entry: args.force)
    return atlas, seconds, out


def run(args) -> int:
    atlas, seconds, out = build(args)
    t = atlas["totals"]
    print(f"atlas of {atlas['name']}: {t['total']:,} parameters in {len(atlas['order'])} components, "
          f"{atlas['census']['tensors']:,} checkpoint tensors; built in {seconds:.1f} s -> {out / 'index.html'}")
    if args.serve:
        serve(out, args.port)
    return 0


def serve(folder: Path, port: int) -> None:
    """Serve `folder` on 127.0.0.1 (loopback only) until interrupted."""
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(folder))
    with http.server.ThreadingHTTPServer(("127.0.0.1", port), handler) as httpd:
        print(f"serving http://127.0.0.1:{httpd.server_address[1]}/index.html (Ctrl-C stops)", flush=True)
        try:
            httpd.serve_forever()
        except KeyboardInterrupt:
            pass
