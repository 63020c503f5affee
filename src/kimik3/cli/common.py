"""Arguments and set-up shared by `kimik3 generate` and `kimik3 chat`."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="checkpoint folder (config.json, shards, tiktoken.model)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--dtype", default=None, choices=("bfloat16", "float32", "float16"),
                   help="compute dtype (default: the checkpoint's)")
    p.add_argument("--max-context", type=int, default=None, help="most tokens (prompt + answer) a sequence may hold")


# sampling flags left unset take the model's generation_config.json value (Hugging Face keys), else the
# SamplingParams default: a checkpoint can ship the settings it samples well with
SAMPLING_KEYS = ("max_new_tokens", "temperature", "top_k", "top_p", "min_p", "repetition_penalty")


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling (unset: the model's generation_config.json, else the default shown)")
    g.add_argument("--max-new-tokens", type=int, default=None, help="default 256")
    g.add_argument("--temperature", type=float, default=None, help="0 = greedy; default 1.0")
    g.add_argument("--top-k", type=int, default=None, help="0 = off (default)")
    g.add_argument("--top-p", type=float, default=None, help="default 1.0 (off)")
    g.add_argument("--min-p", type=float, default=None, help="default 0.0 (off)")
    g.add_argument("--repetition-penalty", type=float, default=None, help="default 1.0 (off)")
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def sampling_params(args):
    """SamplingParams from the flags, falling back to the model's generation_config.json, then the defaults."""
    from kimik3.checkpoint.folder import GENERATION_CONFIG
    from kimik3.inference import SamplingParams

    gen_file = model_path(args) / GENERATION_CONFIG
    gen = json.loads(gen_file.read_text()) if gen_file.is_file() else {}
    kw = {k: getattr(args, k) if getattr(args, k) is not None else gen[k]
          for k in SAMPLING_KEYS if getattr(args, k) is not None or k in gen}
    return SamplingParams(**kw, seed=args.seed, stop=tuple(args.stop))


def model_path(args) -> Path:
    from kimik3.presets import DEMO_MODEL

    path = Path(args.model) if args.model else DEMO_MODEL
    if not path.is_dir() or not (path / "config.json").is_file():
        raise FileNotFoundError(f"no model at {path}: expected a checkpoint folder with config.json")
    return path


def load_model_and_tokenizer(args, *, vision: bool = False):
    """(model in eval mode, tokenizer, path); vision=False loads text only. With `args.parallel` (generate under
    torchrun) each rank loads its shards; only rank 0 prints."""
    import torch

    import kimik3
    from kimik3.tokenizer import Tokenizer

    path = model_path(args)
    sampling_params(args)  # bad sampling values fail before the (long) load
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype) if args.dtype else None
    tokenizer = Tokenizer.from_file(path)
    if getattr(args, "parallel", None):
        return _load_parallel(args, path, dtype, device, vision), tokenizer, path
    model = kimik3.load(path, dtype=dtype, device=device, text_only=not vision).eval()
    return model, tokenizer, path


def _load_parallel(args, path: Path, dtype, device: str, vision: bool):
    """This rank's shards of the model (tp: attention heads and MLP widths; ep: routed experts). Every rank
    runs the same generation on identical logits, so the sampling seed is made common and rank 0 prints."""
    import torch
    import torch.distributed as dist

    from kimik3.distributed import init_distributed, load_expert_parallel, load_tensor_parallel

    env = init_distributed(device)
    if env.world_size == 1:
        raise ValueError(f"--parallel {args.parallel} shards the model over several processes: launch with "
                         "torchrun --nproc_per_node N -m kimik3 generate ...")
    if args.seed is None:  # one random seed for all ranks: they must draw the same tokens
        seed = torch.randint(2**31 - 1, (1,), device=env.device)
        dist.broadcast(seed, 0)
        args.seed = int(seed.item())
    if not env.is_main:
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 (for the life of the process)
    loader = load_tensor_parallel if args.parallel == "tp" else load_expert_parallel
    return loader(path, dtype=dtype, device=env.device, text_only=not vision, quiet=not env.is_main).eval()
