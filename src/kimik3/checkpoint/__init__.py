"""Checkpoint I/O in the released layout: key map, streaming loader, writer, inspector."""
