"""`kimik3 lora merge` and `kimik3 generate --lora` on the tiny base with a random adapter."""

from __future__ import annotations

import pytest
import torch

from kimik3 import lora
from kimik3.cli import main
from tests.cli.test_generate_chat import ckpt  # noqa: F401  (the tiny checkpoint with a byte tokenizer)
from tests.helpers import rel_err
from tests.lora.conftest import load_base, logits, randomize_adapter
from tests.lora.test_apply import IDS, TARGETS


@pytest.fixture(scope="module")
def adapter(ckpt, tmp_path_factory):  # noqa: F811
    model = lora.apply(load_base(ckpt), lora.LoraConfig(rank=4, targets=TARGETS))
    randomize_adapter(model, seed=5)
    return lora.save(model, tmp_path_factory.mktemp("cli") / "adapter"), logits(model, IDS)


def run(args, capsys):
    rc = main(args)
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_merge_writes_a_checkpoint(ckpt, adapter, tmp_path, capsys):  # noqa: F811
    folder, want = adapter
    rc, out, err = run(["lora", "merge", str(ckpt), str(folder), str(tmp_path / "m"), "--dtype", "float32",
                        "--quiet"], capsys)
    assert rc == 0, err
    assert "merged" in out and (tmp_path / "m" / "tiktoken.model").is_file()
    assert rel_err(logits(load_base(tmp_path / "m", packed=False), IDS), want) < 1e-5
    rc, out, err = run(["lora", "merge", str(ckpt), str(folder), str(tmp_path / "m4"), "--experts", "mxfp4",
                        "--quiet"], capsys)
    assert rc == 0 and "relative error" in out, err
    rc, _, err = run(["lora", "merge", str(ckpt), str(tmp_path / "nothing"), str(tmp_path / "x")], capsys)
    assert rc == 2 and "not an adapter folder" in err


def test_generate_with_lora_changes_the_text_and_is_the_adapters(ckpt, adapter, tmp_path, capsys):  # noqa: F811
    folder, _ = adapter
    args = ["generate", "--model", str(ckpt), "--prompt", "ab", "--max-new-tokens", "8", "--temperature", "0",
            "--dtype", "float32"]
    rc, plain, err = run(args, capsys)
    assert rc == 0, err
    rc, with_lora, err = run(args + ["--lora", str(folder)], capsys)
    assert rc == 0, err
    run(["lora", "merge", str(ckpt), str(folder), str(tmp_path / "m"), "--dtype", "float32", "--quiet"], capsys)
    (tmp_path / "m" / "tiktoken.model").write_bytes((ckpt / "tiktoken.model").read_bytes())
    rc, merged, err = run([*args[:2], str(tmp_path / "m"), *args[3:]], capsys)
    assert rc == 0, err
    assert with_lora == merged and with_lora != plain
    rc, _, err = run(args + ["--lora", str(tmp_path / "missing")], capsys)
    assert rc == 2 and "not an adapter folder" in err and "Traceback" not in err
    assert torch.is_grad_enabled()


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_a_damaged_adapter_is_one_line_naming_its_file(ckpt, adapter, tmp_path, capsys, damage):  # noqa: F811
    """A truncated (or foreign) adapter_model.safetensors: one line naming the file from generate --lora, lora merge
    and serve --lora, before the model loads; not the library's 34-line `incomplete metadata` traceback."""
    folder, _ = adapter
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in folder.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    weights = bad / "adapter_model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2] if damage == "truncated" else b"\x80\x04not safetensors at all")
    commands = [["generate", "--model", str(ckpt), "--prompt", "ab", "--max-new-tokens", "2", "--lora", str(bad)],
                ["lora", "merge", str(ckpt), str(bad), str(tmp_path / "m"), "--quiet"]]
    try:
        import uvicorn  # noqa: F401

        commands.append(["serve", "--model", str(ckpt), "--port", "0", "--lora", f"x={bad}"])
    except ImportError:
        pass
    for args in commands:
        rc, _, err = run(args, capsys)
        assert rc == 2 and len(err.strip().splitlines()) == 1 and str(weights) in err, (args[0], err)
        assert ("truncated" if damage == "truncated" else "not a safetensors file") in err
    assert not (tmp_path / "m").exists()
