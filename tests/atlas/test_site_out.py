"""`kimik3 atlas --out`: a user's folder is never overwritten unasked, the site appears whole or not at all,
and a bad --port is one error line."""

from __future__ import annotations

import re

import pytest

import kimik3.atlas.render as render
from kimik3.cli import main


def test_a_users_folder_is_refused_unless_forced(tmp_path, capsys):
    d = tmp_path / "d"
    d.mkdir()
    (d / "index.html").write_text("<h1>mine</h1>")
    (d / "notes.txt").write_text("keep")
    assert main(["atlas", "tiny", "--out", str(d)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "error:" in err and "--force" in err
    assert (d / "index.html").read_text() == "<h1>mine</h1>"
    assert main(["atlas", "tiny", "--out", str(d), "--force"]) == 0
    assert (d / "atlas.json").is_file() and (d / "notes.txt").read_text() == "keep"
    # a folder the atlas wrote is rebuilt without --force
    assert main(["atlas", "tiny", "--out", str(d)]) == 0


def test_an_interrupted_build_leaves_no_partial_site(tmp_path, monkeypatch):
    real = render.HtmlFormatter
    calls = []

    def interrupt(*a, **kw):  # Ctrl-C after a few component pages
        calls.append(1)
        if len(calls) == 4:
            raise KeyboardInterrupt
        return real(*a, **kw)

    monkeypatch.setattr(render, "HtmlFormatter", interrupt)
    out = tmp_path / "o"
    assert main(["atlas", "tiny", "--out", str(out)]) == 130
    assert not out.exists() and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("port", ["99999", "-1"])
def test_bad_port_is_one_error_line(tmp_path, capsys, port):
    assert main(["atlas", "tiny", "--out", str(tmp_path / "x"), "--serve", "--port", port]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--port" in err and not (tmp_path / "x").exists()


def test_every_css_url_resolves_to_a_shipped_file(tmp_path):
    out = tmp_path / "s"
    assert main(["atlas", "tiny", "--out", str(out)]) == 0
    for css in out.rglob("*.css"):
        for ref in re.findall(r"url\(\s*['\"]?(?!data:)([^'\")]+)", css.read_text()):
            assert (css.parent / ref).is_file(), (css.name, ref)


def test_provenance_names_kimik3_once(monkeypatch):
    import subprocess

    from kimik3.atlas import evidence

    def no_git(*a, **kw):
        raise OSError("no git")

    monkeypatch.setattr(subprocess, "run", no_git)
    assert not evidence.revision().startswith("kimik3")


def test_diff_page_prints_no_python_dicts(tmp_path):
    out = tmp_path / "s"
    assert main(["atlas", "tiny", "--out", str(out), "--diff", "demo"]) == 0
    html = (out / "diff.html").read_text()
    assert "{&#39;" not in html and "{'" not in html and "[(" not in html


@pytest.mark.parametrize("at", [1, 2, 3, -1])
def test_ctrl_c_while_publishing_leaves_the_whole_site_or_none(tmp_path, monkeypatch, at):
    """Ctrl-C in the publish step (each fsync around the rename, the last after it): exit 130, and --out is either
    absent or the complete site; no hidden partial folder is left beside it."""
    import kimik3.checkpoint.folder as folder

    real, calls = folder.fsync_dir, []

    def fsync(path):
        calls.append(path)
        if len(calls) == at or (at == -1 and path == tmp_path):  # -1: the parent, after the rename
            raise KeyboardInterrupt
        real(path)

    monkeypatch.setattr(folder, "fsync_dir", fsync)
    out = tmp_path / "o"
    assert main(["atlas", "tiny", "--out", str(out)]) == 130
    assert [p.name for p in tmp_path.iterdir() if p.name != "o"] == []
    if out.exists():
        assert (out / "index.html").is_file() and (out / "atlas.json").is_file()
        assert at == -1


def test_routed_expert_flops_are_per_moe_layer_as_their_count_says(tmp_path):
    """82,432 routed experts are the parameter instances; their FLOPs are per MoE layer (a token meets top-k of
    each layer's experts), and the page says so with the layer count, not "per instance"."""
    import json

    from kimik3.presets import load_config

    out = tmp_path / "s"
    assert main(["atlas", "tiny", "--out", str(out)]) == 0
    a = json.loads((out / "atlas.json").read_text())
    moe, f = load_config("tiny").text.moe, a["nodes"]["experts"]["flops"]
    layers = a["nodes"]["experts"]["instances"]["stored"] // a["nodes"]["experts"]["instances"]["experts_per_layer"]
    assert f["instances"] == layers and f["per"] == (f"MoE layer (top-{moe.num_experts_per_token} of its "
                                                     f"{moe.num_experts:,} experts)")
    page = re.sub(r"\s+", " ", (out / "c" / "experts.html").read_text())
    assert f"per MoE layer (top-{moe.num_experts_per_token} of its" in page and "per instance +" not in page
    assert f"over all {layers} MoE layers" in page
    assert a["nodes"]["kda"]["flops"]["per"] == "instance"
    index = re.sub(r"\s+", " ", (out / "index.html").read_text())
    assert "<th>weights</th><th>per</th>" in index and "<td>MoE layer (top-" in index
