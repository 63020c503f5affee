"""Code evidence from the live source: where a component's tensors are defined, used and computed.

Sites are found from the live objects (`inspect.getsourcelines` on the classes and functions of the built
model, then `ast` for the exact statements), so a page shows the code as it is in this checkout:

    defines   `self.<attr> = ...` in the owner's `__init__` (the owner module holds the component)
    uses      statements of the owner's other methods that read `self.<attr>`
    class     the component's own class: `__init__` (its tensors) and `forward` (its computation)
    computes  the pure-torch reference op the forward dispatches to
"""

from __future__ import annotations

import ast
import importlib
import inspect
import linecache
import os
import subprocess
import textwrap
from functools import cache, lru_cache
from pathlib import Path

PKG_ROOT = Path(__file__).resolve().parents[1]  # .../kimik3
REPO_ROOT = PKG_ROOT.parents[1]  # the checkout (src/ layout), when there is one
TESTS = REPO_ROOT / "tests"


def display_path(path: str | Path) -> str:
    """Repository-relative path (src/kimik3/...) in a checkout, else package-relative (kimik3/...)."""
    p = Path(path).resolve()
    if (REPO_ROOT / "pyproject.toml").is_file() and p.is_relative_to(REPO_ROOT):
        return p.relative_to(REPO_ROOT).as_posix()
    if p.is_relative_to(PKG_ROOT.parent):
        return p.relative_to(PKG_ROOT.parent).as_posix()
    return p.name


def _file_lines(path: str) -> tuple[str, ...]:
    """The file as it is now (the cache is keyed by modification time: files may change under a long process)."""
    linecache.checkcache(path)  # and inspect's own line cache, which getsourcelines reads
    return _read_lines(path, os.stat(path).st_mtime_ns)


@cache
def _read_lines(path: str, mtime_ns: int) -> tuple[str, ...]:
    return tuple(Path(path).read_text().splitlines())


def _site(kind: str, claim: str, file: str, start: int, end: int) -> dict:
    lines = _file_lines(file)
    return {"kind": kind, "claim": claim, "path": display_path(file), "start": start, "end": end,
            "code": "\n".join(lines[start - 1:end])}


def _class_tree(cls: type) -> tuple[str, int, ast.ClassDef]:
    file = inspect.getsourcefile(cls)
    linecache.checkcache(file)
    lines, first = inspect.getsourcelines(cls)
    tree = ast.parse(textwrap.dedent("".join(lines)))
    node = tree.body[0]
    assert isinstance(node, ast.ClassDef) and node.name == cls.__name__, (cls, node)
    return file, first, node


def _reads_self(node: ast.AST, attr: str) -> bool:
    return any(isinstance(n, ast.Attribute) and n.attr == attr and isinstance(n.value, ast.Name)
               and n.value.id == "self" for n in ast.walk(node))


def _innermost_statements(fn: ast.FunctionDef, attr: str) -> list[ast.stmt]:
    """The smallest statements of `fn` that read self.<attr> (a compound statement only via its header)."""
    found = []

    def visit(stmts):
        for s in stmts:
            bodies = [getattr(s, f) for f in ("body", "orelse", "finalbody") if isinstance(getattr(s, f, None), list)]
            if bodies and not isinstance(s, ast.FunctionDef):
                header = [getattr(s, f) for f in ("test", "iter", "items") if getattr(s, f, None) is not None]
                if any(_reads_self(h, attr) for h in header if isinstance(h, ast.AST)):
                    found.append(s)
                for b in bodies:
                    visit(b)
            elif _reads_self(s, attr):
                found.append(s)

    visit(fn.body)
    return found


