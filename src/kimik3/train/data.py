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

Documents: a text file is one; a `.jsonl` file has one per line, either {"text": ...} or a chat
{"messages": [...], "tools"?, "thinking"?, "thinking_effort"?} encoded by the XTML chat encoder
(`encode_chat_with_mask`, no generation prompt). A chat document trains only its assistant turns' generated ids:
the stream then carries a loss mask beside the tokens (1 = this token is a training label) and `pack_rows` sets
every other label to IGNORE_INDEX, so the loss and its gradient come from assistant tokens alone. Text documents
train every token; the EOS after a chat document is not trained (the turn already ended with <|end_of_msg|>).

Shard set (written by `prepare_shards`, `kimik3 train --prepare`): a folder of `tokens-00000.bin` ... (raw
little-endian uint32 token ids) and `meta.json` {"format": "kimik3-tokens", "eos_id", "num_tokens", "files"},
plus `mask-00000.bin` ... (uint8, one per token, listed as "mask_files") when any document is a chat.
"""

from __future__ import annotations

import glob
import json
import os
import re
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
    """Documents separated by `eos_id`, concatenated over one or more uint32 arrays (memory-mapped shards), with
    an optional loss mask (uint8 arrays of the same lengths; None: every token is a label)."""

    def __init__(self, parts: Sequence[np.ndarray], eos_id: int, name: str,
                 masks: Sequence[np.ndarray] | None = None):
        self.parts, self.eos_id, self.name = list(parts), int(eos_id), name
        self.masks = None if masks is None else list(masks)
        if self.masks is not None and [len(m) for m in self.masks] != [len(p) for p in self.parts]:
            raise ValueError(f"{name}: the loss mask files do not match the token files in length")
        self.starts = np.cumsum([0] + [len(p) for p in self.parts])
        self.num_tokens = int(self.starts[-1])

    def _read(self, arrays: Sequence[np.ndarray], start: int, length: int) -> np.ndarray:
        out, pos = [], start
        while pos < start + length:
            i = int(np.searchsorted(self.starts, pos, side="right")) - 1
            take = min(start + length, int(self.starts[i + 1])) - pos
            out.append(arrays[i][pos - self.starts[i]:pos - self.starts[i] + take])
            pos += take
        return np.concatenate(out)

    def read(self, start: int, length: int) -> np.ndarray:
        """Tokens [start, start + length) as int64, across shard boundaries."""
        return self._read(self.parts, start, length).astype(np.int64)

    def read_mask(self, start: int, length: int) -> np.ndarray | None:
        """The loss mask of tokens [start, start + length) as bool, or None when every token is a label."""
        return None if self.masks is None else self._read(self.masks, start, length).astype(bool)


def _expand(patterns: Iterable[str], key: str) -> list[Path]:
    paths: list[Path] = []
    for pat in patterns:
        hits = sorted(glob.glob(pat, recursive=True)) if glob.has_magic(pat) else [pat]
        if not hits or not Path(hits[0]).exists():
            raise FileNotFoundError(f"{key}: no file or folder matches '{pat}' (relative paths are taken from the "
                                    f"current directory {os.getcwd()})")
        paths.extend(Path(h) for h in hits)
    return paths


CHAT_KEYS = ("messages", "tools", "thinking", "thinking_effort")


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text (byte {e.start} is 0x{e.object[e.start]:02x}); training data is "
                         "text files (.txt, .jsonl), a shard folder or .bin token files") from None


def _documents(path: Path) -> Iterable[str | dict]:
    """A text file is one document; a .jsonl line is one: its "text" (a str) or a chat record (a dict)."""
    if path.suffix != ".jsonl":
        yield _read_text(path)
        return
    for n, line in enumerate(_read_text(path).splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not valid JSON ({e.msg}, column {e.colno})") from None
        if isinstance(record, dict) and "messages" not in record and isinstance(record.get("text"), str):
            yield record["text"]  # other keys of a text line (ids, sources) are metadata, as before
        elif isinstance(record, dict) and isinstance(record.get("messages"), list):
            unknown = [k for k in record if k not in CHAT_KEYS]
            if unknown:
                raise ValueError(f"{path}:{n}: unknown key '{unknown[0]}' in a chat line (known: "
                                 f"{', '.join(CHAT_KEYS)})")
            yield {**record, "where": f"{path}:{n}"}
        else:
            raise ValueError(f"{path}:{n}: expected a JSON object with a \"text\" string or a \"messages\" list")


def _encode_chat(tokenizer, record: dict) -> tuple[list[int], list[bool]]:
    from kimik3.tokenizer import encode_chat_with_mask

    options = {k: record[k] for k in ("tools", "thinking", "thinking_effort") if k in record}
    if not isinstance(options.get("thinking", True), bool):
        raise ValueError(f"{record['where']}: \"thinking\" must be true or false, got {options['thinking']!r}")
    try:
        ids, mask = encode_chat_with_mask(tokenizer, record["messages"], add_generation_prompt=False, **options)
    except (ValueError, TypeError, KeyError) as e:
        raise ValueError(f"{record['where']}: {e}") from None
    if not any(mask):
        raise ValueError(f"{record['where']}: the conversation has no assistant turn to train on")
    return ids, mask


def load_tokenizer(path: str | None, key: str):
    from kimik3.tokenizer import Tokenizer

    if path is None:
        raise ValueError(f"{key}: text files need a tokenizer: set data.tokenizer to a tiktoken.model file or a "
                         "checkpoint folder holding one")
    if not Path(path).exists():
        raise FileNotFoundError(f"data.tokenizer: no tokenizer file or folder at '{path}'")
    return Tokenizer.from_file(path)


def tokenize_files(files: Sequence[Path], tokenizer, eos_id: int) -> tuple[np.ndarray, np.ndarray | None]:
    """Every document's ids followed by `eos_id`, as one uint32 array, and the loss mask (uint8; None when no
    document is a chat, i.e. every token is a label)."""
    ids: list[int] = []
    mask: list[bool] = []
    chat = False
    for f in files:
        for doc in _documents(f):
            if isinstance(doc, str):
                doc_ids = tokenizer.encode(doc) + [eos_id]
                doc_mask = [True] * len(doc_ids)
            else:
                doc_ids, doc_mask = _encode_chat(tokenizer, doc)
                doc_ids, doc_mask, chat = doc_ids + [eos_id], doc_mask + [False], True
            ids += doc_ids
            mask += doc_mask
    return np.asarray(ids, dtype=np.uint32), (np.asarray(mask, dtype=np.uint8) if chat else None)


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
        mask_bins = [folders[0] / f for f in meta["mask_files"]] if meta.get("mask_files") else None
        eos_id = meta["eos_id"] if eos_id is None else eos_id
    else:
        mask_bins = None
    if bins:
        if eos_id is None:
            raise ValueError(f"{key}: .bin files without a {META} need data.eos_id (the document separator)")
        for b in bins:
            if not b.is_file():
                raise FileNotFoundError(f"{key}: missing shard {b}")
            if b.stat().st_size % 4:
                raise ValueError(f"{b}: size {b.stat().st_size} is not a multiple of 4 (uint32 token ids)")
        parts = [np.memmap(b, dtype="<u4", mode="r") if b.stat().st_size else np.zeros(0, np.uint32) for b in bins]
        masks = None
        if mask_bins is not None:
            for b in mask_bins:
                if not b.is_file():
                    raise FileNotFoundError(f"{key}: missing loss mask shard {b}")
            masks = [np.memmap(b, dtype="u1", mode="r") if b.stat().st_size else np.zeros(0, np.uint8)
                     for b in mask_bins]
        return TokenStream(parts, eos_id, key, masks)
    tok = load_tokenizer(tokenizer, key)
    eos = tok.encode_special("[EOS]") if eos_id is None else eos_id
    ids, mask = tokenize_files(paths, tok, eos)
    return TokenStream([ids], eos, key, None if mask is None else [mask])


_SHARD_FILE = re.compile(r"^(tokens|mask)-\d{5}\.bin$")


def prepare_shards(files: Sequence[str], tokenizer: str, out_dir: str | Path, shard_tokens: int = 1 << 28,
                   eos_id: int | None = None) -> Path:
    """Tokenize text files into a shard folder (`tokens-NNNNN.bin` uint32 + meta.json). Returns the folder."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():  # before the tokenizing, which can take long
        raise ValueError(f"--prepare {out}: is a file; name a new folder (or an existing shard folder)")
    tok = load_tokenizer(tokenizer, "--tokenizer")
    eos = tok.encode_special("[EOS]") if eos_id is None else eos_id
    ids, mask = tokenize_files(_expand(files, "prepare"), tok, eos)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"--prepare {out}: cannot create the folder ({e.strerror or e})") from None
    names, mask_names = [], []
    for i, start in enumerate(range(0, max(len(ids), 1), shard_tokens)):
        names.append(f"tokens-{i:05d}.bin")
        ids[start:start + shard_tokens].astype("<u4").tofile(out / names[-1])
        if mask is not None:
            mask_names.append(f"mask-{i:05d}.bin")
            mask[start:start + shard_tokens].tofile(out / mask_names[-1])
    meta = {"format": FORMAT, "eos_id": int(eos), "num_tokens": int(len(ids)), "files": names,
            "tokenizer": str(tokenizer), "vocab_size": tok.vocab_size}
    if mask is not None:
        meta["mask_files"] = mask_names
    (out / META).write_text(json.dumps(meta, indent=2) + "\n")
    for stale in out.iterdir():  # shards of an earlier, longer preparation into the same folder
        if _SHARD_FILE.match(stale.name) and stale.name not in names and stale.name not in mask_names:
            stale.unlink()
    return out


