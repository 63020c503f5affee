"""The tokenizer files that make a checkpoint folder a complete Hugging Face checkpoint.

    tiktoken.model           the ranks (already there: `write_hf_files` adds the two files below beside it)
    tokenizer_config.json    tokenizer_class TikTokenTokenizer, auto_map to the file below, the Jinja chat template,
                             the pre-tokenizer pattern, every special token's id, bos/eos/pad/unk, model_max_length
    tokenization_kimi.py     the class for `trust_remote_code=True` without kimik3 (this package's copy)

After `import kimik3.hf`, transformers resolves `TikTokenTokenizer` to kimik3's own registered class (no remote
code); llama.cpp's converter loads the remote one.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from . import CHAT_TEMPLATE
from .bpe import PATTERN, Tokenizer
from .chat import END_OF_MSG

TOKENIZER_CONFIG = "tokenizer_config.json"
REMOTE_CODE = Path(__file__).with_name("tokenization_kimi.py")
TOKENIZER_CLASS = "TikTokenTokenizer"  # the release's name for its (remote) tokenizer class


def tokenizer_config(tokenizer: Tokenizer, model_max_length: int | None = None) -> dict:
    """tokenizer_config.json for `tokenizer` (a folder's tiktoken.model)."""
    config = {
        "tokenizer_class": TOKENIZER_CLASS,
        "auto_map": {"AutoTokenizer": [f"{REMOTE_CODE.stem}.{TOKENIZER_CLASS}", None]},
        "bos_token": "[BOS]", "eos_token": END_OF_MSG, "pad_token": "[PAD]", "unk_token": "[UNK]",
        "chat_template": CHAT_TEMPLATE,
        "pat_str": PATTERN,
        "special_tokens": dict(tokenizer.special_ids),
        "clean_up_tokenization_spaces": False,
    }
    if model_max_length is not None:
        config["model_max_length"] = model_max_length
    return config


def write_hf_files(folder: str | Path, model_max_length: int | None = None) -> None:
    """Write tokenizer_config.json and tokenization_kimi.py beside `folder`'s tiktoken.model (fsynced)."""
    folder = Path(folder)
    config = tokenizer_config(Tokenizer.from_file(folder / "tiktoken.model"), model_max_length)
    with open(folder / TOKENIZER_CONFIG, "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, ensure_ascii=False)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    shutil.copyfile(REMOTE_CODE, folder / REMOTE_CODE.name)
    with open(folder / REMOTE_CODE.name, "rb+") as f:
        os.fsync(f.fileno())
