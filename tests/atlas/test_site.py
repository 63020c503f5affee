"""The written site: offline, deterministic, the CLI (exit codes, --serve on loopback), the vendored KaTeX."""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from kimik3.atlas.build import build_atlas
from kimik3.atlas.render import write_site
from kimik3.cli import main
from kimik3.presets import load_config

BUILT_AT = "2026-01-01 00:00 UTC"
KATEX = Path(__file__).resolve().parents[2] / "src" / "kimik3" / "atlas" / "vendor" / "katex"


@pytest.fixture(scope="module")
def tiny_site(tmp_path_factory):
    out = tmp_path_factory.mktemp("site")
    write_site(build_atlas(load_config("tiny"), name="tiny", built_at=BUILT_AT), out)
    return out


def test_site_is_offline(tiny_site):
    pages = [p for p in tiny_site.rglob("*") if p.suffix in (".html", ".css", ".js")]
    assert len(pages) > 25
    remote = re.compile(r"""(src|href)\s*=\s*["']?https?:|@import\s+["']?(url\()?["']?https?:|url\(\s*["']?https?:""")
    bad = [(p.name, m.group(0)) for p in pages for m in remote.finditer(p.read_text(errors="replace"))]
    assert not bad, bad
    # every local link of every page resolves to a file of the site
    for page in tiny_site.rglob("*.html"):
        for ref in re.findall(r'(?:src|href)="(?!data:)([^"#]+)', page.read_text()):
            assert (page.parent / ref).resolve().is_file(), (page.name, ref)


def test_component_pages_state_cache_sizes(tiny_site):
    atlas = json.loads((tiny_site / "atlas.json").read_text())
    m = atlas["memory"]
    kda = (tiny_site / "c" / "kda.html").read_text()
    assert f"{m['kda_state_per_sequence'] // m['kda_layers']:,} B of fp32 state" in kda
    mla = (tiny_site / "c" / "mla.html").read_text()
    assert f"{m['mla_latent_per_token'] // m['mla_layers']:,} B per token and layer" in mla
    # tiny: 3 heads x 24 x 24 fp32 state; a 28-wide latent + a 10-wide shared key in bf16
    assert m["kda_state_per_sequence"] // m["kda_layers"] == 3 * 24 * 24 * 4
    assert m["mla_latent_per_token"] // m["mla_layers"] == (28 + 10) * 2


def test_two_builds_are_identical(tmp_path):
    a = build_atlas(load_config("tiny"), name="tiny", built_at=BUILT_AT)
    b = build_atlas(load_config("tiny"), name="tiny", built_at=BUILT_AT)
    assert json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)
    write_site(a, tmp_path / "a")
    write_site(b, tmp_path / "b")
    files = sorted(p.relative_to(tmp_path / "a") for p in (tmp_path / "a").rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(tmp_path / "b") for p in (tmp_path / "b").rglob("*") if p.is_file())
    for f in files:
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes(), f


def test_atlas_json_round_trips(tiny_site):
    data = json.loads((tiny_site / "atlas.json").read_text())
    assert data["name"] == "tiny" and data["build"]["built_at"] == BUILT_AT
    assert sum(n["total"] for n in data["nodes"].values() if n["leaf"]) == data["totals"]["total"]
    assert "/work/" not in (tiny_site / "atlas.json").read_text()  # no machine paths in the output


def test_cli_builds_and_diffs(tmp_path, capsys):
    assert main(["atlas", "tiny", "--out", str(tmp_path / "s"), "--diff", "demo", "--context", "2048"]) == 0
    out = capsys.readouterr().out
    assert "atlas of tiny" in out and "built in" in out
    assert (tmp_path / "s" / "index.html").is_file() and (tmp_path / "s" / "diff.html").is_file()
    diff = json.loads((tmp_path / "s" / "diff.json").read_text())
    assert sum(c["delta"] for c in diff["components"]) == diff["totals"]["delta"]
    assert json.loads((tmp_path / "s" / "atlas.json").read_text())["memory"]["context"] == 2048


def test_cli_errors(tmp_path, capsys):
    assert main(["atlas", str(tmp_path / "nope.json"), "--out", str(tmp_path / "x")]) == 2
    assert "no config file" in capsys.readouterr().err
    assert main(["atlas", "tiny", "--out", str(tmp_path / "x"), "--prompt", "hi"]) == 2
    assert "--prompt needs a checkpoint" in capsys.readouterr().err
    assert main(["atlas", "tiny", "--out", str(tmp_path / "x"), "--context", "0"]) == 2


def test_cli_live_numbers_on_the_demo_model(tmp_path):
    assert main(["atlas", "demo", "--out", str(tmp_path / "s"), "--checkpoint", "demo", "--prompt", "ROMEO:"]) == 0
    live = json.loads((tmp_path / "s" / "atlas.json").read_text())["live"]
    assert live["expert_load"] and live["depth_mixes"] and live["kda_decay"]
    html = (tmp_path / "s" / "index.html").read_text()
    assert "Live numbers" in html
    # the expert-load table names its columns: the experts, then the row's total (tokens x top-k)
    assert f"<th>{live['num_experts'] - 1}</th><th>routed (tokens × {live['top_k']})</th>" in html
    assert all(sum(c) == live["tokens"] * live["top_k"] for c in live["expert_load"].values())


def test_serve_binds_loopback(tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "kimik3", "atlas", "tiny", "--out", str(tmp_path / "s"),
                             "--serve", "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        lines = [proc.stdout.readline(), proc.stdout.readline()]
        url = next(line.split()[1] for line in lines if line.startswith("serving"))
        assert url.startswith("http://127.0.0.1:")
        with urllib.request.urlopen(url, timeout=30) as r:
            assert r.status == 200 and b'id="diagram"' in r.read()
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_vendored_katex_matches_its_manifest():
    rows = [line.split() for line in (KATEX / "SHA256SUMS").read_text().splitlines() if line.strip()]
    listed = {name.removeprefix("./"): digest for digest, name in rows}
    assert {"katex.min.js", "katex.min.css", "LICENSE"} <= set(listed)
    on_disk = {p.relative_to(KATEX).as_posix() for p in KATEX.rglob("*") if p.is_file()} - {"SHA256SUMS", "SOURCE.md"}
    assert on_disk == set(listed)
    for name, digest in listed.items():
        assert hashlib.sha256((KATEX / name).read_bytes()).hexdigest() == digest, name
    # the stylesheet's woff2 fonts are all shipped (browsers take the first format they support)
    css = (KATEX / "katex.min.css").read_text()
    assert {f"fonts/{f}" for f in re.findall(r"fonts/(KaTeX_[\w-]+\.woff2)", css)} <= set(listed)
