"""Streaming load of a checkpoint folder in the released layout into a `K3ForConditionalGeneration`.

    1. locate config.json + index + shards; read every shard header (no tensor data)
    2. decide on the vision tower (text_only=None: load it when the shards hold it), then check the header
       set against the config: missing / unexpected / wrong shape or dtype -> one error
    3. build on the meta device (experts kept packed: `pack_experts`), `allocate(model, device)`: the final size, once
    4. per shard (one open at a time), per tensor in file order: read, cast to the destination's dtype,
       copy into place (a per-expert tensor into its slice of the stacked experts; an `A_log` of another
       stored length: its first num_heads entries, the padding tail zeroed)

Checkpoints of other implementations load: any `A_log` length >= num_heads, and a config.json that has a
vision_config over shards without vision tensors (the usual text-only test checkpoint) loads as a text model.

With `expert_shard=(rank, world)` the model holds only that rank's contiguous routed experts
(`kimik3.checkpoint.sharded`); the whole header set is still checked, but other ranks' per-expert tensors
are never read.

Peak memory is the model plus about one tensor: shards are read with pread (`backend="pread"`), so no
mapped file pages pile up in the process while a 16 GB shard is read.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import Tensor, nn

from kimik3.checkpoint.folder import LOADED_FROM, Folder, Scan, gc_paused, locate, missing_shards_error, scan
from kimik3.checkpoint.hub import resolve
from kimik3.checkpoint.inventory import (
    a_log_heads,
    compare,
    expected_specs,
    has_vision_tensors,
    mismatch_error,
    parse_dtype,
    stored_dtype,
    without_vision,
)
from kimik3.checkpoint.keys import is_vision_key, parse_expert_key
from kimik3.checkpoint.progress import progress_bar, wanted
from kimik3.checkpoint.safetensors_header import TensorEntry
from kimik3.checkpoint.sharded import ExpertShard, slice_experts
from kimik3.config import K3Config
from kimik3.model import K3ForConditionalGeneration
from kimik3.model.init import allocate
from kimik3.ops.mxfp4 import decode, encode
from kimik3.placement import fill_slots, tier_by_budget
from kimik3.quant import pack_experts


def load(path: str | Path, *, dtype: torch.dtype | str | None = None, device: str | torch.device = "cpu",
         text_only: bool | None = None, keep_experts_packed: bool = False, quiet: bool = False,
         expert_shard: tuple[int, int] | None = None, experts: str | None = None,
         revision: str | None = None, cpu_offload_gb: float | str | None = None, expert_misses: str = "auto",
         expert_trace: str | Path | None = None,
         offload_reserve_bytes: int | None = None) -> K3ForConditionalGeneration:
    """Load a checkpoint folder (config.json, model.safetensors.index.json + shards, or model.safetensors).

    Args:
        path: the checkpoint folder, a Hugging Face Hub id `org/name` (read through huggingface_hub's cache;
            `kimik3.checkpoint.hub`), or a `.gguf` file of llama.cpp's kimi-k3 layout (one file or any part of a
            gguf-split set; `kimik3.checkpoint.gguf_read`: the text model, MXFP4 experts exact, other ggml
            types dequantized with a note).
        dtype: parameter and compute dtype; None = the config's (bfloat16). The fp32 islands (KDA A_log,
            dt_bias, conv weights, o_norm; router correction bias) stay fp32: each tensor is cast to the
            dtype of the parameter or buffer it lands in.
        device: "cpu" or "cuda" (the model is allocated there once and filled tensor by tensor).
        text_only: None = load the vision tower when the config has one and the shards hold its tensors (a
            config with a vision_config over text-only shards loads as a text model, with one line on stderr
            saying so); True skips the vision tower and projector tensors without reading them; False loads
            them too (the config must have a vision part and the shards all of its tensors).
        keep_experts_packed: False expands MXFP4 routed experts exactly to `dtype`; True keeps them packed in
            memory (`MXFP4Experts`: the checkpoint bytes are copied, never decoded). Dense (`.weight`) experts
            load into either; kept packed they are encoded, which is lossy unless they came from MXFP4.
        quiet: no progress bar (it is shown only when stderr is a terminal anyway).
        expert_shard: (rank, world): keep and read only routed experts [rank*E/W, (rank+1)*E/W) of every
            MoE layer (expert parallelism; `kimik3.distributed.expert_parallel.load_expert_parallel`).
        experts: deprecated spelling of keep_experts_packed ("mxfp4" = True, "dequantize" = False).
        revision: a hub id's branch, tag or commit (default: main).
        cpu_offload_gb: GiB of routed experts (per device) kept in host memory only, the device caching the rest
            (`kimik3.placement`; "auto" on CUDA: what does not fit beside the other weights and
            `offload_reserve_bytes`, default 4 GiB, for state and workspace). The experts are read straight into
            pinned host memory, still MXFP4-packed; None or 0: every expert on `device`, as without it.
        expert_misses: "auto" (by measured cost), "host" or "copy": how a tiered layer serves a miss.
        expert_trace: a routing trace (`kimik3.placement.save_trace`) whose hottest experts fill the slots, read
            when the file exists.

    Returns:
        the model; `model(input_ids [B, T])` -> logits [B, T, vocab]. `model.loaded_from` is the folder.

    Raises:
        FileNotFoundError: missing folder, config.json, index, or a shard the index names.
        ValueError: bad arguments; corrupt or truncated shards; not a safetensors file; tensors missing,
            unexpected, or of the wrong shape/dtype for config.json. Nothing is allocated before the checks.
    """
    if str(path).endswith(".gguf"):  # llama.cpp's format: the text model (`gguf_read`, needs the gguf package)
        if text_only is False or expert_shard is not None or experts is not None or revision is not None:
            raise ValueError(f"{path}: a GGUF holds the text model only; text_only=False, expert_shard, experts and "
                             "revision do not apply to it")
        from kimik3.checkpoint.gguf_read import load_gguf

        return load_gguf(path, dtype=dtype, device=_parse_device(device), keep_experts_packed=keep_experts_packed,
                         quiet=quiet, cpu_offload_gb=cpu_offload_gb, expert_misses=expert_misses,
                         expert_trace=expert_trace, offload_reserve_bytes=offload_reserve_bytes)
    return load_sharded(resolve(path, revision), dtype=dtype, device=device, text_only=text_only,
                        keep_experts_packed=keep_experts_packed, quiet=quiet, expert_shard=expert_shard,
                        experts=experts, cpu_offload_gb=cpu_offload_gb, expert_misses=expert_misses,
                        expert_trace=expert_trace, offload_reserve_bytes=offload_reserve_bytes)


# this rank's block of a checkpoint tensor, given its name and full shape: index slices, or None for all of it
SliceOf = Callable[[str, tuple[int, ...]], "tuple[slice, ...] | None"]


def load_sharded(path: str | Path, *, dtype: torch.dtype | str | None = None, device: str | torch.device = "cpu",
                 text_only: bool | None = None, keep_experts_packed: bool = False, quiet: bool = False,
                 expert_shard: tuple[int, int] | None = None,
                 shard_model: Callable[[nn.Module], object] | None = None,
                 slice_of: SliceOf | None = None, experts: str | None = None,
                 cpu_offload_gb: float | str | None = None, expert_misses: str = "auto",
                 expert_trace: str | Path | None = None,
                 offload_reserve_bytes: int | None = None) -> K3ForConditionalGeneration:
    """`load` for parallel loaders (`kimik3.distributed`): the same checks and streaming fill, plus two hooks.

    `shard_model(model)` reshapes the model on the meta device into this rank's shards before anything is
    allocated; `slice_of(name, shape)` names the block of checkpoint tensor `name` the rank keeps (contiguous
    index slices; None = all of it), which is read through safetensors' slices: only those bytes are read.
    Other arguments: as `load`.
    """
    packed = _keep_packed(keep_experts_packed, experts)
    offload = cpu_offload_gb not in (None, 0)
    dtype = parse_dtype(dtype)
    device = _parse_device(device)
    if text_only not in (None, True, False):
        raise ValueError(f"text_only must be None, True or False, got {text_only!r}")

    folder = locate(path)
    try:
        cfg = K3Config.from_file(folder.config)
    except ValueError as e:  # name the file unless the config reader already did
        raise ValueError(str(e) if str(folder.config) in str(e) else f"{folder.config}: {e}") from None
    dtype = dtype or stored_dtype(cfg)
    if text_only is False and cfg.vision is None:
        raise ValueError(f"{folder.config}: text_only=False asks for the vision tower, but this is a text-only "
                         "model (config.json has no vision_config); load it with text_only=None or True")
    shard = ExpertShard(*expert_shard, cfg.text.moe.num_experts) if expert_shard is not None else None
    with gc_paused():
        result = _scanned(folder)
        with_vision = has_vision_tensors(cfg, result.tensors) if text_only is None else not text_only
        if text_only is None and cfg.vision is not None and not with_vision:
            print(f"kimik3: {folder.path}: config.json has a vision_config but the shards hold no vision_tower/"
                  "mm_projector tensors; loading the text model", file=sys.stderr)
        entries = _checked_entries(folder, result, cfg, with_vision)
    if offload and cfg.storage.experts != "mxfp4":
        raise ValueError(f"{folder.path}: cpu_offload_gb keeps routed experts MXFP4-packed in host memory, but this "
                         "checkpoint stores them dense; convert it first (kimik3 convert ... --experts mxfp4)")
    model = _meta_model(cfg if with_vision else without_vision(cfg), dtype, packed or offload)
    if shard is not None:
        slice_experts(model, shard.rank, shard.world)
        entries = [e for e in entries if shard.reads(e.name)]
    if shard_model is not None:
        shard_model(model)
    tiered = offload and tier_by_budget(model, cfg.text, device, cpu_offload_gb, expert_misses, offload_reserve_bytes,
                                        shard.count if shard is not None else None)
    allocate(model, device)
    _fill(model, folder.path, entries, device, quiet, shard.start if shard is not None else 0, slice_of)
    if tiered:
        fill_slots(model, expert_trace)
    setattr(model, LOADED_FROM, folder.path)
    return model


def _keep_packed(keep_experts_packed: bool, experts: str | None) -> bool:
    """keep_experts_packed, or the deprecated `experts="mxfp4"|"dequantize"` it replaces."""
    if not isinstance(keep_experts_packed, bool):
        raise ValueError(f"keep_experts_packed must be True or False, got {keep_experts_packed!r}")
    if experts is None:
        return keep_experts_packed
    if experts not in ("mxfp4", "dequantize"):
        raise ValueError(f"experts must be 'mxfp4' or 'dequantize' (deprecated: use keep_experts_packed=True or "
                         f"False), got {experts!r}")
    warnings.warn("load(experts=...) is deprecated: use keep_experts_packed=True (for 'mxfp4') or False "
                  "(for 'dequantize'); 'experts' now names only how a checkpoint stores them (save, convert)",
                  DeprecationWarning, stacklevel=4)
    return experts == "mxfp4"


def _meta_model(cfg: K3Config, dtype: torch.dtype, keep_experts_packed: bool) -> K3ForConditionalGeneration:
    with torch.device("meta"):
        model = K3ForConditionalGeneration(cfg, dtype)
        if keep_experts_packed:
            pack_experts(model)
    state = model.state_dict(keep_vars=True)
    unfillable = [n for n, _ in model.named_buffers() if n not in state]
    assert not unfillable, (f"non-persistent buffers {unfillable[:3]} are not in the checkpoint and allocate "
                            "leaves them uninitialized: give the loader a way to rebuild them")
    return model


def _parse_device(device: str | torch.device) -> torch.device:
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device must be 'cpu' or 'cuda' (or a torch.device), got {device!r}") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was requested but CUDA is not available")
    return device


def _scanned(folder: Folder) -> Scan:
    """Every shard header of the folder; raises on missing shards or broken headers."""
    result = scan(folder)
    if result.missing_shards:
        raise missing_shards_error(result)
    if result.problems:
        raise ValueError(f"{folder.path}: broken checkpoint:\n  " + "\n  ".join(result.problems[:5]))
    return result


def _checked_entries(folder: Folder, result: Scan, cfg: K3Config, with_vision: bool) -> list[TensorEntry]:
    """The header entries to read, after every check that needs no tensor data; raises on any problem."""
    found = {n: e for n, e in result.tensors.items() if with_vision or not is_vision_key(n)}
    mismatch = compare(expected_specs(cfg, vision=with_vision), found, a_log_heads(cfg))
    if mismatch:
        raise mismatch_error(str(folder.path), mismatch, cfg)
    truncated = [e for e in found.values() if e.end > result.headers[e.file].file_size]
    if truncated:
        shown = "\n".join(f"  {e.name} in {e.file}: needs bytes up to {e.end:,}, the file has "
                          f"{result.headers[e.file].file_size:,}" for e in truncated[:3])
        raise ValueError(f"{folder.path}: {len(truncated)} tensors lie past the end of their shard "
                         f"(truncated download?):\n{shown}")
    return list(found.values())


@torch.no_grad()
def _fill(model: K3ForConditionalGeneration, root: Path, entries: list[TensorEntry], device: torch.device,
          quiet: bool, first_expert: int = 0, slice_of: SliceOf | None = None) -> None:
    """Read every entry (file by file, in file order) into the model's state-dict tensors; per-expert
    tensors of expert e land in row e - first_expert of the stacked (possibly sharded) experts; where
    `slice_of` names a block, only that block is read."""
    state = model.state_dict()
    written = 0
    # MXFP4 halves waiting for their partner: a writer keeps an expert's packed and scale tensors adjacent,
    # so at most a pair split across two shards waits here
    pending: dict[tuple[str, int], dict[str, Tensor]] = {}
    by_file: dict[str, list[TensorEntry]] = {}
    for e in sorted(entries, key=lambda e: (e.file, e.begin)):
        by_file.setdefault(e.file, []).append(e)
    total = sum(e.nbytes for e in entries)
    with progress_bar("loading", total, len(entries), wanted(quiet)) as advance:
        for file, file_entries in by_file.items():
            try:
                with safe_open(root / file, framework="pt", backend="pread") as f:
                    for e in file_entries:
                        block = slice_of(e.name, e.shape) if slice_of is not None else None
                        t = f.get_tensor(e.name) if block is None else f.get_slice(e.name)[block]
                        # a tiered layer's experts stay in host memory: they never visit the device
                        written += _place(state, e.name, t.to(_destination(state, e.name, device)), pending,
                                          first_expert)
                        advance(e.nbytes)
            except SafetensorError as err:
                raise ValueError(f"{root / file}: safetensors could not read it ({err})") from None
    # every element of every tensor was written, so nothing is left as allocate's garbage
    assert not pending and written == sum(t.numel() for t in state.values()), (len(pending), written)


def _destination(state: dict[str, Tensor], name: str, device: torch.device) -> torch.device:
    """Where checkpoint tensor `name` is headed: its model tensor's device (an expert's stacked tensor's)."""
    key = parse_expert_key(name)
    dst = state.get(key.stacked if key is not None else name)
    return dst.device if dst is not None else device


