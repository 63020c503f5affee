"""Arguments and set-up shared by `kimik3 generate` and `kimik3 chat`."""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="checkpoint folder (config.json, shards, tiktoken.model) or a Hugging Face Hub id org/name "
                        "(through the hub's cache; HF_HUB_OFFLINE=1 reads only the cache); default: the bundled "
                        "demo model")
    p.add_argument("--revision", default=None, help="branch, tag or commit of a hub id (default: main)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--dtype", default=None, choices=("bfloat16", "float32", "float16"),
                   help="compute dtype (default: the checkpoint's)")
    p.add_argument("--max-context", type=int, default=None,
                   help="most tokens (prompt + answer) a sequence may hold (default and upper bound: the model's "
                        "max_position_embeddings)")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads (default: 1 for models under 100M parameters, else torch's; OMP_NUM_THREADS "
                        "is respected)")
    p.add_argument("--lora", default=None, metavar="PATH",
                   help="a LoRA adapter folder (adapter_config.json + adapter_model.safetensors, e.g. a training "
                        "run's checkpoints/step-*/adapter) put on the model; its routed experts stay MXFP4")


# sampling flags left unset take the model's generation_config.json value (Hugging Face keys), else the
# SamplingParams default: a checkpoint can ship the settings it samples well with
SAMPLING_KEYS = ("max_new_tokens", "temperature", "top_k", "top_p", "min_p", "repetition_penalty")


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
    g.add_argument("--stop", action="append", default=[], type=unescape,
                   help=r"stop string (repeatable); the escapes \n \t \r \\ \xHH \uHHHH are decoded, so "
                        r"--stop '\n\n' stops at a blank line (write \\n for a backslash and an n)")


_ESCAPE = re.compile(r"\\(u[0-9a-fA-F]{4}|x[0-9a-fA-F]{2}|[ntr\\])")
_SIMPLE = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\"}


def unescape(s: str) -> str:
    r"""Decode the backslash escapes a shell cannot type easily: \n \t \r \\ \xHH \uHHHH. Anything else after
    a backslash is kept as written (unlike `codecs.decode(s, "unicode_escape")`, non-ASCII text survives)."""
    return _ESCAPE.sub(lambda m: _SIMPLE.get(m[1]) or chr(int(m[1][1:], 16)), s)


def sampling_params(args):
    """SamplingParams from the flags, falling back to the model's generation_config.json, then the defaults."""
    from kimik3.checkpoint.source import read_generation_config
    from kimik3.inference import SamplingParams

    gen_file, gen = read_generation_config(model_path(args))
    kw = {k: getattr(args, k) if getattr(args, k) is not None else gen[k]
          for k in SAMPLING_KEYS if getattr(args, k) is not None or k in gen}
    try:
        return SamplingParams(**kw, seed=args.seed, stop=tuple(args.stop))
    except ValueError as e:
        if any(f" {k} " in str(e) for k in kw if getattr(args, k) is None):  # the file's value, not a flag's
            raise ValueError(f"{gen_file}: {e}") from None
        raise


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


def check_request(args, cfg, *, images: bool) -> None:
    """Refuse, before the (long) load, what the model cannot do: images without a vision tower in its config,
    a --max-context beyond its positions."""
    if images and cfg.vision is None:
        raise ValueError(f"--image: the model at {model_path(args)} is text-only (its config.json has no "
                         "vision_config); use a checkpoint with a vision tower, or leave out the image")
    limit = cfg.text.max_position_embeddings
    if args.max_context is not None:
        if args.max_context < 2:
            raise ValueError(f"--max-context must be at least 2 (a prompt token and an answer), got {args.max_context}")
        if limit is not None and args.max_context > limit:
            raise ValueError(f"--max-context {args.max_context} exceeds the model's {limit:,} positions "
                             "(max_position_embeddings in config.json)")


def context_window(args, model) -> int | None:
    """Tokens (prompt + answer) one sequence may hold: --max-context, else the model's max_position_embeddings."""
    return args.max_context if args.max_context is not None else model_text_config(model).max_position_embeddings


def model_text_config(model):
    return model.config.text if hasattr(model.config, "text") else model.config


