"""The engine's flags, one set for `serve` and `generate --input` (vLLM's names and the same defaults), validated
before anything is loaded, into a frozen `EngineConfig`."""

from __future__ import annotations

import argparse


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--max-num-seqs", type=int, default=64, help="sequences running at once")
    g.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="tokens in one engine step (prefill chunks + decodes), at least 64")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="prompt + output tokens per sequence (default: the model's max_position_embeddings)")
    g.add_argument("--prefix-cache-bytes", type=int, default=None,
                   help="byte budget of the prefix cache (default: 16 KDA snapshots + a quarter of the MLA pool)")
    g.add_argument("--no-prefix-cache", action="store_true", help="turn the prefix cache off")
    g.add_argument("--no-warmup", action="store_true",
                   help="skip compiling and capturing every step shape before serving (first requests then wait)")
    g.add_argument("--speculative-method", choices=("suffix", "draft"), default=None,
                   help="speculative decoding: suffix (model-free, copies from the prompt and output) or draft "
                        "(a DSpark-style drafter, --speculative-model); the same output (greedy: the same tokens in "
                        "float32; bf16 rounds a verified row differently, which can flip a near-tie)")
    g.add_argument("--speculative-model", metavar="PATH", default=None,
                   help="the drafter for --speculative-method draft: a folder or a preset (demo-draft); default: the "
                        "drafter shipped with the model, if any (the demo model's)")
    g.add_argument("--num-speculative-tokens", type=int, default=None, metavar="K",
                   help="draft tokens verified per sequence and step (default 4)")


def speculative_config(args):
    """The `SpeculativeConfig` the speculative flags ask for (None: off); a bad value names its flag."""
    from kimik3.inference.engine.config import SpeculativeConfig
    from kimik3.presets import resolve_drafter

    method, model, k = (getattr(args, a, None) for a in ("speculative_method", "speculative_model",
                                                        "num_speculative_tokens"))
    if method is None:
        if model is not None or k is not None:
            raise ValueError("--speculative-model and --num-speculative-tokens need --speculative-method")
        return None
    if method == "suffix" and model:
        raise ValueError("--speculative-model is for --speculative-method draft, not suffix")
    if k is not None and k < 1:
        raise ValueError(f"--num-speculative-tokens must be at least 1, got {k}")
    if method == "draft":
        model = str(resolve_drafter(model, getattr(args, "model", None)))
    return SpeculativeConfig(method, model, 4 if k is None else k)


def engine_config(args, positions: int | None = None, *, warmup: bool = False):
    """The `EngineConfig` the flags ask for; a bad value is a ValueError naming its flag. `positions`: the
    model's max_position_embeddings (a --max-model-len past it is refused), when the config is read already."""
    from kimik3.inference.engine import EngineConfig

    flags = {"max_num_seqs": "--max-num-seqs", "max_num_batched_tokens": "--max-num-batched-tokens",
             "max_model_len": "--max-model-len", "prefix_cache_bytes": "--prefix-cache-bytes"}
    if positions is not None and args.max_model_len is not None and args.max_model_len > positions:
        raise ValueError(f"--max-model-len {args.max_model_len} exceeds the model's {positions} positions "
                         "(max_position_embeddings)")
    try:
        return EngineConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                            max_model_len=args.max_model_len, prefix_cache_bytes=args.prefix_cache_bytes,
                            enable_prefix_cache=not args.no_prefix_cache,
                            warmup=warmup and not getattr(args, "no_warmup", False),
                            speculative=speculative_config(args))
    except ValueError as e:
        field = str(e).split(" ", 1)[0]
        raise ValueError(f"{flags.get(field, field)} {str(e).split(' ', 1)[1]}") from None
