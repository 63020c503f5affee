"""Write the static site: index.html (diagram), c/<id>.html per component, diff.html, atlas.json, assets.

Jinja2 templates (autoescaped, StrictUndefined: a missing field fails the build), Pygments for code excerpts
at their real line numbers, KaTeX from the vendored copy. Every link is relative, so the folder works from
file:// and offline.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from jinja2 import Environment, FileSystemLoader, StrictUndefined, select_autoescape
from markupsafe import Markup
from pygments import highlight
from pygments.formatters import HtmlFormatter
from pygments.lexers import PythonLexer

from kimik3.atlas.layout import diagram

HERE = Path(__file__).resolve().parent
_FALLBACK_FONTS = re.compile(r',url\(fonts/[\w-]+\.(?:woff|ttf)\) format\("(?:woff|truetype)"\)')
FORMATTER_STYLE = "friendly"


def _code(site: dict) -> Markup:
    fmt = HtmlFormatter(linenos="inline", linenostart=site["start"], cssclass="hl", style=FORMATTER_STYLE)
    return Markup(highlight(site["code"] + "\n", PythonLexer(), fmt))


def _n(x) -> str:
    return f"{x:,}" if isinstance(x, int) else str(x)


def _bytes(n: int) -> str:
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:,.2f} {unit}"
    return f"{n:,} B"


def _short(n: int) -> str:
    for unit, size in (("T", 10**12), ("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return str(n)


def environment() -> Environment:
    env = Environment(loader=FileSystemLoader(HERE / "templates"), autoescape=select_autoescape(["html", "j2"]),
                      undefined=StrictUndefined, trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True)
    env.filters.update(n=_n, bytes=_bytes, short=_short, code=_code)
    return env


def check_replaceable(out: Path) -> None:
    """Refuse to write over a folder that holds files but is not an atlas (no atlas.json): the user's own."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"{out}: exists and is not a folder")
    if out.is_dir() and any(out.iterdir()) and not (out / "atlas.json").is_file():
        raise FileExistsError(f"{out}: a non-empty folder that is not an atlas (no atlas.json); "
                              "choose another --out or pass --force to replace it")


def write_site(atlas: dict, out: Path, *, diff: dict | None = None, live: dict | None = None) -> list[Path]:
    """Render `atlas` (and optional diff / live numbers) into `out`; returns the files written."""
    out = Path(out)
    (out / "c").mkdir(parents=True, exist_ok=True)
    (out / "t").mkdir(parents=True, exist_ok=True)
    static = out / "static"
    if static.exists():
        shutil.rmtree(static)
    shutil.copytree(HERE / "static", static)
    shutil.copytree(HERE / "vendor" / "katex", static / "katex")
    css = static / "katex" / "katex.min.css"  # only the .woff2 fonts ship: drop the .woff/.ttf fallbacks it names
    css.write_text(_FALLBACK_FONTS.sub("", css.read_text()))
    env = environment()
    svg, boxes = diagram(atlas)
    nodes = atlas["nodes"]
    ctx = {"a": atlas, "nodes": nodes, "order": atlas["order"], "diff": diff, "live": live,
           "hl_css": HtmlFormatter(style=FORMATTER_STYLE).get_style_defs(".hl")}
    written = []

    def page(template: str, path: Path, **kw) -> None:
        path.write_text(env.get_template(template).render(**ctx, **kw))
        written.append(path)

    page("index.html.j2", out / "index.html", root="", svg=Markup(svg), boxes=boxes)
    for cid in atlas["order"]:
        page("component.html.j2", out / "c" / f"{cid}.html", root="../", node=nodes[cid])
    for tensor in atlas["tensors"]:
        page("tensor.html.j2", out / "t" / f"{tensor['id']}.html", root="../", tensor=tensor)
    if diff is not None:
        page("diff.html.j2", out / "diff.html", root="")
    data = dict(atlas, live=live) if live is not None else atlas
    (out / "atlas.json").write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    written.append(out / "atlas.json")
    if diff is not None:
        (out / "diff.json").write_text(json.dumps(diff, indent=1, sort_keys=True) + "\n")
    return written
