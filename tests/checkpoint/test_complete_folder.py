"""A saved or converted checkpoint is complete and usable (tokenizer, model card, generation_config.json come
along), `save` in place or into an overlapping folder is safe (the CLI refuses such an output:
tests/cli/test_outputs.py), and nothing a user had is deleted."""

import json

import pytest
import torch

from kimik3.checkpoint import inspect_checkpoint, load, publish_atomically, save
from kimik3.cli import main
from kimik3.model import K3ForCausalLM
from kimik3.presets import DEMO_MODEL
from kimik3.train import checkpointing as ckpt
from tests.checkpoint.conftest import assert_state_equal, copy_of

COMPANIONS = ("tiktoken.model", "MODEL_CARD.md", "generation_config.json")


@pytest.fixture
def user_ck(saved, tmp_path):
    """The saved tiny checkpoint as a user keeps it: with a tokenizer, a model card and notes of their own."""
    ck = copy_of(saved, tmp_path / "ck")
    (ck / "tiktoken.model").write_bytes(b"dG9rZW4= 0\n")
    (ck / "README.md").write_text("# my tiny K3\n")
    (ck / "notes.txt").write_text("precious")
    (ck / "optimizer.pt").write_bytes(b"weights of their own: kept in place, never copied along")
    (ck / "generation_config.json").write_text(json.dumps({"eos_token_id": 7, "temperature": 0.5}))
    return ck


def test_save_copies_what_the_loaded_folder_had(user_ck, tmp_path):
    model = load(user_ck, quiet=True)
    assert model.loaded_from == user_ck
    out = save(model, tmp_path / "out", experts="bf16", quiet=True)
    for name in ("tiktoken.model", "README.md", "notes.txt", "generation_config.json"):
        assert (out / name).read_bytes() == (user_ck / name).read_bytes(), name
    assert not (out / "optimizer.pt").exists()
    assert inspect_checkpoint(out).ok


def test_save_from_a_tokenizer_file(dense_model, user_ck, tmp_path):
    out = save(dense_model, tmp_path / "out", source=user_ck / "tiktoken.model", quiet=True)
    assert (out / "tiktoken.model").read_bytes() == (user_ck / "tiktoken.model").read_bytes()
    assert not (out / "README.md").exists()  # a file source brings only itself
    with pytest.raises(FileNotFoundError, match="no such folder or file"):
        save(dense_model, tmp_path / "again", source=tmp_path / "nope")
    assert not (tmp_path / "again").exists()


def _save_over(src, dst) -> None:
    save(load(src, quiet=True), dst, experts="bf16", quiet=True)


def test_save_in_place_keeps_everything_but_the_old_weights(user_ck, saved, tmp_path):
    before = {p.name: p.read_bytes() for p in user_ck.iterdir() if p.suffix in (".model", ".md", ".txt", ".pt")}
    _save_over(user_ck, user_ck)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]  # no hidden siblings left
    assert {n: (user_ck / n).read_bytes() for n in before} == before
    report = inspect_checkpoint(user_ck)
    assert report.ok and report.experts == "bf16"
    assert_state_equal(load(saved, quiet=True), load(user_ck, quiet=True))
    assert json.loads((user_ck / "generation_config.json").read_text()) == {"eos_token_id": 7, "temperature": 0.5}


def test_save_into_a_folder_inside_the_source(user_ck):
    inner = user_ck / "bf16"
    _save_over(user_ck, inner)
    assert inspect_checkpoint(user_ck).ok and inspect_checkpoint(inner).ok
    assert (inner / "notes.txt").read_text() == "precious"  # copied, and the original is still there
    assert (user_ck / "notes.txt").read_text() == "precious"


def test_save_into_the_checkpoint_folder_that_holds_the_source(user_ck, saved):
    """The destination is a checkpoint folder and the source lies inside it: the rewrite keeps the source (and
    every non-weight file)."""
    inner = copy_of(saved, user_ck / "original")
    _save_over(inner, user_ck)
    assert inspect_checkpoint(inner).ok and inspect_checkpoint(user_ck).ok
    assert (user_ck / "notes.txt").read_text() == "precious"
    assert_state_equal(load(inner, quiet=True), load(user_ck, quiet=True))


def test_converted_demo_model_generates(tmp_path, capsys):
    out = tmp_path / "demo-bf16"
    assert main(["convert", str(DEMO_MODEL), str(out), "--experts", "bf16", "--quiet"]) == 0
    for name in COMPANIONS:
        assert (out / name).read_bytes() == (DEMO_MODEL / name).read_bytes(), name
    capsys.readouterr()
    assert main(["generate", "--model", str(out), "--prompt", "ROMEO:", "--max-new-tokens", "4"]) == 0
    text = capsys.readouterr().out
    assert text.strip() and "ROMEO:" in text


def test_publish_atomically(tmp_path):
    def write(files):
        def fill(tmp):
            for name, text in files.items():
                (tmp / name).write_text(text)
        return fill

    path = publish_atomically(tmp_path / "f", write({"a": "1", "keep": "mine", "drop": "old"}))
    assert sorted(p.name for p in path.iterdir()) == ["a", "drop", "keep"]
    publish_atomically(path, write({"a": "2"}), carry_over=lambda name: name == "keep")
    assert {p.name: p.read_text() for p in path.iterdir()} == {"a": "2", "keep": "mine"}
    with pytest.raises(ZeroDivisionError):
        publish_atomically(path, lambda tmp: 1 / 0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f"] and (path / "a").read_text() == "2"


def test_trainer_checkpoint_has_the_tokenizer(tiny_config, tmp_path):
    lm = K3ForCausalLM(tiny_config.text, torch.float32)
    for p in lm.parameters():
        torch.nn.init.normal_(p, std=0.02)
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tiktoken.model").write_bytes(b"dG9rZW4= 0\n")
    (tok / "corpus.txt").write_text("not a tokenizer")
    run = {"data": {"tokenizer": str(tok)}, "model": {"config": "tiny"}}
    root = tmp_path / "checkpoints"
    (root / ".step-00000001.old-deadbeef").mkdir(parents=True)  # left by a killed swap
    ckpt.remove_partials(root)
    assert list(root.iterdir()) == []
    for step in (1, 2, 2):  # the second save of step 2 replaces it
        path = ckpt.save_checkpoint(root, step, lm, tiny_config, {"step": step}, keep=1, config_json=run)
    assert sorted(p.name for p in root.iterdir()) == ["step-00000002"]
    assert sorted(p.name for p in (path / "model").iterdir() if not p.name.endswith(".safetensors")) == [
        "config.json", "generation_config.json", "model.safetensors.index.json", "tiktoken.model"]
    assert ckpt.load_trainer_state(path)["step"] == 2
