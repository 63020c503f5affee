"""Checkpoint I/O in the released layout: key map, streaming loader, writer, inspector."""

from kimik3.checkpoint.folder import publish_atomically
from kimik3.checkpoint.inspect import InspectReport, inspect_checkpoint
from kimik3.checkpoint.loader import has_vision_tensors, load
from kimik3.checkpoint.writer import save

__all__ = ["InspectReport", "has_vision_tensors", "inspect_checkpoint", "load", "publish_atomically", "save"]
