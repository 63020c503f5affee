"""The shipped autotuning results (kimik3.ops.tuned): Triton's file format, copied into the cache directory once,
never over a file already there."""

import json

import pytest

from kimik3.ops.tuned import SEEDS, seed_autotune

pytest.importorskip("triton")


def shipped():
    return sorted(SEEDS.glob("*/*/*.autotune.json"))


def test_shipped_files_are_triton_autotune_results():
    files = shipped()
    assert len(files) >= 20  # the demo's and the slice's fla kernels, as an H200 tuned them
    for f in files:
        d = json.loads(f.read_text())
        assert set(d) == {"key", "configs_timings"}, f
        assert all(isinstance(cfg, dict) and "num_warps" in cfg for cfg, _ in d["configs_timings"]), f


def test_seeding_copies_what_is_missing_and_keeps_what_is_there(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    files = shipped()
    mine = tmp_path / files[0].parent.name / files[0].name
    mine.parent.mkdir(parents=True)
    mine.write_text("the user's own tuning")
    assert seed_autotune.__wrapped__() == len(files) - 1
    assert mine.read_text() == "the user's own tuning"
    for f in files[1:]:
        assert (tmp_path / f.parent.name / f.name).read_bytes() == f.read_bytes()
    assert not list(tmp_path.glob("*/*.tmp.*"))
    assert seed_autotune.__wrapped__() == 0  # a second process finds them all