def owner_sites(owner: type, attrs: tuple[str, ...], what: str) -> list[dict]:
    """defines/uses sites of `attrs` in the owner class (`what` names the component in the claims)."""
    file, first, node = _class_tree(owner)
    off = first - 1
    sites = []
    for fn in [n for n in node.body if isinstance(n, ast.FunctionDef)]:
        for attr in attrs:
            if fn.name == "__init__":
                for s in ast.walk(fn):
                    if isinstance(s, (ast.Assign, ast.AnnAssign)) and any(
                            isinstance(t, ast.Attribute) and t.attr == attr and isinstance(t.value, ast.Name)
                            and t.value.id == "self" for t in (s.targets if isinstance(s, ast.Assign) else [s.target])):
                        sites.append(_site("defines", f"{owner.__name__}.__init__ creates self.{attr} ({what})",
                                           file, s.lineno + off, s.end_lineno + off))
            else:
                for s in _innermost_statements(fn, attr):
                    end = s.lineno if isinstance(s, (ast.If, ast.For, ast.While, ast.With)) else s.end_lineno
                    sites.append(_site("uses", f"{owner.__name__}.{fn.name} reads self.{attr}", file,
                                       s.lineno + off, end + off))
    # one site per line range (two attrs read by one statement give one excerpt)
    seen, out = set(), []
    for s in sorted(sites, key=lambda s: (s["kind"] != "defines", s["start"])):
        if (s["kind"], s["start"], s["end"]) not in seen:
            seen.add((s["kind"], s["start"], s["end"]))
            out.append(s)
    return out


def class_sites(cls: type) -> list[dict]:
    """The class's own __init__ and forward."""
    file, first, node = _class_tree(cls)
    out = []
    for fn in node.body:
        if isinstance(fn, ast.FunctionDef) and fn.name in ("__init__", "forward"):
            start = (fn.decorator_list[0].lineno if fn.decorator_list else fn.lineno) + first - 1
            kind = "class" if fn.name == "__init__" else "computes"
            claim = (f"{cls.__name__}.__init__ creates its tensors" if fn.name == "__init__"
                     else f"{cls.__name__}.forward computes it")
            out.append(_site(kind, claim, file, start, fn.end_lineno + first - 1))
    return out


def function_site(spec: str) -> dict:
    """'module:function' -> the function's whole source."""
    mod, name = spec.split(":")
    fn = getattr(importlib.import_module(mod), name)
    file = inspect.getsourcefile(fn)
    linecache.checkcache(file)
    lines, first = inspect.getsourcelines(fn)
    what = " (the pure-torch reference)" if mod.endswith(".reference") else ""
    return _site("computes", f"{name} in {mod}{what}", file, first, first + len(lines) - 1)


@lru_cache(maxsize=1)
def _test_index() -> tuple[tuple[str, str, frozenset], ...]:
    """(test file, test function, names it mentions) for every test function under tests/ (a checkout only)."""
    if not TESTS.is_dir():
        return ()
    out = []
    for path in sorted(TESTS.rglob("test_*.py")):
        try:
            tree = ast.parse(path.read_text())
        except SyntaxError:
            continue
        rel = path.relative_to(REPO_ROOT).as_posix()
        for node in tree.body:
            fns = [node] if isinstance(node, ast.FunctionDef) else (
                [n for n in node.body if isinstance(n, ast.FunctionDef)] if isinstance(node, ast.ClassDef) else [])
            for fn in fns:
                if fn.name.startswith("test"):
                    names = frozenset(n.id if isinstance(n, ast.Name) else n.attr for n in ast.walk(fn)
                                      if isinstance(n, (ast.Name, ast.Attribute)))
                    out.append((rel, fn.name, names))
    return tuple(out)


def covering_tests(names: set[str], limit: int = 12) -> list[str]:
    """Test ids (file::function) whose body names one of `names` (a static scan of tests/)."""
    hits = [f"{f}::{fn}" for f, fn, used in _test_index() if used & names]
    return hits[:limit]


def revision() -> str:
    """`git rev-parse --short HEAD` (+ ' (modified)' for a dirty tree) in a checkout; else the package version
    (bare: the pages print it after the word kimik3)."""
    import kimik3

    try:
        head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                              text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO_ROOT,
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
        return head + (" (modified)" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return kimik3.__version__
