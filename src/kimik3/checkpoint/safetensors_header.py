"""The safetensors file format, header side only: parse and build headers without touching tensor data.

    bytes [0, 8)        N, the header length, little-endian uint64
    bytes [8, 8+N)      UTF-8 JSON, padded with spaces (writers pad so the data starts 8-byte aligned):
                        {"__metadata__": {str: str},                                   (optional)
                         name: {"dtype": "BF16", "shape": [d0, d1, ...], "data_offsets": [begin, end]}, ...}
    bytes [8+N, ...)    tensor data, C-contiguous little-endian, `data_offsets` relative to byte 8+N

`read_header` never reads past the header, so it is safe on any file (a pickle is never unpickled, a
huge or sparse shard costs one small read) and catches truncated shards by comparing offsets with the
file size. `read_tensors` reads a small file whole (an adapter, a drafter) after that check.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch

# safetensors dtype names <-> torch dtypes (the format's full list that torch can hold)
DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "U16": torch.uint16, "I16": torch.int16,
    "U32": torch.uint32, "I32": torch.int32, "U64": torch.uint64, "I64": torch.int64,
    "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}
MAX_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors library's own limit; K3's largest header is ~1 MB
ALIGN = 8


class TensorEntry(NamedTuple):
    """One tensor as its shard's header describes it; `begin`/`end` are absolute byte offsets in the file.

    A NamedTuple, not a dataclass: the released checkpoint has 497,220 of them and they are made in a loop.
    """

    name: str
    file: str  # the shard's file name
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class ShardHeader:
    path: Path
    file_size: int
    data_start: int  # 8 + N
    tensors: dict[str, TensorEntry]
    metadata: dict

    def truncated(self) -> list[TensorEntry]:
        """Entries whose data lies (partly) past the end of the file."""
        return [e for e in self.tensors.values() if e.end > self.file_size]


def _not_safetensors(path: Path, why: str, first: bytes) -> ValueError:
    hint = ""
    if first.startswith(b"PK\x03\x04") or first[:1] == b"\x80":
        hint = " It looks like a torch.save zip/pickle archive; kimik3 never unpickles files."
    return ValueError(f"{path}: not a safetensors file: {why}.{hint}")


def read_header(path: str | Path) -> ShardHeader:
    """Parse the header of one safetensors file (reads 8 + N bytes, never the tensor data).

    Raises:
        FileNotFoundError: no such file.
        ValueError: too short, header length beyond the file, header not JSON, or an entry with an unknown
            dtype, a malformed shape/offsets, or offsets whose byte span disagrees with shape x dtype.
            Data past the end of the file is NOT an error here: see `ShardHeader.truncated`.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such shard file")
    size = path.stat().st_size
    with open(path, "rb") as f:
        first = f.read(8)
        if len(first) < 8:
            raise _not_safetensors(path, f"only {size} bytes, less than the 8-byte header length", first)
        (n,) = struct.unpack("<Q", first)
        if n > size - 8 or n > MAX_HEADER_BYTES:
            raise _not_safetensors(path, f"header length {n:,} exceeds the file ({size:,} bytes)", first)
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _not_safetensors(path, f"the header is not valid JSON ({e})", first) from None
    if not isinstance(header, dict):
        raise _not_safetensors(path, "the header is not a JSON object", first)
    metadata = header.pop("__metadata__", None) or {}
    file, start = path.name, 8 + n
    tensors = {name: _entry(path, file, name, info, start) for name, info in header.items()}
    return ShardHeader(path, size, start, tensors, metadata)


def _entry(path: Path, file: str, name: str, info, data_start: int) -> TensorEntry:
    try:
        dtype, shape, (begin, end) = DTYPES[info["dtype"]], info["shape"], info["data_offsets"]
        valid = (type(shape) is list and all(type(d) is int and d >= 0 for d in shape)
                 and type(begin) is int and type(end) is int and 0 <= begin <= end)
    except (KeyError, TypeError, ValueError):  # not an object, unknown dtype, offsets not a pair
        valid = False
    if not valid:
        raise ValueError(f"{path}: corrupt header entry for tensor '{name}': expected "
                         f"{{\"dtype\": one of {', '.join(DTYPES)}, \"shape\": [non-negative ints], "
                         f"\"data_offsets\": [begin, end] with 0 <= begin <= end}}, got {info!r:.200}")
    if end - begin != math.prod(shape) * dtype.itemsize:
        raise ValueError(f"{path}: corrupt header entry for tensor '{name}': data_offsets span {end - begin:,} "
                         f"bytes but {info['dtype']} {shape} needs {math.prod(shape) * dtype.itemsize:,}")
    return TensorEntry(name, file, dtype, tuple(shape), data_start + begin, data_start + end)


def encode_header(tensors: list[tuple[str, torch.dtype, tuple[int, ...]]], metadata: dict[str, str] | None = None
                  ) -> tuple[bytes, list[int]]:
    """Header bytes (length prefix included) for tensors laid out back to back in the given order.

    Returns:
        (header, sizes): write `header`, then each tensor's `sizes[i]` bytes in order; the data section
        starts 8-byte aligned (the JSON is space-padded).
    """
    header: dict = {"__metadata__": dict(metadata)} if metadata else {}
    sizes, offset = [], 0
    for name, dtype, shape in tensors:
        if dtype not in NAMES:
            raise ValueError(f"tensor '{name}': dtype {dtype} has no safetensors name")
        nbytes = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        sizes.append(nbytes)
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-(8 + len(raw)) % ALIGN)
    return struct.pack("<Q", len(raw)) + raw, sizes


def complete_header(path: str | Path) -> ShardHeader:
    """`read_header`, and a file whose tensors do not all lie within it is a ValueError naming it."""
    header = read_header(path)
    cut = header.truncated()
    if cut:
        raise ValueError(f"{path}: truncated: {len(cut):,} of {len(header.tensors):,} tensors lie past its end "
                         f"(the file is {header.file_size:,} bytes, its header needs {max(e.end for e in cut):,}); "
                         "copy or download it again")
    return header


def read_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a small safetensors file (a LoRA adapter, a drafter) on the CPU, the header checked first:
    a missing, foreign, corrupt or truncated file is one FileNotFoundError / ValueError naming it, as a base
    shard's is (the safetensors library's own error is a bare `incomplete metadata`)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    complete_header(path)
    try:
        return load_file(str(path))
    except SafetensorError as e:
        raise ValueError(f"{path}: not a readable safetensors file ({e})") from None
