"""The import direction of design.md: config <- ops <- model <- checkpoint <- inference <- serve."""

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "src" / "kimik3"

# what each subpackage may import from kimik3 (itself always allowed)
ALLOWED = {
    "config": set(),
    "presets": {"config"},
    "ops": {"config"},
    "model": {"config", "ops"},
    "checkpoint": {"config", "ops", "model", "presets"},
    "atlas": {"config", "ops", "model", "checkpoint"},
    "tokenizer": {"config"},
    "inference": {"config", "ops", "model", "checkpoint", "tokenizer", "presets"},
    "serve": {"config", "inference", "tokenizer"},
    "train": {"config", "ops", "model", "checkpoint", "tokenizer", "distributed", "presets"},
    "distributed": {"config", "ops", "model", "checkpoint"},
    "vision": {"config", "ops", "model"},
}
FORBIDDEN_EXTERNAL = {"model": {"triton", "torch.distributed"}, "config": {"torch"}}


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_import_direction():
    bad = []
    for path in PKG.rglob("*.py"):
        rel = path.relative_to(PKG)
        area = rel.parts[0].removesuffix(".py")
        if area in ("cli", "__init__", "__main__"):
            continue
        assert area in ALLOWED, f"new area {area}: add it to ALLOWED"
        for name in _imports(path):
            parts = name.split(".")
            if parts[0] in ("tests", "bench"):
                bad.append((str(rel), name))
            if parts[0] == "kimik3" and len(parts) > 1 and parts[1] != area and parts[1] not in ALLOWED[area]:
                bad.append((str(rel), name))
            if any(name == f or name.startswith(f + ".") for f in FORBIDDEN_EXTERNAL.get(area, ())):
                bad.append((str(rel), name))
    assert not bad, bad
