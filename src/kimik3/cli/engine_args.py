"""The engine's flags, one set for every command that runs the engine (`generate` for one prompt and for `--input`,
`chat`, `serve`, `eval`): vLLM's names, one meaning each, checked before anything is loaded into a frozen
`EngineConfig`. A flag left unset takes the command's default config (`base`): the engine's own defaults, except
where a command says otherwise (one sequence for one prompt, warm-up for a server)."""

from __future__ import annotations

import argparse
import dataclasses
import warnings

ENGINE_FLAGS = {"max_num_seqs": "--max-num-seqs", "max_num_batched_tokens": "--max-num-batched-tokens",
                "max_model_len": "--max-model-len", "prefix_cache_bytes": "--prefix-cache-bytes",
                "cpu_offload_gb": "--cpu-offload-gb", "expert_trace": "--expert-trace",
                "expert_misses": "--expert-misses"}
SPECULATIVE_FLAGS = {"method": "--speculative-method", "model": "--speculative-model",
                     "num_speculative_tokens": "--num-speculative-tokens", "adaptive": "--adaptive-speculation"}


def add_engine_args(p: argparse.ArgumentParser, *, max_num_seqs: str = "64", warmup: bool = False,
                    seqs_alias: str | None = None) -> None:
    """The engine flags, unset by default (the command's base config decides: `max_num_seqs` says its value in the
    help); `warmup` adds --no-warmup (a server warms up; nothing else does), `seqs_alias` another spelling of
    --max-num-seqs (lm-eval's --batch-size)."""
    g = p.add_argument_group("engine")
    g.add_argument("--max-num-seqs", *([seqs_alias] if seqs_alias else []), type=int, default=None,
                   help=f"sequences running at once (default: {max_num_seqs})")
    g.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="tokens in one engine step (prefill chunks + decodes), at least 64 (default: 2048)")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="prompt + output tokens per sequence, at most the model's max_position_embeddings (the "
                        "default); an answer stops there")
    g.add_argument("--max-context", type=int, default=None, metavar="MAX_MODEL_LEN",
                   help="deprecated: the old name of --max-model-len")
    g.add_argument("--prefix-cache-bytes", type=int, default=None,
                   help="byte budget of the prefix cache (default: 16 KDA snapshots + a quarter of the MLA pool)")
    g.add_argument("--no-prefix-cache", action="store_true", help="turn the prefix cache off")
    if warmup:
        g.add_argument("--no-warmup", action="store_true",
                       help="skip compiling and capturing every step shape before serving (first requests then wait)")
    g.add_argument("--cpu-offload-gb", type=_gib, default=None, metavar="GIB",
                   help="GiB of routed experts per GPU kept in host memory only, the GPU caching the rest (hot "
                        "experts by counted routing; docs/tiering.md), or auto: what does not fit (default: none)")
    g.add_argument("--expert-trace", metavar="FILE", default=None,
                   help="with --cpu-offload-gb: the experts' counted routing, read at start when the file exists "
                        "(the cache starts warm) and written at exit")
    g.add_argument("--expert-misses", choices=("auto", "host", "copy"), default=None,
                   help="with --cpu-offload-gb: experts not in the GPU cache computed on the host's cores or copied "
                        "to the GPU (copy: greedy tokens equal the all-resident model's bit for bit, in bf16 too); "
                        "auto (default): the cheaper by measured cost, each step")
    g.add_argument("--deterministic", action=argparse.BooleanOptionalAction, default=None,
                   help="batch-invariant kernels: a request's tokens do not depend on what else runs beside it, "
                        "and greedy tokens with speculative decoding equal those without it, in bf16 too "
                        "(docs/inference.md has its cost, on the GPU and the CPU; default: off)")
    g.add_argument("--speculative-method", choices=("suffix", "draft"), default=None,
                   help="speculative decoding: suffix (model-free, copies from the prompt and output) or draft "
                        "(a DSpark-style drafter, --speculative-model); the same output (greedy: the same tokens in "
                        "float32; bf16 rounds a verified row differently, which can flip a near-tie)")
    g.add_argument("--speculative-model", metavar="PATH", default=None,
                   help="the drafter for --speculative-method draft: a folder or a preset (demo-draft); default: the "
                        "drafter shipped with the model, if any (the demo model's)")
    g.add_argument("--num-speculative-tokens", type=int, default=None, metavar="K",
                   help="the most draft tokens verified per sequence and step (default 4)")
    g.add_argument("--adaptive-speculation", action=argparse.BooleanOptionalAction, default=None,
                   help="pick each step's draft length up to --num-speculative-tokens, none where drafting loses, "
                        "from the measured acceptance and step costs (default: on; --no-adaptive-speculation "
                        "drafts K every step)")


