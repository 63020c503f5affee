"""Merge the autotuning choices a GPU made into the package's table for it (`kimik3.ops.tuned`).

Reads the `*.autotune.json` files Triton wrote in its cache directory (a folder, or the tune.tgz that
bench/device_suite.sh returns): each holds a kernel's autotune key and every config's timings. The best config (the
smallest timings, Triton's rule) goes into `src/kimik3/ops/tuned/<GPU>.json` under the kernel's fla module and name,
beside the choices already there (a key seen again takes the new choice). Needs fla-core importable (no GPU):
the kernels' modules are looked up in it, and the table records its version.

    python tools/tuned_configs.py out/device/tune.tgz --gpu "NVIDIA H200" --capability 9.0
    python tools/tuned_configs.py ~/.triton/cache --gpu "NVIDIA H200" --check   # exit 1 if the table would change
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import sys
import tarfile
from pathlib import Path

from kimik3.ops.tuned import table_path

# the fla modules K3 runs (KDA's chunked and recurrent kernels, their norms): where the tuned kernels are looked up
FLA_MODULES = ("fla.ops.kda", "fla.modules.norm.fused_norm_gate", "fla.modules.norm.l2norm")


def triton_results(source: Path) -> list[tuple[str, dict]]:
    """(kernel name, Triton's result {"key", "configs_timings"}) for each *.autotune.json in a folder or archive."""
    if source.is_dir():
        return [(f.name.removesuffix(".autotune.json"), json.loads(f.read_text()))
                for f in sorted(source.rglob("*.autotune.json"))]
    with tarfile.open(source) as tar:
        return [(Path(m.name).name.removesuffix(".autotune.json"), json.load(tar.extractfile(m)))
                for m in sorted(tar.getmembers(), key=lambda m: m.name) if m.name.endswith(".autotune.json")]


def kernel_modules() -> dict[str, str]:
    """Autotuned kernel name -> the fla module that defines it."""
    import importlib

    from triton.runtime.autotuner import Autotuner

    found = {}
    for name in FLA_MODULES:
        importlib.import_module(name)
    for module in [m for n, m in sys.modules.items() if n.startswith("fla.") and m is not None]:
        for attr, obj in list(vars(module).items()):
            tuner = obj
            while tuner is not None and not isinstance(tuner, Autotuner):
                tuner = getattr(tuner, "fn", None)
            if tuner is None:
                continue
            source = tuner.fn  # down to the Python function under @triton.jit (or the interpreter's wrapper)
            while hasattr(source, "fn"):
                source = source.fn
            if source.__name__ == attr:  # where it is defined, not a module that imports it
                found[attr] = source.__module__
    return found


def best_config(result: dict) -> str:
    """The config Triton chose from its timings, as Triton prints it (what `kimik3.ops.tuned.apply` matches)."""
    import triton

    d, _ = min(result["configs_timings"], key=lambda ct: ct[1])
    return str(triton.Config(d["kwargs"], num_warps=d["num_warps"], num_stages=d["num_stages"],
                             num_ctas=d["num_ctas"], maxnreg=d["maxnreg"]))


def merged(table: dict, results: list[tuple[str, dict]], modules: dict[str, str]) -> dict:
    kernels = {k: {json.dumps(e["key"]): e for e in v} for k, v in table.get("kernels", {}).items()}
    for name, result in results:
        if name not in modules:
            print(f"{name}: not an autotuned kernel of {', '.join(FLA_MODULES)}; left out", file=sys.stderr)
            continue
        entry = {"key": result["key"], "config": best_config(result)}
        kernels.setdefault(f"{modules[name]}.{name}", {})[json.dumps(result["key"])] = entry
    import triton

    return {"gpu": table.get("gpu"), "capability": table.get("capability"),
            "fla-core": importlib.metadata.version("fla-core"), "triton": triton.__version__,
            "kernels": {k: sorted(v.values(), key=lambda e: json.dumps(e["key"])) for k, v in sorted(kernels.items())}}


def dumps(table: dict) -> str:
    """The table as JSON with one choice a line (diffs of a refresh show the choices that changed)."""
    head = ",\n".join(f" {json.dumps(k)}: {json.dumps(v)}" for k, v in table.items() if k != "kernels")
    kernels = ",\n".join(f"  {json.dumps(k)}: [\n" + ",\n".join(f"   {json.dumps(e)}" for e in v) + "\n  ]"
                          for k, v in table["kernels"].items())
    return "{\n" + head + ',\n "kernels": {\n' + kernels + "\n }\n}\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("sources", nargs="+", type=Path, help="Triton cache folders or tune.tgz archives")
    p.add_argument("--gpu", required=True, help="the GPU's name as torch.cuda.get_device_name() says it")
    p.add_argument("--capability", help="its compute capability, major.minor (9.0 for an H200): required for a new "
                                        "table (a GPU without a table of its own uses one of its capability)")
    p.add_argument("--check", action="store_true", help="change nothing; exit 1 if the table would change")
    p.add_argument("--table", type=Path, help="the table to merge into (default: the package's for --gpu)")
    args = p.parse_args(argv)
    path = args.table or table_path(args.gpu)
    old = json.loads(path.read_text()) if path.is_file() else {}
    if args.capability is not None:
        try:
            old["capability"] = [int(x) for x in args.capability.split(".")]
        except ValueError:
            p.error(f"--capability must be major.minor (9.0), got {args.capability!r}")
    if old.get("capability") is None:
        p.error(f"{path.name} is a new table: give the GPU's --capability (major.minor)")
    if "fla-core" in old and old["fla-core"] != importlib.metadata.version("fla-core"):
        p.error(f"{path.name} holds fla-core {old['fla-core']}'s choices; this fla-core is "
                f"{importlib.metadata.version('fla-core')}: start a new table (move the old one away)")
    results = [r for s in args.sources for r in triton_results(s)]
    new = merged({**old, "gpu": args.gpu}, results, kernel_modules())
    text = dumps(new)
    count = sum(len(v) for v in new["kernels"].values())
    if args.check:
        same = path.is_file() and path.read_text() == text
        print(f"{path.name}: {'up to date' if same else 'would change'} ({count} choices)")
        return 0 if same else 1
    path.write_text(text)
    print(f"{path.name}: {count} choices for {len(new['kernels'])} kernels from {len(results)} Triton results")
    return 0


if __name__ == "__main__":
    sys.exit(main())
