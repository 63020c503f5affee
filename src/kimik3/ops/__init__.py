"""Compute ops: reference PyTorch implementations with room for fused GPU backends."""
