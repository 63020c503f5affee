"""The writer is atomic: a crash mid-write never leaves a folder at the path that loads; replacing is safe."""

import pytest

from kimik3.checkpoint import folder, load, save, writer
from kimik3.checkpoint.folder import CONFIG
from tests.checkpoint.conftest import assert_state_equal


class Boom(RuntimeError):
    pass


def _fail_after_first_shard(monkeypatch):
    real, calls = writer.write_shard, []

    def flaky(*args, **kwargs):
        if calls:
            raise Boom("disk on fire")
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(writer, "write_shard", flaky)


def test_crash_leaves_nothing(packed_model, tmp_path, monkeypatch):
    _fail_after_first_shard(monkeypatch)
    with pytest.raises(Boom):
        save(packed_model, tmp_path / "ck", max_shard_size="400KB")
    assert list(tmp_path.iterdir()) == []  # no folder at the path, and the partial sibling is cleaned up


def test_killed_mid_write_leaves_no_loadable_folder(packed_model, tmp_path, monkeypatch):
    """Killed (no clean-up runs): only the hidden partial sibling remains, and the path does not load."""
    _fail_after_first_shard(monkeypatch)
    monkeypatch.setattr(folder.shutil, "rmtree", lambda *args, **kwargs: None)
    with pytest.raises(Boom):
        save(packed_model, tmp_path / "ck", max_shard_size="400KB")
    monkeypatch.undo()
    [partial] = tmp_path.iterdir()
    assert partial.name.startswith(".ck.partial-") and len(list(partial.glob("*.safetensors"))) == 1
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load(tmp_path / "ck")


def test_crash_keeps_the_old_checkpoint(packed_model, dense_model, tmp_path, monkeypatch):
    path = save(dense_model, tmp_path / "ck", experts="bf16")
    _fail_after_first_shard(monkeypatch)
    with pytest.raises(Boom):
        save(packed_model, path, max_shard_size="400KB")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]
    assert_state_equal(dense_model, load(path))


def test_replace_existing_checkpoint(packed_model, dense_model, tmp_path):
    path = save(dense_model, tmp_path / "ck", experts="bf16", max_shard_size="300KB")
    save(packed_model, path, max_shard_size="1GB")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]
    assert len(list(path.glob("*.safetensors"))) == 1  # no stale shards of the old checkpoint
    assert_state_equal(packed_model, load(path, keep_experts_packed=True))


def test_refuses_to_replace_what_is_not_a_checkpoint(dense_model, tmp_path):
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "thesis.tex").write_text("precious")
    with pytest.raises(ValueError, match="not a checkpoint; refusing"):
        save(dense_model, tmp_path / "home")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="not a folder; refusing"):
        save(dense_model, tmp_path / "file")
    assert (tmp_path / "home" / "thesis.tex").read_text() == "precious"
    (tmp_path / "empty").mkdir()
    assert (save(dense_model, tmp_path / "empty", experts="bf16") / CONFIG).is_file()
