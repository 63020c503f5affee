"""`train --prepare OUT`: an OUT that cannot be a shard folder is one error naming it, before any tokenizing."""

import pytest

from kimik3.cli import main
from kimik3.train.data import prepare_shards
from tests.helpers import REPO

BYTES = str(REPO / "configs/train/bytes.tiktoken")


def test_prepare_into_a_file_is_refused_before_tokenizing(tmp_path, monkeypatch):
    text, taken = tmp_path / "a.txt", tmp_path / "taken"
    text.write_text("hello")
    taken.write_text("the user's file")
    monkeypatch.setattr("kimik3.train.data.load_tokenizer", lambda *a: pytest.fail("tokenized first"))
    with pytest.raises(ValueError, match=rf"--prepare {taken}: is a file; name a new folder"):
        prepare_shards([str(text)], BYTES, taken)
    assert taken.read_text() == "the user's file"


def test_prepare_under_a_file_is_one_line(tmp_path, capsys):
    text, taken = tmp_path / "a.txt", tmp_path / "taken"
    text.write_text("hello")
    taken.write_text("x")
    assert main(["train", "--prepare", str(taken / "shards"), "--tokenizer", BYTES, str(text)]) == 2
    assert f"kimik3 train: error: --prepare {taken / 'shards'}: cannot create the folder" in capsys.readouterr().err