def _place(state: dict[str, Tensor], name: str, t: Tensor, pending: dict[tuple[str, int], dict[str, Tensor]],
           first_expert: int = 0) -> int:
    """Copy checkpoint tensor `name` into its destination; returns the number of elements written."""
    key = parse_expert_key(name)
    if key is not None:
        key = replace(key, expert=key.expert - first_expert)  # the row in this rank's stacked experts
    if key is None:
        dst = state[name]
        if dst.shape != t.shape:  # an A_log stored at another length (`compare` allowed only that): the heads
            n = min(len(dst), len(t))
            dst.zero_()
            dst[:n].copy_(t[:n])
            return dst.numel()
    elif key.part == "weight":  # a dense expert: straight in, or encoded into packed buffers
        base = key.stacked
        if base in state:
            dst = state[base][key.expert]
        else:
            packed, scale = encode(t)
            state[base + "_packed"][key.expert].copy_(packed)
            state[base + "_scale"][key.expert].copy_(scale)
            return packed.numel() + scale.numel()
    elif key.stacked in state:  # MXFP4 kept packed: the bytes as they are
        dst = state[key.stacked][key.expert]
    else:  # MXFP4 to dequantize: needs both halves of this expert's weight
        base = key.stacked.removesuffix("_packed").removesuffix("_scale")
        halves = pending.setdefault((base, key.expert), {})
        halves[key.part] = t
        if len(halves) < 2:
            return 0
        del pending[(base, key.expert)]
        dst = state[base][key.expert]
        t = decode(halves["weight_packed"], halves["weight_scale"], dst.dtype)
    dst.copy_(t)  # casts to the destination's dtype (fp32 islands stay fp32)
    return dst.numel()
