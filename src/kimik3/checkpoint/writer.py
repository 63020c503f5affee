"""Write a model as a checkpoint folder in the released layout, atomically, one tensor in memory at a time.

    config.json                            the model's config.hf (quantization_config as the experts are stored)
    generation_config.json                 {"max_length": max_position_embeddings, "eos_token_id": eos}
    model.safetensors.index.json           {"metadata": {"total_size": bytes}, "weight_map": {tensor: shard}}
    model-00001-of-000096.safetensors ...  5-digit index, 6-digit total, as released (spec 3.1)
    tiktoken.model, MODEL_CARD.md, ...     copied from the source folder (`source=`, default: the folder the
                                           model was loaded from), so the folder is usable as it is; a source
                                           generation_config.json replaces the written one
    tokenizer_config.json,                 with a tiktoken.model: what transformers and llama.cpp's converter
    tokenization_kimi.py                   load (`kimik3.tokenizer.hf_files`), written fresh

Names and dtypes are `checkpoint_specs` of the model rebuilt on the meta device in the checkpoint dtype, so
what `load` expects is exactly what is written. Shards are ordered like the release: decoder layers in order,
then the rest of the text model, the projector, the vision tower.
"""

from __future__ import annotations

import copy
import json
import math
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor, nn

from kimik3.checkpoint.folder import (
    CONFIG,
    GENERATION_CONFIG,
    INDEX,
    LOADED_FROM,
    companion_files,
    copy_durably,
    is_checkpoint_file,
    publish_atomically,
)
from kimik3.checkpoint.inventory import model_specs, parse_dtype, stored_dtype
from kimik3.checkpoint.keys import RELEASED_QUANTIZATION, TensorSpec, checkpoint_prefix, is_vision_key, parse_expert_key
from kimik3.checkpoint.progress import progress_bar, wanted
from kimik3.checkpoint.safetensors_header import encode_header
from kimik3.config import EXPERT_FORMATS, ExpertFormat, K3Config
from kimik3.model import K3ForConditionalGeneration
from kimik3.ops.mxfp4 import decode, encode
from kimik3.tokenizer.hf_files import write_hf_files

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)?\s*$", re.IGNORECASE)
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
TOKENIZER = "tiktoken.model"
_LAYER = re.compile(r"\.layers\.(\d+)\.")
# safetensors is little-endian and `write_shard` copies host-order bytes
assert sys.byteorder == "little", "kimik3.checkpoint.writer needs a little-endian host"


def parse_size(size: int | str) -> int:
    """Bytes from an int or a string like '5GB' (10^9) / '500MB' / '2GiB' (2^30)."""
    m = _SIZE.match(size) if isinstance(size, str) else None
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    if m and float(m[1]) > 0:
        return int(float(m[1]) * _UNITS[(m[2] or "B").upper()])
    raise ValueError(f"max_shard_size must be a positive int of bytes or a string like '5GB' or '500MB', "
                     f"got {size!r}")


