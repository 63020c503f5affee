"""Arguments and set-up shared by the commands that generate: `generate`, `chat` (and `generate --input`)."""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="checkpoint folder (config.json, shards, tiktoken.model), a kimi-k3 .gguf file, or a Hugging "
                        "Face Hub id org/name (through the hub's cache; HF_HUB_OFFLINE=1 reads only the cache); "
                        "default: the bundled demo model")
    p.add_argument("--revision", default=None, help="branch, tag or commit of a hub id (default: main)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--dtype", default=None, choices=("bfloat16", "float32", "float16"),
                   help="compute dtype (default: the checkpoint's)")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads (default: 1 for models under 100M parameters, else torch's; OMP_NUM_THREADS "
                        "is respected)")
    p.add_argument("--lora", default=None, metavar="PATH",
                   help="a LoRA adapter folder (adapter_config.json + adapter_model.safetensors, e.g. a training "
                        "run's checkpoints/step-*/adapter) put on the model; its routed experts stay MXFP4")


# sampling flags left unset take the model's generation_config.json value (Hugging Face keys), else the
# SamplingParams default: a checkpoint can ship the settings it samples well with
SAMPLING_FLAGS = ("max_new_tokens", "temperature", "top_k", "top_p", "min_p", "repetition_penalty")


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling (unset: the model's generation_config.json, else the default shown)")
    g.add_argument("--max-new-tokens", type=int, default=None,
                   help="default 256; more than the context has room for stops at the context's end (with a note)")
    g.add_argument("--temperature", type=float, default=None, help="0 = greedy; default 1.0")
    g.add_argument("--top-k", type=int, default=None, help="0 = off (default)")
    g.add_argument("--top-p", type=float, default=None, help="default 1.0 (off)")
    g.add_argument("--min-p", type=float, default=None, help="default 0.0 (off)")
    g.add_argument("--repetition-penalty", type=float, default=None, help="default 1.0 (off)")
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=[],
                   help=r"stop string (repeatable); the escapes \n \t \r \\ \xHH \uHHHH are decoded, so "
                        r"--stop '\n\n' stops at a blank line (write \\n for a backslash and an n)")


_ESCAPE = re.compile(r"\\(u[0-9a-fA-F]{4}|x[0-9a-fA-F]{2}|[ntr\\]|[xu])")
_SIMPLE = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\"}


def unescape(s: str) -> str:
    r"""Decode the backslash escapes a shell cannot type easily: \n \t \r \\ \xHH \uHHHH. A \x or \u without
    its hex digits is a ValueError; anything else after a backslash is kept as written (unlike
    `codecs.decode(s, "unicode_escape")`, non-ASCII text survives)."""
    def decode(m: re.Match) -> str:
        if m[1] in ("x", "u"):
            digits = 2 if m[1] == "x" else 4
            raise ValueError(f"malformed escape \\{s[m.end() - 1:m.end() + digits]}: \\{m[1]} takes {digits} hex "
                             "digits (write \\\\ for a backslash)")
        return _SIMPLE.get(m[1]) or chr(int(m[1][1:], 16))

    return _ESCAPE.sub(decode, s)


def sampling_params(args):
    """SamplingParams from the flags over the model's generation_config.json (read here, once per command: call
    this once), over the defaults. A bad value names the flag's field, or the file."""
    import dataclasses

    from kimik3.inference.sampling import generation_defaults

    stop = []
    for text in args.stop:
        try:
            stop.append(unescape(text))
        except ValueError as e:
            raise ValueError(f"--stop '{text}': {e}") from None
    flags = {k: getattr(args, k) for k in SAMPLING_FLAGS if getattr(args, k) is not None}
    return dataclasses.replace(generation_defaults(model_path(args)), **flags, seed=args.seed, stop=tuple(stop))


def model_path(args) -> Path:
    """The model: --model (a folder, a .gguf file, or a hub id resolved once through the hub's cache), else the
    demo."""
    from kimik3.checkpoint.hub import resolve
    from kimik3.presets import DEMO_MODEL

    if getattr(args, "_model_dir", None) is None:
        args._model_dir = resolve(args.model, getattr(args, "revision", None)) if args.model else DEMO_MODEL
    path = args._model_dir
    if str(path).endswith(".gguf") and path.is_file():
        return path
    if not path.is_dir() or not (path / "config.json").is_file():
        what = "--model" if args.model else "the bundled demo model (pass --model PATH)"
        raise FileNotFoundError(f"no model at {path} ({what}): expected a checkpoint folder with config.json, or a "
                                "kimi-k3 .gguf file")
    return path


