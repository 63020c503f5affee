"""Tensor parallelism for inference: attention heads and MLP widths split over the ranks of a process group.

Legend: W ranks, r this rank, D hidden, H heads, K = V KDA head dim, P = H*K, Wc KDA conv window,
N/R/V MLA nope/shared-key/value head dims, Q/C MLA query/kv latent ranks, F dense MLP or shared-expert width.

`apply_tensor_parallel(model, group)` rebuilds, in every decoder layer, the attention module (from a per-rank
config with H/W heads) and the dense MLP / shared expert (F/W wide), and copies this rank's slices of the weights
in; the modules' own forward code runs unchanged on the shards. Rank r owns heads [r*H/W, (r+1)*H/W), i.e. the
contiguous rows r*P/W .. (r+1)*P/W - 1 of every head-major projection (channel = head*K + d).
Per-rank shapes (parameter names and state_dict keys are unchanged):

    KDA  q/k/v/g_proj, f_b_proj  [P, D], [P, K] -> [P/W, D], [P/W, K]     (column parallel: output rows)
         q/k/v_conv1d [P, 1, Wc] -> [P/W, 1, Wc];  dt_bias [P] -> [P/W];  b_proj [H, D] -> [H/W, D]
         A_log [a_log_size] -> [H/W]   this rank's heads of A_log[:H]; the stored padding tail is dropped
         f_a_proj [K, D], o_norm [K]   replicated (the norm is per head, over K)
         o_proj [D, P] -> [D, P/W]     row parallel, output summed over ranks
    MLA  q_b_proj [H*(N+R), Q] -> [H/W*(N+R), Q];  kv_b_proj [H*(N+V), C] -> [H/W*(N+V), C];  g_proj [H*V, D] -> /W
         q_a_proj, q_a_layernorm, kv_a_proj_with_mqa, kv_a_layernorm   replicated
         o_proj [D, H*V] -> [D, H*V/W]  row parallel, output summed over ranks
    MLP  gate_proj, up_proj [F, D] -> [F/W, D];  down_proj [D, F] -> [D, F/W] row parallel, summed
         (layer 0's dense MLP and every MoE layer's shared expert)
    Cache  KDA recurrent [B, H/W, K, V], conv tails [B, Wc-1, P/W];  MLA latent [B, S, C+R] replicated: the
           latent is shared by all heads (one kv_a projection), so every rank caches all of it and its absorbed
           decode up-projects it through only its own heads' kv_b rows
Replicated: embeddings, every RMSNorm, AttnRes, the router, routed experts and their latent projections (expert
parallelism is `expert_parallel.py`), and the LM head. Two all-reduces per layer (attention out, FFN out).

Inference only: the all-reduce is an in-place collective with no backward, so a forward that records autograd
raises instead of returning gradients that would be silently wrong.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor, nn

from kimik3.checkpoint.loader import load_sharded
from kimik3.config import TextConfig
from kimik3.distributed.env import group_rank
from kimik3.model.kda import KimiDeltaAttention
from kimik3.model.mla import MultiHeadLatentAttention
from kimik3.model.mlp import MLP
from kimik3.model.model import K3ForCausalLM, K3ForConditionalGeneration
from kimik3.model.moe import LatentMoE

# parameter -> the dim cut into W equal blocks: 0 = output rows (heads / channels), 1 = input columns.
# One table for both attention kinds: the names they share (g_proj, o_proj) are cut the same way.
_ATTN_SPLITS = {"q_proj.weight": 0, "k_proj.weight": 0, "v_proj.weight": 0, "g_proj.weight": 0,
                "f_b_proj.weight": 0, "b_proj.weight": 0, "q_conv1d.weight": 0, "k_conv1d.weight": 0,
                "v_conv1d.weight": 0, "dt_bias": 0, "o_proj.weight": 1,
                "q_b_proj.weight": 0, "kv_b_proj.weight": 0}
_MLP_SPLITS = {"gate_proj.weight": 0, "up_proj.weight": 0, "down_proj.weight": 1}
_KEY = re.compile(r"(?:^|\.)model\.layers\.\d+\.(self_attn|mlp|block_sparse_moe\.shared_experts)\.(.+)$")


@dataclass(frozen=True)
class TensorParallel:
    """What `apply_tensor_parallel` did, kept on the K3ForCausalLM as `.tensor_parallel`.

    `config` is the per-rank text config: KDA and MLA head counts divided by W (A_log length H/W), all else
    the model's. The rebuilt attention modules and `new_cache` are built from it; `model.config` keeps
    describing the whole (checkpoint) model.
    """

    rank: int
    world_size: int
    config: TextConfig


def rank_config(cfg: TextConfig, world_size: int) -> TextConfig:
    """The per-rank text config for `world_size` ranks; ValueError naming the field that does not divide."""
    if world_size < 1:
        raise ValueError(f"tensor parallelism needs world_size >= 1, got {world_size}")
    sizes = [("linear_attn_config.num_heads", cfg.kda.num_heads), ("num_attention_heads", cfg.mla.num_heads)]
    if not all(cfg.moe_layers):
        sizes.append(("intermediate_size", cfg.intermediate_size))
    if any(cfg.moe_layers):
        sizes.append(("num_shared_experts * moe_intermediate_size", cfg.moe.shared_dim))
    for name, size in sizes:
        if size % world_size:
            raise ValueError(f"tensor parallelism over {world_size} ranks needs {name} ({size}) divisible by "
                             f"{world_size}")
    heads = cfg.kda.num_heads // world_size
    return replace(cfg, kda=replace(cfg.kda, num_heads=heads, a_log_size=heads),
                   mla=replace(cfg.mla, num_heads=cfg.mla.num_heads // world_size))


def _block(name: str, shape: tuple[int, ...], splits: dict[str, int], kda_heads: int, rank: int,
           world_size: int) -> tuple[slice, ...] | None:
    """Rank `rank`'s contiguous block of module tensor `name` as index slices; None where it is replicated."""
    if name == "A_log":  # stored longer than H: split the used A_log[:H], drop the padding tail
        n = kda_heads // world_size
        return (slice(rank * n, (rank + 1) * n),)
    if name not in splits:
        return None
    dim, n = splits[name], shape[splits[name]] // world_size
    return (slice(None),) * dim + (slice(rank * n, (rank + 1) * n),)


