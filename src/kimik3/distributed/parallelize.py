"""Transformations of a built K3 model for training: expert parallel, activation checkpointing, FSDP2.

The model's code and module tree are never changed (checkpoint names stay the released ones):
    apply_expert_parallel            routed experts sharded over ranks, tokens sent by all-to-all (expert_parallel.py)
    apply_activation_checkpointing   each DecoderLayer's forward runs under torch.utils.checkpoint (non-reentrant)
    apply_fsdp                       torch.distributed.fsdp.fully_shard on every DecoderLayer, then on the root;
                                     expert-sharded parameters are left out (see apply_fsdp)
FSDP2 works with gloo on CPU in torch 2.13 (tests/train/test_distributed.py runs it with 2 processes), so CPU
and CUDA take the same path. Parameters stay fp32 in FSDP (no MixedPrecisionPolicy): bf16 compute comes from
autocast, which leaves the model's explicit fp32 islands alone, whereas a bf16 param_dtype would also cast the
islands (A_log, dt_bias, conv kernels, o_norm, router weight).
"""

from __future__ import annotations

import warnings

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from kimik3.distributed.expert_parallel import (
    apply_expert_parallel,
    expert_group_size,
    expert_parameters,
    scale_expert_gradients,
)
from kimik3.model.decoder import DecoderLayer


def decoder_layers(model: nn.Module) -> list[DecoderLayer]:
    return [m for m in model.modules() if isinstance(m, DecoderLayer)]


def apply_activation_checkpointing(model: nn.Module) -> nn.Module:
    """Recompute each decoder layer in backward instead of storing its activations. Returns `model`.

    The layer's bound `forward` is replaced on the instance (not wrapped in another module), so parameter
    names, state_dict keys and hooks (FSDP, balancing) are exactly those of the plain model. Non-reentrant
    checkpointing accepts the layer's list-of-tensors input and output and restores autocast on recompute.
    """
    for layer in decoder_layers(model):
        if getattr(layer, "_kimik3_checkpointed", False):
            continue
        inner = layer.forward

        def forward(*args, _inner=inner, **kwargs):
            return checkpoint(_inner, *args, use_reentrant=False, **kwargs)

        layer.forward = forward
        layer._kimik3_checkpointed = True
    return model


def apply_fsdp(model: nn.Module, mesh=None, reshard_after_forward: bool = True) -> nn.Module:
    """FSDP2: shard every DecoderLayer (one all-gather per layer per pass), then the root (embeddings, output
    norm and mix, LM head). `mesh`: a 1-D DeviceMesh (default: all ranks on the current device type).

    Expert-parallel experts (`apply_expert_parallel` first) are already split over the ranks: FSDP ignores them
    (no sharding, no gradient reduction), and their gradients, which already sum every rank's tokens, are
    divided by the mesh size as FSDP's averaging divides the others (derivation: expert_parallel.py).
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if mesh is None:
        device_type = "cuda" if next(model.parameters()).is_cuda else "cpu"
        mesh = init_device_mesh(device_type, (torch.distributed.get_world_size(),))
    ignored = set(expert_parameters(model)) or None
    ep = expert_group_size(model)
    if ep is not None and ep != mesh.size():
        raise ValueError(f"expert parallel over {ep} ranks with FSDP over {mesh.size()}: only EP size == "
                         "data-parallel size is supported (expert replicas would need a gradient all-reduce)")
    # A layer that does not start an AttnRes block returns its `blocks` input unchanged, and FSDP2's pre-forward
    # passes inputs through an autograd Function (RegisterPostBackwardFunction), which makes that output an alias:
    # FSDP2 warns once per layer that an in-place op on it would skip the pre-backward hook. Nothing writes
    # `blocks` in place (each layer extends it with torch.cat, the mixes only read it), so the warning is
    # silenced for the decoder layers alone; any other wrapped module that returns a view still warns.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(FSDPDecoderLayer\) returned a view tensor",
                            category=UserWarning)
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard_after_forward, ignored_params=ignored)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward, ignored_params=ignored)
    if ep is not None:
        scale_expert_gradients(model, 1.0 / mesh.size())
    return model


def parallelize(model: nn.Module, *, activation_checkpointing: bool = False, data_parallel: bool = False,
                mesh=None, expert_parallel: bool = False, expert_group=None) -> nn.Module:
    """The training transformations in their required order (EP, then checkpointing inside FSDP). Returns
    `model`. `expert_group`: the EP process group (default: all ranks)."""
    if expert_parallel:
        apply_expert_parallel(model, expert_group)
    if activation_checkpointing:
        apply_activation_checkpointing(model)
    if data_parallel:
        apply_fsdp(model, mesh)
    return model
