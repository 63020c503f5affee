"""A checkpoint folder on disk: find its files and read every shard's header (never tensor data).

    config.json                              K3Config.from_file
    model.safetensors.index.json             {"metadata": {"total_size": bytes}, "weight_map": {tensor: shard}}
    model-00001-of-000096.safetensors ...    the shards (or one `model.safetensors` and no index)

`scan` collects every problem instead of stopping at the first, so the inspector can report them all and
the loader can raise one error that lists them.
"""

from __future__ import annotations

import gc
import json
import os
import re
import shutil
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from kimik3.checkpoint.safetensors_header import ShardHeader, TensorEntry, read_header

CONFIG = "config.json"
GENERATION_CONFIG = "generation_config.json"
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
# the attribute `kimik3.load` sets on a model: the folder it came from (where `save` finds the tokenizer,
# model card and generation_config.json to copy)
LOADED_FROM = "loaded_from"


@dataclass
class Folder:
    """The files of a checkpoint folder, before any shard is opened."""

    path: Path
    config: Path
    index: Path | None  # None for a single `model.safetensors`
    shards: list[str]  # file names, in order
    weight_map: dict[str, str] | None  # the index's tensor -> shard map


@dataclass
class Scan:
    """Every shard header of a folder and what is wrong with the set (as readable messages)."""

    folder: Folder
    headers: dict[str, ShardHeader]  # shard file name -> header (readable shards only)
    tensors: dict[str, TensorEntry]  # tensor name -> where it is
    missing_shards: list[str] = field(default_factory=list)  # listed by the index, absent on disk
    problems: list[str] = field(default_factory=list)  # corrupt headers, index disagreements, duplicates

    @property
    def ok(self) -> bool:
        return not self.missing_shards and not self.problems


