"""Inspect a checkpoint folder from its safetensors headers alone: counts, sizes and every difference from
what its config.json implies. No tensor data is read, so the released 1.56 TB checkpoint takes seconds.

Parameters are logical and MXFP4-aware: a `weight_packed` byte holds two parameters, `weight_scale`
bytes none, every other tensor its element count (so the release totals 2,779,931,837,184).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from kimik3.checkpoint.folder import gc_paused, locate, scan
from kimik3.checkpoint.inventory import (
    Mismatch,
    a_log_heads,
    compare,
    difference_lines,
    expected_specs,
    has_vision_tensors,
    padding_note,
)
from kimik3.checkpoint.safetensors_header import NAMES, TensorEntry
from kimik3.config import ExpertFormat, K3Config


def logical_parameters(e: TensorEntry) -> int:
    numel = e.nbytes // e.dtype.itemsize
    if e.name.endswith(".weight_packed"):
        return 2 * numel
    return 0 if e.name.endswith(".weight_scale") else numel


@dataclass
class InspectReport:
    """What `inspect_checkpoint` found. `ok` when there are no problems and no differences."""

    path: str
    shards: int
    tensors: int
    by_dtype: dict[str, int]  # safetensors dtype name -> tensor count
    parameters: int
    tensor_bytes: int  # sum of the headers' data spans
    file_bytes: int  # sum of the shard file sizes (headers included)
    dtype: str  # config.json's dtype
    experts: ExpertFormat  # from config.json's quantization_config
    problems: list[str] = field(default_factory=list)  # missing/corrupt/truncated shards, index disagreements
    mismatch: Mismatch = field(default_factory=Mismatch)
    notes: list[str] = field(default_factory=list)  # what differs from what we write but loads (A_log padding)

    @property
    def ok(self) -> bool:
        return not self.problems and not self.mismatch

    def to_json(self) -> dict:
        def spec(s):
            return {"name": s.name, "shape": list(s.shape), "dtype": str(s.dtype).removeprefix("torch.")}

        def entry(e):
            return {**spec(e), "file": e.file}

        return {
            "path": self.path, "ok": self.ok, "shards": self.shards, "tensors": self.tensors,
            "by_dtype": self.by_dtype, "parameters": self.parameters, "tensor_bytes": self.tensor_bytes,
            "file_bytes": self.file_bytes, "dtype": self.dtype, "experts": self.experts, "problems": self.problems,
            "notes": self.notes,
            "missing": [spec(s) for s in self.mismatch.missing],
            "unexpected": [entry(e) for e in self.mismatch.unexpected],
            "wrong": [{"expected": spec(s), "found": entry(e)} for s, e in self.mismatch.wrong],
        }

    def lines(self, limit: int = 20) -> list[str]:
        """A human-readable summary (at most `limit` lines per kind of difference)."""
        dtypes = ", ".join(f"{k} {v:,}" for k, v in sorted(self.by_dtype.items()))
        m = self.mismatch
        out = [f"{self.path}",
               f"  shards      {self.shards}",
               f"  tensors     {self.tensors:,} ({dtypes})",
               f"  parameters  {self.parameters:,} (logical: an MXFP4 byte holds two, scale bytes none)",
               f"  bytes       {self.tensor_bytes:,} of tensor data, {self.file_bytes:,} in files",
               f"  config      dtype {self.dtype}, routed experts {self.experts}"]
        out += [f"  note        {n}" for n in self.notes]
        if self.ok:
            return out + ["  no differences from config.json"]
        out += [f"  problem     {p}" for p in self.problems[:limit]]
        out.append(f"  differences from config.json: {len(m.missing):,} missing, {len(m.unexpected):,} "
                   f"unexpected, {len(m.wrong):,} wrong shape or dtype")
        return out + difference_lines(m, limit)


def inspect_checkpoint(path: str | Path) -> InspectReport:
    """Read every shard header of the folder at `path` and compare them with its config.json.

    Problems with individual shards are reported, not raised.

    Raises:
        FileNotFoundError: no folder, config.json, or weights index.
        ValueError: config.json or the index is not valid.
    """
    with gc_paused():
        return _inspect(path)


def _inspect(path: str | Path) -> InspectReport:
    folder = locate(path)
    cfg = K3Config.from_file(folder.config)
    result = scan(folder)
    tensors = list(result.tensors.values())
    problems = [f"{folder.path / s}: missing (named by {folder.index.name})" for s in result.missing_shards]
    problems += result.problems
    for header in result.headers.values():
        cut = header.truncated()
        if cut:
            problems.append(f"{header.path}: truncated: {len(cut):,} tensors lie past its end "
                            f"({header.file_size:,} bytes; e.g. '{cut[0].name}' needs up to {cut[0].end:,})")
    vision = has_vision_tensors(cfg, result.tensors)  # what `load` does with text_only=None
    mismatch = compare(expected_specs(cfg, vision=vision), result.tensors, a_log_heads(cfg))
    notes = [n for n in [padding_note(mismatch)] if n]
    if cfg.vision is not None and not vision:
        notes.append("config.json has a vision_config but the shards hold no vision_tower/mm_projector tensors: "
                     "a text model")
    return InspectReport(
        path=str(folder.path),
        shards=len(folder.shards),
        tensors=len(tensors),
        by_dtype=dict(Counter(NAMES[e.dtype] for e in tensors)),
        parameters=sum(logical_parameters(e) for e in tensors),
        tensor_bytes=sum(e.nbytes for e in tensors),
        file_bytes=sum(h.file_size for h in result.headers.values()),
        dtype=cfg.storage.dtype,
        experts=cfg.storage.experts,
        problems=problems,
        mismatch=mismatch,
        notes=notes,
    )
