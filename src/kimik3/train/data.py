"""Training data: a token stream of documents, cut into fixed-length rows, packed with document boundaries.

Legend: T tokens per row (`seq_len`), R rows per micro-batch, W data-parallel ranks, A accumulation steps.

    stream   = doc_0 EOS doc_1 EOS ...                 uint32 shards (`*.bin`) or text files tokenized in memory
    row i    = stream[i*T : i*T + T + 1]               inputs = row[:-1], labels = row[1:]
    step s   = rows at positions s*G .. (s+1)*G - 1, G = W * A * R   (a seeded permutation per epoch)
    micro-batch (rank w, accumulation a) = positions s*G + (a*W + w)*R + [0, R)
    packed   = R rows flattened to one [1, R*T] row; cu_seqlens cuts after every EOS and at row ends

A document ends at its EOS. No token attends across a cut (the model restarts KDA state, short convs and the
MLA mask at every cu_seqlens boundary), and the label of an EOS position (the next document's first token) is
ignored, so no loss term links two documents. The position in the data is the step count: resuming at step s
reproduces exactly the rows an uninterrupted run would read.

Shard set (written by `prepare_shards`, `kimik3 train --prepare`): a folder of `tokens-00000.bin` ... (raw
little-endian uint32 token ids) and `meta.json` {"format": "kimik3-tokens", "eos_id", "num_tokens", "files"}.
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

IGNORE_INDEX = -100
META = "meta.json"
FORMAT = "kimik3-tokens"


@dataclass
class MicroBatch:
    """One packed row: input_ids / labels [1, N] int64 (labels IGNORE_INDEX where no target), cu_seqlens [D+1]."""

    input_ids: Tensor
    labels: Tensor
    cu_seqlens: Tensor
    num_targets: int

    def to(self, device: torch.device | str) -> MicroBatch:
        return MicroBatch(self.input_ids.to(device), self.labels.to(device), self.cu_seqlens.to(device),
                          self.num_targets)


class TokenStream:
    """Documents separated by `eos_id`, concatenated over one or more uint32 arrays (memory-mapped shards)."""

    def __init__(self, parts: Sequence[np.ndarray], eos_id: int, name: str):
        self.parts, self.eos_id, self.name = list(parts), int(eos_id), name
        self.starts = np.cumsum([0] + [len(p) for p in self.parts])
        self.num_tokens = int(self.starts[-1])

    def read(self, start: int, length: int) -> np.ndarray:
        """Tokens [start, start + length) as int64, across shard boundaries."""
        out, pos = [], start
        while pos < start + length:
            i = int(np.searchsorted(self.starts, pos, side="right")) - 1
            take = min(start + length, int(self.starts[i + 1])) - pos
            out.append(self.parts[i][pos - self.starts[i]:pos - self.starts[i] + take])
            pos += take
        return np.concatenate(out).astype(np.int64)


def _expand(patterns: Iterable[str], key: str) -> list[Path]:
    paths: list[Path] = []
    for pat in patterns:
        hits = sorted(glob.glob(pat, recursive=True)) if glob.has_magic(pat) else [pat]
        if not hits or not Path(hits[0]).exists():
            raise FileNotFoundError(f"{key}: no file or folder matches '{pat}' (relative paths are taken from the "
                                    f"current directory {os.getcwd()})")
        paths.extend(Path(h) for h in hits)
    return paths


def _documents(path: Path) -> Iterable[str]:
    """A text file is one document; a .jsonl file has one document per line, in its "text" field."""
    if path.suffix != ".jsonl":
        yield path.read_text(encoding="utf-8")
        return
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
            try:
                yield json.loads(line)["text"]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise ValueError(f"{path}:{n}: expected a JSON object with a \"text\" field") from None


def load_tokenizer(path: str | None, key: str):
    from kimik3.tokenizer import Tokenizer

    if path is None:
        raise ValueError(f"{key}: text files need a tokenizer: set data.tokenizer to a tiktoken.model file or a "
                         "checkpoint folder holding one")
    if not Path(path).exists():
        raise FileNotFoundError(f"data.tokenizer: no tokenizer file or folder at '{path}'")
    return Tokenizer.from_file(path)


def tokenize_files(files: Sequence[Path], tokenizer, eos_id: int) -> np.ndarray:
    """Every document's ids followed by `eos_id`, as one uint32 array."""
    ids: list[int] = []
    for f in files:
        for doc in _documents(f):
            ids.extend(tokenizer.encode(doc))
            ids.append(eos_id)
    return np.asarray(ids, dtype=np.uint32)


def open_stream(patterns: Sequence[str], key: str, tokenizer: str | None = None, eos_id: int | None = None
                ) -> TokenStream:
    """A shard folder (with meta.json), `.bin` files, or text files (tokenized now) -> TokenStream."""
    paths = _expand(patterns, key)
    folders = [p for p in paths if p.is_dir()]
    bins = [p for p in paths if p.suffix == ".bin"]
    if (folders and len(paths) > 1) or (bins and len(bins) != len(paths)):
        raise ValueError(f"{key}: give one shard folder, or .bin files, or text files; not a mix")
    if folders:
        meta_path = folders[0] / META
        if not meta_path.is_file():
            raise FileNotFoundError(f"{key}: {folders[0]} has no {META}; write shards with `kimik3 train --prepare`")
        meta = json.loads(meta_path.read_text())
        if meta.get("format") != FORMAT:
            raise ValueError(f"{meta_path}: 'format' must be '{FORMAT}', got {meta.get('format')!r}")
        bins = [folders[0] / f for f in meta["files"]]
        eos_id = meta["eos_id"] if eos_id is None else eos_id
    if bins:
        if eos_id is None:
            raise ValueError(f"{key}: .bin files without a {META} need data.eos_id (the document separator)")
        for b in bins:
            if not b.is_file():
                raise FileNotFoundError(f"{key}: missing shard {b}")
            if b.stat().st_size % 4:
                raise ValueError(f"{b}: size {b.stat().st_size} is not a multiple of 4 (uint32 token ids)")
        parts = [np.memmap(b, dtype="<u4", mode="r") if b.stat().st_size else np.zeros(0, np.uint32) for b in bins]
        return TokenStream(parts, eos_id, key)
    tok = load_tokenizer(tokenizer, key)
    eos = tok.encode_special("[EOS]") if eos_id is None else eos_id
    return TokenStream([tokenize_files(paths, tok, eos)], eos, key)