def save(model: nn.Module, path: str | Path, *, experts: ExpertFormat = "mxfp4", max_shard_size: int | str = "5GB",
         dtype: torch.dtype | str | None = None, config: K3Config | None = None,
         source: str | Path | None = None, quiet: bool = False) -> Path:
    """Write `model` (K3ForConditionalGeneration or K3ForCausalLM) as a checkpoint folder at `path`.

    Args:
        experts: how the routed experts are stored. "mxfp4" as released (`weight_packed` + `weight_scale`):
            dense experts are encoded per expert (lossy unless they came from MXFP4), packed ones copied byte for
            byte. "bf16" stores dense `weight` experts (packed ones decoded exactly) and drops
            quantization_config.
        max_shard_size: shard size limit (a tensor larger than it gets a shard of its own).
        dtype: stored dtype of every tensor outside the fp32 islands; None = the config's (bfloat16). A
            model in another dtype is cast (so an fp32 model saved as bf16 is rounded).
        config: the K3Config for config.json; required for a K3ForCausalLM, which carries only its TextConfig.
        source: a checkpoint folder whose tokenizer, model card, generation_config.json and other non-weight
            files are copied into the new folder (or one file: a tokenizer rank file, written as
            `tiktoken.model`; or a GGUF, whose vocabulary and sampling defaults are written out);
            None = the folder the model was loaded from (`model.loaded_from`, set by
            `kimik3.load`), if any. With a tiktoken.model the folder also gets tokenizer_config.json (the Jinja
            chat template inside) and tokenization_kimi.py, so transformers and llama.cpp's converter load it.
        quiet: no progress bar (shown only when stderr is a terminal anyway).

    The folder appears only when complete (`folder.publish_atomically`): everything is written to a hidden
    sibling, then renamed into place. An existing checkpoint folder at `path` (even the source itself) is
    replaced: its config.json, index and weight files go, every other file of it (a tokenizer, notes) is kept
    unless the new folder brings its own. A crash leaves at most a `.NAME.partial-*` or `.NAME.old-*` sibling,
    never a half-written folder at `path`.

    Returns:
        `path`.
    """
    if experts not in EXPERT_FORMATS:
        raise ValueError(f"experts must be one of {EXPERT_FORMATS}, got {experts!r}")
    adapter = next((n for n, _ in model.named_parameters() if ".lora_" in n or "_lora_" in n), None)
    if adapter is not None:  # the released layout has no place for it: it would be dropped without a word
        raise ValueError(f"the model carries a LoRA adapter ({adapter}): write it with kimik3.lora.save, or merge it "
                         "into the weights first (kimik3.lora.merge / kimik3 lora merge)")
    limit = parse_size(max_shard_size)
    cfg = config_of(model, config)
    dtype = parse_dtype(dtype) or stored_dtype(cfg)
    path = Path(path)
    _check_replaceable(path)
    if source is None:  # the folder (or GGUF) the model came from, unless it is gone since
        source = getattr(model, LOADED_FROM, None)
        source = source if source is not None and (Path(source).is_dir() or str(source).endswith(".gguf")) else None
    from_gguf = source is not None and str(source).endswith(".gguf")
    companions = companion_files(source) if source is not None and not from_gguf else []

    specs = sorted(model_specs(model, experts, dtype), key=_release_order)
    shards = _plan_shards(specs, limit)
    names = [f"model-{i + 1:05d}-of-{len(shards):06d}.safetensors" for i in range(len(shards))]
    with_vision = any(is_vision_key(s.name) for s in specs)

    def write(tmp: Path) -> None:
        produce = _Producer(model, checkpoint_prefix(model))
        total = sum(_nbytes(s) for s in specs)
        with progress_bar("saving", total, len(specs), wanted(quiet)) as advance:
            for name, shard in zip(names, shards, strict=True):
                write_shard(tmp / name, shard, produce, advance)
        weight_map = {s.name: n for n, shard in zip(names, shards, strict=True) for s in shard}
        _write_json(tmp / INDEX, {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))})
        _write_json(tmp / CONFIG, config_json(cfg, experts, dtype, with_vision))
        _write_json(tmp / GENERATION_CONFIG, _generation_config(cfg))
        for f in companions:  # a single file is the tokenizer, whatever it is called
            copy_durably(f, tmp / (TOKENIZER if Path(source).is_file() else f.name))
        if from_gguf:  # its vocabulary and sampling defaults, as the files a folder keeps them in
            from kimik3.checkpoint.gguf_read import write_companions

            write_companions(source, tmp)
        if (tmp / TOKENIZER).is_file():
            try:
                write_hf_files(tmp, cfg.text.max_position_embeddings)
            except ValueError as e:  # copied along as it was; only the HF files need to read it
                print(f"kimik3: note: {path / TOKENIZER} is not a K3 rank file ({e}); wrote no tokenizer_config.json",
                      file=sys.stderr)

    return publish_atomically(path, write, carry_over=lambda name: not is_checkpoint_file(name))


def config_of(model: nn.Module, config: K3Config | None) -> K3Config:
    """The K3Config a checkpoint of `model` records: `config`, else the model's (checked to describe the model)."""
    text = model.config.text if isinstance(model, K3ForConditionalGeneration) else model.config
    cfg = config if config is not None else model.config
    if not isinstance(cfg, K3Config):
        raise ValueError("save: a K3ForCausalLM carries only its TextConfig; pass config=K3Config "
                         "(e.g. K3Config.from_file('config.json')) to write config.json")
    if not cfg.hf:
        raise ValueError("save: the config has no HF dict to write as config.json; build it with "
                         "K3Config.from_file or K3Config.from_hf")
    if cfg.text != text:
        raise ValueError("save: config= does not describe the model (its text config differs)")
    return cfg


