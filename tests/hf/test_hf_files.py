"""Every checkpoint kimik3 writes is a complete HF checkpoint: transformers loads its tokenizer with
`trust_remote_code=True` alone (no kimik3 in the process), and after `import kimik3.hf` without remote code."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from transformers import AutoTokenizer

import kimik3
from kimik3.hf import KimiK3Tokenizer
from kimik3.presets import DEMO_MODEL
from kimik3.tokenizer import Tokenizer, encode_chat
from tests.tokenizer.test_template import CASES

CHATS = [CASES[k] for k in ("thinking, multi-turn with reasoning", "tools, calls and results in call order",
                            "images with the processor's prompts")]
TEXT = "ROMEO: But soft<|end_of_msg|> Zürich 東京"

# run in a fresh interpreter with kimik3 off the path: only the folder's own files may serve the tokenizer
_REMOTE = """
import json, sys
sys.path = [p for p in sys.path if 'kimik3' not in p and not p.endswith('/src')]
from transformers import AutoTokenizer
folder, chats, text = json.loads(sys.stdin.read())
tok = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
assert not any(m.startswith('kimik3') for m in sys.modules), 'kimik3 was imported'
out = {'class': type(tok).__name__, 'eos': tok.eos_token_id, 'text': tok.encode(text),
       'chats': [tok.apply_chat_template(m, tokenize=True, return_dict=False, add_generation_prompt=True, **kw)
                 for m, kw in chats]}
print(json.dumps(out))
"""


def test_saved_folder_loads_with_remote_code_alone(tmp_path):
    out = kimik3.save(kimik3.load(DEMO_MODEL, quiet=True), tmp_path / "ckpt", quiet=True)
    assert {"tokenizer_config.json", "tokenization_kimi.py", "tiktoken.model"} <= {p.name for p in out.iterdir()}
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    chats = [(m, {k: v for k, v in kw.items()}) for m, kw in CHATS]
    res = subprocess.run([sys.executable, "-c", _REMOTE], input=json.dumps([str(out), chats, TEXT]), env=env,
                         cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    tok = Tokenizer.from_file(out)
    assert got["class"] == "TikTokenTokenizer" and got["eos"] == tok.eos_id
    assert got["text"] == tok.encode(TEXT, allow_special=True)
    assert got["chats"] == [encode_chat(tok, m, **kw) for m, kw in chats]


def test_saved_folder_loads_without_remote_code_after_import(tmp_path):
    out = kimik3.save(kimik3.load(DEMO_MODEL, quiet=True), tmp_path / "ckpt", quiet=True)
    tok = AutoTokenizer.from_pretrained(out)
    assert isinstance(tok, KimiK3Tokenizer)
    assert tok.chat_template == json.loads((out / "tokenizer_config.json").read_text())["chat_template"]
    messages, kw = CHATS[0]
    assert tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=False, **kw) == encode_chat(
        Tokenizer.from_file(out), messages, **kw)


def test_the_remote_class_keeps_the_same_byte_table():
    from kimik3.tokenizer.bpe import byte_chars
    from kimik3.tokenizer.tokenization_kimi import _byte_chars

    assert tuple(_byte_chars()) == byte_chars()
