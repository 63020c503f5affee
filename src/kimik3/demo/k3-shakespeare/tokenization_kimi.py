"""Kimi K3's tokenizer for `AutoTokenizer.from_pretrained(folder, trust_remote_code=True)` without kimik3.

kimik3 copies this file into every checkpoint folder it writes, beside `tiktoken.model` and a
`tokenizer_config.json` whose `auto_map` names this class (as the release's does) and which carries what this file
does not hard-code: the pre-tokenizer pattern (`pat_str`), every special token's id (`special_tokens`) and the Jinja
chat template. It needs only tiktoken and transformers. With kimik3 installed, `import kimik3.hf` registers
kimik3's own class under this name, which needs no remote code.

Attributes llama.cpp's converter reads: `model` (the tiktoken Encoding; `model._mergeable_ranks`),
`special_tokens` (name -> id), `eos_id`. Token strings are the tokens' bytes through GPT-2's byte-to-character
table; special tokens are their names.
"""

from __future__ import annotations

import base64
import shutil
from pathlib import Path
from typing import Any

import tiktoken
from transformers import PreTrainedTokenizer

FILE = "tiktoken.model"


def _byte_chars() -> list[str]:
    """GPT-2's bytes_to_unicode: byte b -> one printable character (printable bytes map to themselves)."""
    keep = set(range(ord("!"), ord("~") + 1)) | set(range(ord("¡"), ord("¬") + 1)) | set(range(ord("®"), 256))
    chars, extra = [], 0
    for b in range(256):
        chars.append(chr(b) if b in keep else chr(256 + extra))
        extra += b not in keep
    return chars


class TikTokenTokenizer(PreTrainedTokenizer):
    """K3's byte-level BPE over `tiktoken.model`; `pat_str` and `special_tokens` come from tokenizer_config.json."""

    vocab_files_names = {"vocab_file": FILE}
    model_input_names = ["input_ids", "attention_mask"]

    def __init__(self, vocab_file: str, pat_str: str, special_tokens: dict[str, int], **kwargs: Any):
        ranks: dict[bytes, int] = {}
        with open(vocab_file, "rb") as f:
            for line in f:
                if line.split():
                    token, rank = line.split()
                    ranks[base64.b64decode(token)] = int(rank)
        self.vocab_file = vocab_file
        self.special_tokens = {str(k): int(v) for k, v in special_tokens.items()}
        self.model = tiktoken.Encoding(Path(vocab_file).name, pat_str=pat_str, mergeable_ranks=ranks,
                                       special_tokens=self.special_tokens)
        chars = _byte_chars()
        self._id_to_token = {i: "".join(chars[b] for b in t) for t, i in ranks.items()}
        self._id_to_token.update({i: name for name, i in self.special_tokens.items()})
        self._token_to_id = {t: i for i, t in self._id_to_token.items()}
        self.eos_id = self.special_tokens["<|end_of_msg|>"]  # the turn's end: where generation stops
        super().__init__(pat_str=pat_str, special_tokens=special_tokens, **kwargs)
        # every special name in text is one token, as kimik3's encode(allow_special=True) reads it
        self.add_tokens([n for n in self.special_tokens if n not in self.all_special_tokens], special_tokens=True)

    @property
    def vocab_size(self) -> int:
        return len(self._id_to_token)

    def get_vocab(self) -> dict[str, int]:
        return dict(self._token_to_id)

    def _tokenize(self, text: str, **kwargs: Any) -> list[str]:
        return [self._id_to_token[i] for i in self.model.encode_ordinary(text)]

    def _convert_token_to_id(self, token: str) -> int:
        return self._token_to_id.get(token, self.special_tokens["[UNK]"])

    def _convert_id_to_token(self, index: int) -> str:
        return self._id_to_token[index]

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        return self.model.decode_bytes([self._token_to_id[t] for t in tokens]).decode("utf-8", errors="replace")

    def _decode(self, token_ids, skip_special_tokens: bool = False, **kwargs: Any) -> str:
        ids = [token_ids] if isinstance(token_ids, int) else list(token_ids)
        if skip_special_tokens:
            specials = set(self.special_tokens.values())
            ids = [i for i in ids if i not in specials]
        return self.model.decode_bytes(ids).decode("utf-8", errors="replace")

    def build_inputs_with_special_tokens(self, token_ids_0: list[int], token_ids_1: list[int] | None = None):
        return token_ids_0 + (token_ids_1 or [])  # K3 adds no BOS or EOS to encoded text

    def save_vocabulary(self, save_directory: str, filename_prefix: str | None = None) -> tuple[str]:
        out = Path(save_directory) / ((filename_prefix + "-" if filename_prefix else "") + FILE)
        if Path(self.vocab_file).resolve() != out.resolve():
            shutil.copyfile(self.vocab_file, out)
        return (str(out),)