def prepare_shards(files: Sequence[str], tokenizer: str, out_dir: str | Path, shard_tokens: int = 1 << 28,
                   eos_id: int | None = None) -> Path:
    """Tokenize text files into a shard folder (`tokens-NNNNN.bin` uint32 + meta.json). Returns the folder."""
    tok = load_tokenizer(tokenizer, "--tokenizer")
    eos = tok.encode_special("[EOS]") if eos_id is None else eos_id
    ids = tokenize_files(_expand(files, "prepare"), tok, eos)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    names = []
    for i, start in enumerate(range(0, max(len(ids), 1), shard_tokens)):
        names.append(f"tokens-{i:05d}.bin")
        ids[start:start + shard_tokens].astype("<u4").tofile(out / names[-1])
    meta = {"format": FORMAT, "eos_id": int(eos), "num_tokens": int(len(ids)), "files": names,
            "tokenizer": str(tokenizer), "vocab_size": tok.vocab_size}
    (out / META).write_text(json.dumps(meta, indent=2) + "\n")
    return out


def pack_rows(rows_RT1: np.ndarray, eos_id: int) -> MicroBatch:
    """R rows of T+1 tokens -> one packed MicroBatch of R*T tokens with document and row boundaries."""
    R, T1 = rows_RT1.shape
    T = T1 - 1
    inputs, labels = rows_RT1[:, :-1].copy(), rows_RT1[:, 1:].copy()
    labels[inputs == eos_id] = IGNORE_INDEX  # the next document's first token is not predictable from this one
    cuts = {0, R * T} | {r * T for r in range(1, R)}
    cuts |= {int(p) + 1 for p in np.flatnonzero(inputs.reshape(-1) == eos_id)}
    return MicroBatch(torch.from_numpy(inputs.reshape(1, -1)), torch.from_numpy(labels.reshape(1, -1)),
                      torch.tensor(sorted(cuts), dtype=torch.int64), int((labels != IGNORE_INDEX).sum()))


class RowSampler:
    """Fixed-length rows of a TokenStream in a seeded order, addressed by global position (epochs wrap)."""

    def __init__(self, stream: TokenStream, seq_len: int, vocab_size: int, shuffle: bool = True, seed: int = 0):
        self.stream, self.seq_len, self.vocab_size, self.shuffle, self.seed = stream, seq_len, vocab_size, shuffle, seed
        self.num_rows = (stream.num_tokens - 1) // seq_len
        if self.num_rows < 1:
            raise ValueError(f"{stream.name}: {stream.num_tokens} tokens do not fill one row of data.seq_len = "
                             f"{seq_len} (+1 for the last label)")
        self._perm: tuple[int, np.ndarray] | None = None

    def row(self, position: int) -> np.ndarray:
        epoch, i = divmod(position, self.num_rows)
        if self.shuffle:
            if self._perm is None or self._perm[0] != epoch:
                self._perm = (epoch, np.random.default_rng([self.seed, epoch]).permutation(self.num_rows))
            i = int(self._perm[1][i])
        out = self.stream.read(i * self.seq_len, self.seq_len + 1)
        if out.max() >= self.vocab_size:
            raise ValueError(f"{self.stream.name}: token id {int(out.max())} >= the model's vocab_size "
                             f"{self.vocab_size} (row {i}); was the data tokenized for another model?")
        return out

    def micro_batches(self, first: int, count: int, rows: int) -> list[MicroBatch]:
        """`count` micro-batches of `rows` rows each, from global position `first` on."""
        return [pack_rows(np.stack([self.row(first + m * rows + j) for j in range(rows)]), self.stream.eos_id)
                for m in range(count)]


def step_batches(sampler: RowSampler, step: int, rank: int, world: int, accum: int, rows: int) -> list[MicroBatch]:
    """Rank `rank`'s `accum` micro-batches of 0-based optimizer step `step` (see the module docstring)."""
    first = step * world * accum * rows
    return [sampler.micro_batches(first + (a * world + rank) * rows, 1, rows)[0] for a in range(accum)]


def eval_batches(sampler: RowSampler, num_rows: int, rank: int, world: int, rows: int) -> list[MicroBatch]:
    """The first `num_rows` rows (in stream order), rank-strided by micro-batch; every rank gets as many."""
    per = world * rows
    count = min(num_rows, sampler.num_rows) // per
    if count == 0:
        raise ValueError(f"eval: the validation data has {sampler.num_rows} rows of data.seq_len tokens; it needs at "
                         f"least ranks x train.micro_batch_rows = {per}")
    return [sampler.micro_batches(m * per + rank * rows, 1, rows)[0] for m in range(count)]