def speculative_config(args):
    """The `SpeculativeConfig` the speculative flags ask for (None: off). Its own checks are the rules; their
    messages name the flag."""
    from kimik3.inference.engine.config import SpeculativeConfig
    from kimik3.presets import resolve_drafter

    method, model, k, adaptive = (getattr(args, a, None) for a in ("speculative_method", "speculative_model",
                                                                  "num_speculative_tokens", "adaptive_speculation"))
    if method is None:
        if model is not None or k is not None or adaptive is not None:
            raise ValueError("--speculative-model, --num-speculative-tokens and --[no-]adaptive-speculation need "
                             "--speculative-method")
        return None
    if method == "draft":  # a preset name, or the model's shipped drafter, becomes the folder SpeculativeConfig checks
        model = str(resolve_drafter(model, getattr(args, "model", None)))
    given = {"num_speculative_tokens": k} if k is not None else {}
    if adaptive is not None:
        given["adaptive"] = adaptive
    try:
        return SpeculativeConfig(method, model, **given)
    except (ValueError, FileNotFoundError) as e:
        raise _flag_error(e, SPECULATIVE_FLAGS) from None


def max_model_len(args) -> int | None:
    """--max-model-len, or its deprecated alias --max-context (with a warning that says so)."""
    new, old = getattr(args, "max_model_len", None), getattr(args, "max_context", None)
    if old is None:
        return new
    if new is not None and new != old:
        raise ValueError(f"--max-context {old} and --max-model-len {new}: --max-context is the old name of "
                         "--max-model-len; give only --max-model-len")
    warnings.warn("--max-context is deprecated: use --max-model-len (the same setting)", stacklevel=2)
    return old


def engine_config(args, base, positions: int | None = None):
    """The `EngineConfig` of the flags given, the others `base`'s (the command's defaults); a bad value is a
    ValueError naming its flag. `positions`: the model's max_position_embeddings (a --max-model-len past it is
    refused), when the config is read already."""
    limit = max_model_len(args)
    if positions is not None and limit is not None and limit > positions:
        raise ValueError(f"--max-model-len {limit} exceeds the model's {positions} positions "
                         "(max_position_embeddings)")
    if args.no_prefix_cache and args.prefix_cache_bytes is not None:
        raise ValueError("--prefix-cache-bytes sizes the prefix cache that --no-prefix-cache turns off: give one")
    offload, trace = getattr(args, "cpu_offload_gb", None), getattr(args, "expert_trace", None)
    misses = getattr(args, "expert_misses", None)
    if (trace is not None or misses is not None) and offload is None:
        raise ValueError("--expert-trace and --expert-misses are about tiered experts: they need --cpu-offload-gb")
    given = {k: v for k, v in (("max_num_seqs", args.max_num_seqs),
                               ("max_num_batched_tokens", args.max_num_batched_tokens),
                               ("max_model_len", limit), ("prefix_cache_bytes", args.prefix_cache_bytes),
                               ("cpu_offload_gb", offload), ("expert_trace", trace), ("expert_misses", misses),
                               ("deterministic", getattr(args, "deterministic", None)))
             if v is not None}
    if args.no_prefix_cache or args.prefix_cache_bytes is not None:
        given["enable_prefix_cache"] = not args.no_prefix_cache
    if getattr(args, "no_warmup", False):
        given["warmup"] = False
    try:
        return dataclasses.replace(base, **given, speculative=speculative_config(args))
    except ValueError as e:
        raise _flag_error(e, ENGINE_FLAGS) from None


def _gib(text: str) -> float | str:
    """--cpu-offload-gb's value: "auto" or a number (its range is EngineConfig's to check)."""
    if text == "auto":
        return text
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of GiB or auto, got {text!r}") from None


def _flag_error(e: Exception, flags: dict[str, str]) -> Exception:
    """A config's error (its message starts with the field's name) with the command's flag in its place."""
    field, _, rest = str(e).partition(" ")
    return type(e)(f"{flags[field]} {rest}" if field in flags else str(e))