def end_ids(model, tok) -> list[int]:
    """The ids a reply ends on: the turn's end (<|end_of_msg|>) and the model's end of text (config.eos_token_id:
    [EOS] for a model trained on documents, such as the demo model)."""
    return sorted({tok.eos_id, getattr(model.config, "eos_token_id", None)} - {None})


def check_context(args, params, prompt_tokens: int, window: int | None) -> None:
    """A prompt that fills the context is an error; an answer that will stop at the context's end rather than
    at max_new_tokens gets a note on stderr."""
    if window is None or prompt_tokens + params.max_new_tokens <= window:
        return
    source = "--max-context" if args.max_context is not None else "the model's max_position_embeddings"
    if prompt_tokens >= window:
        raise ValueError(f"the prompt is {prompt_tokens:,} tokens and the context holds {window:,} ({source}): "
                         "no room for an answer")
    print(f"kimik3 {args.command}: note: the context holds {window:,} tokens ({source}); the prompt's "
          f"{prompt_tokens:,} leave room for {window - prompt_tokens:,} new tokens, not max_new_tokens "
          f"{params.max_new_tokens:,}: the answer stops there", file=sys.stderr)


def load_model_and_tokenizer(args, *, vision: bool | None = False):
    """(model in eval mode, tokenizer, path). vision: False loads text only; None loads the vision tower when
    the checkpoint has one; True requires it. With `args.parallel` (generate under torchrun) each rank loads
    its shards; only rank 0 prints."""
    import torch

    import kimik3
    from kimik3.checkpoint.source import read_config, read_tokenizer
    from kimik3.inference.threads import pick_cpu_threads
    from kimik3.quant import relayout_experts

    path = model_path(args)
    cfg = read_config(path)
    check_request(args, cfg, images=bool(vision))
    sampling_params(args)  # bad sampling values fail before the (long) load
    tokenizer = read_tokenizer(path)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype) if args.dtype else None
    # None with images too: a config with a vision_config over shards without its tensors loads as text
    # (the usual shape of text-only test checkpoints), and the check below says so
    text_only = True if vision is False else None
    lora = getattr(args, "lora", None)
    if lora is not None:
        from kimik3.lora import read_config

        read_config(lora)  # a wrong --lora fails before the (long) load
        if getattr(args, "parallel", None):
            raise ValueError("--lora with --parallel is not supported yet: merge the adapter first (kimik3 lora merge)")
    if getattr(args, "parallel", None):
        return _load_parallel(args, path, dtype, device, text_only), tokenizer, path
    model = kimik3.load(path, dtype=dtype, device=device, text_only=text_only, keep_experts_packed=lora is not None)
    if lora is not None:
        from kimik3.lora import load as load_adapter

        load_adapter(model, lora)
    model = model.eval()
    relayout_experts(model)  # Humming's kernels where the MoE backend (auto) picks them: one copy, inference only
    if vision and not model.has_vision:
        raise ValueError(f"--image: the checkpoint at {path} holds no vision tower tensors (vision_tower.*): "
                         "it reads text only")
    pick_cpu_threads(model, device, getattr(args, "threads", None))
    return model, tokenizer, path


def _load_parallel(args, path: Path, dtype, device: str, text_only: bool | None):
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
    return loader(path, dtype=dtype, device=env.device, text_only=text_only, quiet=not env.is_main).eval()


def refuse_overlap(output, *inputs) -> None:
    """A GGUF output that is an input (a file or split part of it) or lies inside an input folder is refused: a
    command never writes over or into what it reads. (Issue 42 adds this rule for every writing command; this is
    the GGUF commands' share of it, for that check to absorb.)"""
    from kimik3.checkpoint.gguf_read import gguf_parts

    out = Path(output).resolve()
    for given in inputs:
        if given is None or not Path(given).exists():
            continue
        paths = gguf_parts(given) if Path(given).is_file() and str(given).endswith(".gguf") else [Path(given)]
        for p in (q.resolve() for q in paths):
            if out == p or p in out.parents:
                raise ValueError(f"{output}: the output would be written {'over' if out == p else 'inside'} the "
                                 f"input {given}; write it elsewhere")
