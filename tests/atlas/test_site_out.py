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