def _check_replaceable(path: Path) -> None:
    if path.is_symlink() or (path.exists() and not path.is_dir()):
        raise ValueError(f"{path} exists and is not a folder; refusing to replace it")
    if path.is_dir() and any(path.iterdir()) and not (path / CONFIG).exists() and not (path / INDEX).exists():
        raise ValueError(f"{path} is a non-empty folder that is not a checkpoint; refusing to replace it")


def _release_order(spec: TensorSpec) -> tuple[int, int]:
    """Sort key: decoder layers in order, then the rest of the text model, the projector, the vision tower."""
    m = _LAYER.search(spec.name)
    if spec.name.startswith("mm_projector."):
        return (2, 0)
    if spec.name.startswith("vision_tower."):
        return (3, 0)
    return (0, int(m[1])) if m else (1, 0)


def _nbytes(spec: TensorSpec) -> int:
    return math.prod(spec.shape) * spec.dtype.itemsize


def _plan_shards(specs: list[TensorSpec], limit: int) -> list[list[TensorSpec]]:
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for s in specs:
        if shards[-1] and size + _nbytes(s) > limit:
            shards.append([])
            size = 0
        shards[-1].append(s)
        size += _nbytes(s)
    return shards


def write_shard(path: Path, specs: list[TensorSpec], produce: Callable[[TensorSpec], Tensor],
                advance: Callable[[int], None]) -> None:
    """One safetensors file: the header, then each tensor built by `produce` just before it is written."""
    header, sizes = encode_header([(s.name, s.dtype, s.shape) for s in specs], {"format": "pt"})
    with open(path, "wb") as f:
        f.write(header)
        for spec, nbytes in zip(specs, sizes, strict=True):
            t = produce(spec)
            assert t.dtype == spec.dtype and tuple(t.shape) == spec.shape, (spec, t.dtype, t.shape)
            # safetensors stores little-endian: the raw bytes of a contiguous CPU tensor on this host
            f.write(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data)
            advance(nbytes)
        f.flush()
        os.fsync(f.fileno())


class _Producer:
    """Builds one checkpoint tensor from the model's state dict, in the spec's dtype."""

    def __init__(self, model: nn.Module, prefix: str):
        self.state = model.state_dict()
        self.prefix = prefix
        self._encoded: tuple[tuple[str, int], Tensor, Tensor] | None = None  # the last expert encoded

    @torch.no_grad()
    def __call__(self, spec: TensorSpec) -> Tensor:
        name = spec.name.removeprefix(self.prefix)
        key = parse_expert_key(name)
        if key is None:
            return self.state[name].to(spec.dtype)
        base = key.stacked.removesuffix("_packed").removesuffix("_scale")
        if base + "_packed" in self.state:  # the model keeps MXFP4 bytes
            packed, scale = self.state[base + "_packed"][key.expert], self.state[base + "_scale"][key.expert]
            if key.part == "weight":
                return decode(packed, scale, spec.dtype)
            return packed if key.part == "weight_packed" else scale
        dense = self.state[base][key.expert]
        if key.part == "weight":
            return dense.to(spec.dtype)
        if self._encoded is None or self._encoded[0] != (base, key.expert):
            self._encoded = ((base, key.expert), *encode(dense))  # packed and scale come as a pair
        return self._encoded[1] if key.part == "weight_packed" else self._encoded[2]


def config_json(cfg: K3Config, experts: ExpertFormat, dtype: torch.dtype, with_vision: bool) -> dict:
    """config.json: the config's own dict with the storage record (dtype, quantization_config) as written."""
    hf = copy.deepcopy(cfg.hf)
    text = hf.get("text_config", hf)
    if experts == "mxfp4":
        text.setdefault("quantization_config", copy.deepcopy(RELEASED_QUANTIZATION))
    else:
        text.pop("quantization_config", None)
        hf.pop("quantization_config", None)  # a transformers-parsed config copies it up
    name = str(dtype).removeprefix("torch.")
    for d in [hf] if text is hf else [hf, text]:
        d["dtype"] = name
        if "torch_dtype" in d:
            d["torch_dtype"] = name
    if not with_vision:  # a text-only model writes a self-consistent text-only checkpoint
        hf.pop("vision_config", None)
    return hf


def _generation_config(cfg: K3Config) -> dict:
    text = cfg.hf.get("text_config", cfg.hf)
    out = {"max_length": text.get("max_position_embeddings"), "eos_token_id": cfg.eos_token_id}
    return {k: v for k, v in out.items() if v is not None}


def _write_json(path: Path, data: dict) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=2)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
