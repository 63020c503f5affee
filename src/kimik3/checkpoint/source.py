"""What a model on disk says about itself, whether a checkpoint folder or a GGUF: config, tokenizer, sampling defaults.

The commands that take `--model` read these before the (long) load, through these three functions, so a `.gguf`
file works wherever a folder does (`gguf_read` answers for it from its metadata).
"""

from __future__ import annotations

import json
from pathlib import Path

from kimik3.checkpoint.folder import CONFIG, GENERATION_CONFIG
from kimik3.config import K3Config
from kimik3.tokenizer import Tokenizer


def is_gguf(path: str | Path) -> bool:
    return str(path).endswith(".gguf")


def read_config(path: str | Path) -> K3Config:
    """The model's config: config.json of a folder, or a GGUF's metadata."""
    if is_gguf(path):
        from kimik3.checkpoint.gguf_read import open_gguf

        return open_gguf(path).config()
    return K3Config.from_file(Path(path) / CONFIG)


def read_tokenizer(path: str | Path) -> Tokenizer:
    """The model's tokenizer: a folder's tiktoken.model, or a GGUF's vocabulary."""
    if is_gguf(path):
        from kimik3.checkpoint.gguf_read import open_gguf

        return open_gguf(path).tokenizer()
    file = Path(path) / "tiktoken.model"
    if not file.is_file():
        raise FileNotFoundError(f"{file}: the model folder has no tokenizer (tiktoken.model); copy the one the "
                                "checkpoint was trained with next to config.json")
    return Tokenizer.from_file(file)


def read_generation_config(path: str | Path) -> tuple[Path, dict]:
    """(where it was read, the sampling defaults): a folder's generation_config.json ({} without one), or a GGUF's
    saved generation config / llama.cpp's general.sampling.* keys."""
    if is_gguf(path):
        from kimik3.checkpoint.gguf_read import open_gguf

        return Path(path), open_gguf(path).generation_config()
    file = Path(path) / GENERATION_CONFIG
    if not file.is_file():
        return file, {}
    try:
        gen = json.loads(file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{file}: not valid JSON ({e})") from None
    if not isinstance(gen, dict):
        raise ValueError(f"{file}: expected a JSON object, got {type(gen).__name__}")
    return file, gen