def check_context(args, params, prompt_tokens: int, window: int) -> None:
    """A prompt that fills the context is an error; an answer that will stop at the context's end rather than
    at max_new_tokens gets a note on stderr."""
    from kimik3.cli.engine_args import max_model_len

    if prompt_tokens + params.max_new_tokens <= window:
        return
    source = "--max-model-len" if max_model_len(args) is not None else "the model's max_position_embeddings"
    if prompt_tokens >= window:
        raise ValueError(f"the prompt is {prompt_tokens:,} tokens and the context holds {window:,} ({source}): "
                         "no room for an answer")
    print(f"kimik3 {args.command}: note: the context holds {window:,} tokens ({source}); the prompt's "
          f"{prompt_tokens:,} leave room for {window - prompt_tokens:,} new tokens, not max_new_tokens "
          f"{params.max_new_tokens:,}: the answer stops there", file=sys.stderr)


def open_engine(args, base, *, vision: bool | None = False):
    """(the engine over the model at --model, its folder), every flag checked before the (long) load: --threads
    against the machine's CPUs, images against the config (vision: False loads text only; None the vision tower
    when the checkpoint has one; True requires it), the engine flags over `base` (the command's `EngineConfig`
    defaults). With `args.parallel` (generate under torchrun) each rank loads its shards; only rank 0 prints."""
    import torch

    from kimik3.checkpoint.source import read_config as model_config
    from kimik3.checkpoint.source import read_tokenizer
    from kimik3.cli.engine_args import engine_config
    from kimik3.inference import load_engine
    from kimik3.inference.threads import check_threads

    check_threads(getattr(args, "threads", None), "--threads")
    path = model_path(args)
    cfg = model_config(path)
    if vision and cfg.vision is None:
        raise ValueError(f"--image: the model at {path} is text-only (its config.json has no vision_config); use "
                         "a checkpoint with a vision tower, or leave out the image")
    config = engine_config(args, base, cfg.text.max_position_embeddings)
    read_tokenizer(path)  # a missing tokenizer fails before the load
    lora = getattr(args, "lora", None)
    if lora is not None:
        from kimik3.lora import read_config

        read_config(lora)  # a wrong --lora fails before the (long) load
        if getattr(args, "parallel", None):
            raise ValueError("--lora with --parallel is not supported yet: merge the adapter first (kimik3 lora merge)")
    loader = sync = None
    if getattr(args, "parallel", None):
        loader, sync = _parallel(args)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    engine = load_engine(path, config, device=device, dtype=args.dtype, vision=vision, lora=lora,
                         threads=getattr(args, "threads", None), sync_tokens=sync, loader=loader, quiet=False)
    return engine, path


def _parallel(args):
    """(a loader of this rank's shards, the token broadcast every rank continues with): tp shards attention heads
    and MLP widths, ep the routed experts. Every rank runs the same generation on identical logits, so the sampling
    seed is made common and rank 0 prints."""
    import functools

    import torch
    import torch.distributed as dist

    from kimik3.distributed import init_distributed, load_expert_parallel, load_tensor_parallel

    env = init_distributed(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if env.world_size == 1:
        raise ValueError(f"--parallel {args.parallel} shards the model over several processes: launch with "
                         "torchrun --nproc_per_node N -m kimik3 generate ...")
    if args.seed is None:  # one random seed for all ranks: they must draw the same tokens
        seed = torch.randint(2**31 - 1, (1,), device=env.device)
        dist.broadcast(seed, 0)
        args.seed = int(seed.item())
    if not env.is_main:
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 (for the life of the process)
    shards = load_tensor_parallel if args.parallel == "tp" else load_expert_parallel

    def loader(path, *, dtype, device, text_only, quiet, keep_experts_packed, **tiers):
        if tiers and args.parallel == "tp":
            raise ValueError("--cpu-offload-gb with --parallel tp: tiers hold whole experts; use --parallel ep")
        return shards(path, dtype=dtype, device=env.device, text_only=text_only, quiet=not env.is_main, **tiers)

    return loader, functools.partial(dist.broadcast, src=0)
