"""Parallelism as transformations of the unchanged model: FSDP2 data parallel, activation checkpointing,
expert parallelism (all-to-all over the latent MoE) and tensor parallelism (inference)."""

from kimik3.distributed.env import DistEnv, all_reduce, barrier, init_distributed, shutdown
from kimik3.distributed.expert_parallel import apply_expert_parallel, load_expert_parallel
from kimik3.distributed.parallelize import apply_activation_checkpointing, apply_fsdp, parallelize
from kimik3.distributed.tensor_parallel import (
                                                apply_tensor_parallel,
                                                load_tensor_parallel,
                                                shard_for_rank,
                                                shard_tensor,
                                                tensor_block,
)

__all__ = ["DistEnv", "all_reduce", "apply_activation_checkpointing", "apply_expert_parallel", "apply_fsdp",
           "apply_tensor_parallel", "barrier", "init_distributed", "load_expert_parallel", "load_tensor_parallel",
           "parallelize", "shard_for_rank", "shard_tensor", "shutdown", "tensor_block"]