def _slice(name: str, t: Tensor, splits: dict[str, int], kda_heads: int, rank: int, world_size: int) -> Tensor:
    """Rank `rank`'s block of the module tensor `name` (replicated tensors are returned as they are)."""
    return _cut(t, _block(name, tuple(t.shape), splits, kda_heads, rank, world_size))


def _cut(t: Tensor, block: tuple[slice, ...] | None) -> Tensor:
    """`t`'s block, copied (the full tensor's storage can then be freed); `t` itself where block is None."""
    return t if block is None else t[block].clone()


def tensor_block(key: str, shape: tuple[int, ...], cfg: TextConfig, rank: int, world_size: int
                 ) -> tuple[slice, ...] | None:
    """The index slices of rank `rank`'s block of one full-model tensor (state_dict / checkpoint key, any
    prefix such as `language_model.`), or None where the tensor stays replicated. `cfg`: the full text config."""
    m = _KEY.search(key)
    if m is None:
        return None
    part, name = m.groups()
    return _block(name, shape, _ATTN_SPLITS if part == "self_attn" else _MLP_SPLITS, cfg.kda.num_heads, rank,
                  world_size)


def shard_tensor(key: str, tensor: Tensor, cfg: TextConfig, rank: int, world_size: int) -> Tensor:
    """Rank `rank`'s slice of one full-model tensor (`tensor_block` applied); replicated ones come back as they
    are. The slices of a full state_dict are exactly the state_dict of the model `shard_for_rank` makes."""
    return _cut(tensor, tensor_block(key, tuple(tensor.shape), cfg, rank, world_size))


def _rebuild(old: nn.Module, build: Callable[[], nn.Module], splits: dict[str, int], kda_heads: int, rank: int,
             world_size: int) -> nn.Module:
    """A module from `build()` holding rank `rank`'s blocks of `old`'s tensors."""
    sd = {k: _slice(k, t, splits, kda_heads, rank, world_size) for k, t in old.state_dict().items()}
    with torch.device("meta"):  # shapes only; the tensors are assigned below
        new = build()
    new.load_state_dict(sd, assign=True)
    return new.train(old.training)


def _shard_attention(old: nn.Module, cfg: TextConfig, rank: int, world_size: int) -> nn.Module:
    """The KDA or MLA module of `old`'s kind built from the per-rank `cfg`, with this rank's heads."""
    kind = KimiDeltaAttention if isinstance(old, KimiDeltaAttention) else MultiHeadLatentAttention
    dtype = old.o_proj.weight.dtype
    heads = cfg.kda.num_heads * world_size  # the full model's H: A_log[:H] is what gets split
    return _rebuild(old, lambda: kind(cfg, dtype), _ATTN_SPLITS, heads, rank, world_size)


