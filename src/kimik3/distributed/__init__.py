"""Data parallel training (FSDP2) and activation checkpointing as transformations of the unchanged model."""

from kimik3.distributed.env import DistEnv, all_reduce, barrier, init_distributed, shutdown
from kimik3.distributed.parallelize import apply_activation_checkpointing, apply_fsdp, parallelize

__all__ = ["DistEnv", "all_reduce", "apply_activation_checkpointing", "apply_fsdp", "barrier", "init_distributed",
           "parallelize", "shutdown"]
