"""Every command that writes refuses an output that is, contains or lies inside what it reads, in one line, before
anything is loaded or written (issue 42: `lora merge BASE ADAPTER BASE` replaced the installed demo model).
`generate --output` onto `--input`: tests/cli/test_generate_batch.py."""

from __future__ import annotations

import pytest

from kimik3.cli import main
from kimik3.cli.outputs import check_output
from kimik3.presets import DEMO_MODEL
from tests.train.test_train_cli import write_run


def snapshot(folder):
    return {p.relative_to(folder): (p.stat().st_mtime_ns, p.stat().st_size) for p in folder.rglob("*")}


@pytest.mark.parametrize("out, how", [("ck", "is"), ("ck/sub", "lies inside"), (".", "contains"),
                                      ("ck/../ck", "is"), ("link", "is"), ("link/sub", "lies inside")])
def test_check_output_refuses_overlap_however_spelled(tmp_path, monkeypatch, out, how):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ck").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "ck")
    with pytest.raises(ValueError, match=f"^--out {out} {how} SRC ck: writing there would overwrite"):
        check_output(out, "--out", {"SRC": "ck", "OTHER": None})


def test_check_output_allows_a_sibling(tmp_path):
    (tmp_path / "ck").mkdir()
    check_output(tmp_path / "ck-bf16", "DST", {"SRC": tmp_path / "ck"})
    check_output(tmp_path / "ck2" / "x", "DST", {"SRC": tmp_path / "ck"})  # a shared prefix of names is not nesting


def run(args, capsys):
    rc = main(args)
    return rc, capsys.readouterr().err


def test_lora_merge_onto_its_base_is_refused_and_the_base_untouched(tmp_path, capsys):
    before = snapshot(DEMO_MODEL)
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    for out, name in ((DEMO_MODEL, "BASE"), (DEMO_MODEL / "merged", "BASE"), (adapter, "ADAPTER")):
        rc, err = run(["lora", "merge", str(DEMO_MODEL), str(adapter), str(out), "--quiet"], capsys)
        assert rc == 2 and len(err.strip().splitlines()) == 1, err
        assert err.startswith("kimik3 lora: error: OUT ") and f" {name} " in err
    assert snapshot(DEMO_MODEL) == before and sorted(adapter.iterdir()) == []


def test_convert_onto_around_or_inside_its_source_is_refused(tmp_path, capsys):
    before = snapshot(DEMO_MODEL)
    for dst in (DEMO_MODEL, DEMO_MODEL / "bf16", DEMO_MODEL.parent):
        rc, err = run(["convert", str(DEMO_MODEL), str(dst), "--experts", "bf16", "--quiet"], capsys)
        assert rc == 2 and err.startswith("kimik3 convert: error: DST ") and "SRC" in err, err
        assert len(err.strip().splitlines()) == 1
    assert snapshot(DEMO_MODEL) == before


def test_atlas_out_around_its_config_is_refused(tmp_path, capsys):
    config = tmp_path / "cfg" / "config.json"
    config.parent.mkdir()
    config.write_text((DEMO_MODEL / "config.json").read_text())
    for out in (config.parent, tmp_path):
        rc, err = run(["atlas", str(config), "--out", str(out), "--force"], capsys)
        assert rc == 2 and "contains CONFIG" in err and len(err.strip().splitlines()) == 1, err
    rc, err = run(["atlas", "demo", "--checkpoint", "demo", "--prompt", "ROMEO:", "--out", str(DEMO_MODEL / "a")],
                  capsys)
    assert rc == 2 and "lies inside --checkpoint" in err, err
    assert sorted(p.name for p in config.parent.iterdir()) == ["config.json"]


def test_train_out_dir_on_the_checkpoint_it_reads_is_refused(tmp_path, capsys):
    toml = write_run(tmp_path, model=f'checkpoint = "{tmp_path / "base"}"')
    (tmp_path / "base").mkdir()
    for out_dir in (tmp_path / "base", tmp_path / "base" / "run", tmp_path):
        rc, err = run(["train", str(toml), "--set", f'out_dir="{out_dir}"'], capsys)
        assert rc == 2 and "out_dir" in err and "model.checkpoint" in err, err
    assert sorted(p.name for p in (tmp_path / "base").iterdir()) == []