def pack_rows(rows_RT1: np.ndarray, eos_id: int, mask_RT1: np.ndarray | None = None) -> MicroBatch:
    """R rows of T+1 tokens -> one packed MicroBatch of R*T tokens with document and row boundaries.

    `mask_RT1` (bool, like the rows): which tokens are training labels; None: all of them.
    """
    R, T1 = rows_RT1.shape
    T = T1 - 1
    inputs, labels = rows_RT1[:, :-1].copy(), rows_RT1[:, 1:].copy()
    labels[inputs == eos_id] = IGNORE_INDEX  # the next document's first token is not predictable from this one
    if mask_RT1 is not None:
        labels[~mask_RT1[:, 1:]] = IGNORE_INDEX  # chat documents: only assistant tokens are targets
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

    def _index(self, position: int) -> int:
        epoch, i = divmod(position, self.num_rows)
        if self.shuffle:
            if self._perm is None or self._perm[0] != epoch:
                self._perm = (epoch, np.random.default_rng([self.seed, epoch]).permutation(self.num_rows))
            i = int(self._perm[1][i])
        return i

    def row_mask(self, position: int) -> np.ndarray | None:
        """The loss mask (bool [T+1]) of `row(position)`, or None when every token is a label."""
        return self.stream.read_mask(self._index(position) * self.seq_len, self.seq_len + 1)

    def row(self, position: int) -> np.ndarray:
        i = self._index(position)
        out = self.stream.read(i * self.seq_len, self.seq_len + 1)
        if out.max() >= self.vocab_size:
            raise ValueError(f"{self.stream.name}: token id {int(out.max())} >= the model's vocab_size "
                             f"{self.vocab_size} (row {i}); was the data tokenized for another model?")
        return out

    def micro_batches(self, first: int, count: int, rows: int) -> list[MicroBatch]:
        """`count` micro-batches of `rows` rows each, from global position `first` on."""
        out = []
        for m in range(count):
            positions = [first + m * rows + j for j in range(rows)]
            masks = None if self.stream.masks is None else np.stack([self.row_mask(p) for p in positions])
            out.append(pack_rows(np.stack([self.row(p) for p in positions]), self.stream.eos_id, masks))
        return out


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
