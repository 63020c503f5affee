"""Checkpoint I/O in the released layout: key map, streaming loader, writer, inspector."""

from kimik3.checkpoint.inspect import InspectReport, inspect_checkpoint
from kimik3.checkpoint.loader import load, vision_by_default
from kimik3.checkpoint.writer import save

__all__ = ["InspectReport", "inspect_checkpoint", "load", "save", "vision_by_default"]
