"""Warnings reach a CLI user as one line each, once: no source line, no file path of ours, no repeats."""

import json

from kimik3.cli import main
from kimik3.presets import DEMO_MODEL


def test_a_misspelt_config_key_is_one_warning_line(tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    for f in DEMO_MODEL.iterdir():
        if f.name != "config.json":
            (ckpt / f.name).symlink_to(f)
    d = json.loads((DEMO_MODEL / "config.json").read_text())
    d["text_config"]["num_hiden_layers"] = 5
    (ckpt / "config.json").write_text(json.dumps(d))
    # config.json is read twice here (by the CLI for the context bound, then by the loader)
    rc = main(["generate", "--model", str(ckpt), "--device", "cpu", "--prompt", "ROMEO:", "--max-new-tokens", "1",
               "--temperature", "0", "--no-stream"])
    err = capsys.readouterr().err
    assert rc == 0, err
    lines = [ln for ln in err.splitlines() if "num_hiden_layers" in ln]
    assert len(lines) == 1, err
    assert lines[0].startswith("kimik3 generate: warning: ")
    assert "did you mean 'text_config.num_hidden_layers'" in lines[0]
    assert "UserWarning" not in err and "K3Config.from_file" not in err and ".py:" not in err