def _shard_mlp(old: MLP, rank: int, world_size: int) -> MLP:
    F, D = old.gate_proj.weight.shape
    dtype = old.gate_proj.weight.dtype
    build = lambda: MLP(D, F // world_size, old.beta, old.linear_beta, dtype)  # noqa: E731
    return _rebuild(old, build, _MLP_SPLITS, 0, rank, world_size)


def _sum_hook(reduce: Callable[[Tensor], object]):
    """Forward hook of a row-parallel linear: its [..., D] output is this rank's partial sum; add the others'."""

    def hook(module: nn.Module, args, out: Tensor) -> Tensor:
        if out.requires_grad:
            raise RuntimeError("tensor parallelism is inference-only: run the model under torch.no_grad() or "
                               "torch.inference_mode()")
        reduce(out)
        return out

    return hook


def _causal_lm(model: nn.Module) -> K3ForCausalLM:
    if isinstance(model, K3ForConditionalGeneration):
        return model.language_model
    if isinstance(model, K3ForCausalLM):
        return model
    raise ValueError(f"tensor parallelism takes a K3ForCausalLM or K3ForConditionalGeneration, got "
                     f"{type(model).__name__}")


def shard_for_rank(model: nn.Module, rank: int, world_size: int,
                   reduce: Callable[[Tensor], object] | None = None) -> nn.Module:
    """Replace `model`'s layers by rank `rank`'s shards (in place; returns `model`). See the module docstring.

    Args:
        model: a K3ForCausalLM or K3ForConditionalGeneration (real or meta tensors: on the meta device only the
            shapes change, for a loader that fills each rank's slices).
        reduce: called in place on the [..., D] output of every row-parallel linear (o_proj, down_proj) to
            sum it over the ranks; None leaves the partial sums (tests, shape planning).

    After it, the rebuilt attention modules declare this rank's state (H/W heads per KDA layer), so
    `model.new_cache` and the engine allocate it.
    """
    lm = _causal_lm(model)
    if hasattr(lm, "tensor_parallel"):
        raise ValueError("the model is already tensor-parallel (apply_tensor_parallel was called twice)")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    cfg = rank_config(lm.config, world_size)
    for layer in lm.model.layers:
        layer.self_attn = _shard_attention(layer.self_attn, cfg, rank, world_size)
        if isinstance(layer.ffn, LatentMoE):
            layer.ffn.shared_experts = _shard_mlp(layer.ffn.shared_experts, rank, world_size)
        else:
            layer.mlp = _shard_mlp(layer.mlp, rank, world_size)
    if reduce is not None:
        _sum_row_parallel_outputs(lm, reduce)
    lm.tensor_parallel = TensorParallel(rank, world_size, cfg)
    return model


def _sum_row_parallel_outputs(lm: K3ForCausalLM, reduce: Callable[[Tensor], object]) -> None:
    for layer in lm.model.layers:
        mlp = layer.ffn.shared_experts if isinstance(layer.ffn, LatentMoE) else layer.mlp
        for linear in (layer.self_attn.o_proj, mlp.down_proj):
            linear.register_forward_hook(_sum_hook(reduce))


def apply_tensor_parallel(model: nn.Module, group: dist.ProcessGroup | None = None) -> nn.Module:
    """Shard `model` over the ranks of `group` (default: all ranks) for inference. In place; returns `model`.

    Every rank must call it on the same full model (same weights); each then holds its heads and MLP slices,
    and the same logits come out on every rank. Call it before moving to CUDA graphs or torch.compile.
    """
    return shard_for_rank(model, *group_rank(group, "apply_tensor_parallel"), _all_reduce(group))


def _all_reduce(group) -> Callable[[Tensor], None]:
    def reduce(t: Tensor) -> None:
        dist.all_reduce(t, group=group)

    return reduce


def load_tensor_parallel(path: str | Path, group: dist.ProcessGroup | None = None, **load_kwargs) -> nn.Module:
    """`kimik3.load` of this rank's tensor-parallel shards only, ready to run (as `apply_tensor_parallel`).

    The model is sharded on the meta device and every split tensor is read as this rank's block through
    safetensors' slices (rows, or columns for the row-parallel o_proj / down_proj), so a rank reads the
    replicated tensors plus 1/W of the split ones. `load_kwargs`: `load`'s (dtype, device, text_only,
    keep_experts_packed, quiet).
    """
    rank, world = group_rank(group, "load_tensor_parallel")
    full: list[TextConfig] = []

    def shard_model(model: nn.Module) -> None:
        full.append(_causal_lm(model).config)
        shard_for_rank(model, rank, world)

    model = load_sharded(path, shard_model=shard_model,
                         slice_of=lambda name, shape: tensor_block(name, shape, full[0], rank, world), **load_kwargs)
    _sum_row_parallel_outputs(_causal_lm(model), _all_reduce(group))
    return model