@contextmanager
def gc_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector while the headers are parsed and compared.

    The released headers hold 497,220 entries: parsing them allocates millions of dicts and lists (none in
    cycles), and every automatic collection re-traverses all of them, which made the inspection ~3x slower.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def locate(path: str | Path) -> Folder:
    """Find config, index and shards of the checkpoint folder at `path`.

    Raises:
        FileNotFoundError: the folder, its config.json, or any weights file is missing.
        ValueError: `path` is a file, or the index is not valid JSON / lacks a weight_map.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"checkpoint folder {path} does not exist")
    if not path.is_dir():
        raise ValueError(f"{path}: expected a checkpoint folder (config.json + safetensors shards), got a file")
    config = path / CONFIG
    if not config.is_file():
        raise FileNotFoundError(f"{path}: no {CONFIG} (a checkpoint folder holds {CONFIG}, {INDEX} and the "
                                "shards it names)")
    index = path / INDEX
    if not index.is_file():
        if (path / SINGLE).is_file():
            return Folder(path, config, None, [SINGLE], None)
        raise FileNotFoundError(f"{path}: no weights: expected {INDEX} (sharded) or {SINGLE}")
    try:
        data = json.loads(index.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{index}: not valid JSON ({e})") from None
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ValueError(f"{index}: expected an object with a 'weight_map' of tensor name -> shard file name")
    shards = sorted(set(weight_map.values()))
    escaping = [s for s in shards if Path(s).name != s]
    if escaping:
        raise ValueError(f"{index}: shard names must be plain file names in the folder, got {escaping[:3]}")
    return Folder(path, config, index, shards, weight_map)


def scan(folder: Folder) -> Scan:
    """Read every shard header and check them against each other and the index."""
    result = Scan(folder, {}, {})
    for shard in folder.shards:
        try:
            result.headers[shard] = read_header(folder.path / shard)
        except FileNotFoundError:
            result.missing_shards.append(shard)
        except ValueError as e:
            result.problems.append(str(e))
    for shard, header in result.headers.items():
        for name, entry in header.tensors.items():
            if name in result.tensors:
                result.problems.append(f"tensor '{name}' is in both {result.tensors[name].file} and {shard}")
            else:
                result.tensors[name] = entry
    if folder.weight_map is not None:
        result.problems += _index_disagreements(folder, result)
    return result


def _index_disagreements(folder: Folder, result: Scan, limit: int = 3) -> list[str]:
    wm = folder.weight_map
    # tensors the index places in a readable shard that does not hold them
    absent = [(n, s) for n, s in wm.items() if s in result.headers and n not in result.headers[s].tensors]
    # tensors a shard holds that the index does not place there
    unlisted = [(n, e.file) for n, e in result.tensors.items() if wm.get(n) != e.file]
    out = []
    if absent:
        shown = ", ".join(f"'{n}' -> {s}" for n, s in absent[:limit])
        out.append(f"{folder.index}: {len(absent)} tensors are not in the shard the index names ({shown})")
    if unlisted:
        shown = ", ".join(f"'{n}' in {s} (index: {wm.get(n)})" for n, s in unlisted[:limit])
        out.append(f"{folder.index}: {len(unlisted)} tensors are in a shard the index does not name for them "
                   f"({shown})")
    return out


def missing_shards_error(result: Scan) -> FileNotFoundError:
    """One error naming the index, the missing shards and a tensor each should hold."""
    wm = result.folder.weight_map or {}
    lines = []
    for shard in result.missing_shards[:5]:
        names = [n for n, s in wm.items() if s == shard]
        lines.append(f"  {result.folder.path / shard} (should hold {len(names)} tensors, e.g. '{names[0]}')")
    more = f"\n  ... and {len(result.missing_shards) - 5} more" if len(result.missing_shards) > 5 else ""
    return FileNotFoundError(f"{result.folder.index}: names {len(result.missing_shards)} shard file(s) that do "
                             "not exist:\n" + "\n".join(lines) + more)


def fsync_dir(path: Path) -> None:
    """Make a folder's entries (new files, renames) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish_atomically(path: str | Path, write: Callable[[Path], object],
                       carry_over: Callable[[str], bool] = lambda name: False) -> Path:
    """Create folder `path` by `write(tmp)` into a hidden sibling, then rename it into place.

    The folder appears only when complete: `write` fills `.NAME.partial-<id>` (and fsyncs its files), every
    folder in it and the parent are fsynced around the rename. An existing folder at `path` is moved aside to
    `.NAME.old-<id>` first; entries of it that the new folder lacks and `carry_over(name)` accepts are moved
    into the new one (so a checkpoint rewritten in place keeps the user's other files); the rest of the old
    folder is deleted last. A crash leaves at most those hidden siblings, never a half-written folder at
    `path`; an exception from `write` removes the partial folder and re-raises.

    Returns:
        `path`.
    """
    path = Path(path)
    tmp = path.parent / f".{path.name}.partial-{uuid.uuid4().hex[:8]}"
    tmp.mkdir(parents=True)
    try:
        write(tmp)
        for d in sorted((p for p in tmp.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
            fsync_dir(d)
        fsync_dir(tmp)
        if not path.exists():
            os.rename(tmp, path)
            fsync_dir(path.parent)
            return path
        old = path.parent / f".{path.name}.old-{uuid.uuid4().hex[:8]}"
        os.rename(path, old)
        os.rename(tmp, path)
        fsync_dir(path.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for entry in sorted(old.iterdir()):
        if carry_over(entry.name) and not (path / entry.name).exists():
            os.rename(entry, path / entry.name)
    shutil.rmtree(old)
    return path


def is_hidden_sibling(name: str) -> bool:
    """A folder `publish_atomically` leaves behind only when killed: `.NAME.partial-<id>` or `.NAME.old-<id>`."""
    return name.startswith(".") and (".partial-" in name or ".old-" in name)


# what a checkpoint writer writes and replaces: config.json, the index and the model's shards
_SHARD = re.compile(r"^model(-\d+-of-\d+)?\.safetensors$")
# weights of any kind, never copied along as a "companion"
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


def is_checkpoint_file(name: str) -> bool:
    """config.json, the index and the model shards: what `save` writes and, rewriting a folder, replaces (every
    other file of the old folder is kept)."""
    return name in (CONFIG, INDEX) or _SHARD.match(name) is not None


def companion_files(source: str | Path) -> list[Path]:
    """The files that make a checkpoint folder usable besides its weights: tokenizer (`tiktoken.model`,
    `tokenizer_config.json`, ...), model card (`MODEL_CARD.md` / `README.md`), `generation_config.json`,
    processor and code files. That is every visible top-level file that is not config.json, the index or
    weights. `source` may also be one such file (a tokenizer passed on its own)."""
    source = Path(source)
    if source.is_file():
        return [source]
    if not source.is_dir():
        raise FileNotFoundError(f"{source}: no such folder or file to copy the tokenizer and model card from")
    return [p for p in sorted(source.iterdir()) if p.is_file() and not p.name.startswith(".")
            and not is_checkpoint_file(p.name) and not p.name.endswith(_WEIGHT_SUFFIXES)]


def copy_durably(src: Path, dst: Path) -> None:
    shutil.copyfile(src, dst)
    with open(dst, "rb+") as f:
        os.fsync(f.fileno())
