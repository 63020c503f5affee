"""`kimik3 convert` between expert formats and dtypes; every conversion keeps the dequantized weights."""

import json
import sys

import torch

from kimik3.checkpoint import inspect_checkpoint, load
from kimik3.cli import main
from tests.checkpoint.conftest import assert_state_equal


def test_convert_round_trip(saved, tmp_path, capsys):
    bf16, back = tmp_path / "bf16", tmp_path / "mxfp4"
    assert main(["convert", str(saved), str(bf16), "--experts", "bf16", "--max-shard-size", "300KB"]) == 0
    report = inspect_checkpoint(bf16)
    assert report.ok and report.experts == "bf16" and report.shards > 1
    reference = load(saved)
    assert_state_equal(reference, load(bf16))
    assert main(["convert", str(bf16), str(back), "--experts", "mxfp4", "--quiet"]) == 0
    report = inspect_checkpoint(back)
    assert report.ok and report.experts == "mxfp4"
    assert_state_equal(reference, load(back))  # re-encoding MXFP4-exact weights keeps their values
    assert "wrote" in capsys.readouterr().out


def test_convert_dtype(saved, tmp_path):
    dst = tmp_path / "fp32"
    assert main(["convert", str(saved), str(dst), "--experts", "mxfp4", "--dtype", "float32", "--quiet"]) == 0
    assert json.loads((dst / "config.json").read_text())["text_config"]["dtype"] == "float32"
    model = load(dst)
    assert {t.dtype for t in model.state_dict().values()} == {torch.float32, torch.uint8} - {torch.uint8}
    assert_state_equal(load(saved, dtype=torch.float32), model)


def test_convert_errors(tmp_path, capsys):
    assert main(["convert", str(tmp_path / "nope"), str(tmp_path / "out"), "--experts", "bf16"]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_progress_only_on_a_terminal(saved, capsys, monkeypatch):
    load(saved)
    assert capsys.readouterr().err == ""  # stderr is not a terminal here
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    load(saved, quiet=True)
    assert capsys.readouterr().err == ""
    load(saved)
    err = capsys.readouterr().err
    assert "loading" in err and "466/466 tensors" in err
