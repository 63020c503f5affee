"""The import direction of design.md, checked on every file's real imports (absolute and relative).

Inside the package the rooms form a fan, not a chain:

    config <- ops <- model <- {quant, placement} (transforms of a built model) <- {checkpoint, inference, atlas}
        <- distributed <- train <- cli
    tokenizer and vision (preprocessing) sit beside ops; serve sits on inference + tokenizer; lora (adapters over the
    frozen base) sits on model + checkpoint and under train and the engine; the model never imports lora
    hf (transformers classes, lm-eval model) sits on model, checkpoint, tokenizer and inference; only cli imports it

Outside it: nothing imports `tests/` but `tests/`; nothing in `src/` imports `bench/` or `tools/`; `bench/` and
`tools/` never import `tests/`.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "src" / "kimik3"

# what each subpackage may import from kimik3 (itself always allowed)
ALLOWED = {
    "config": set(),
    "presets": {"config"},
    "testing": set(),
    "ops": set(),
    "model": {"config", "ops"},
    "quant": {"config", "ops", "model"},
    # where the routed experts live (host memory and a device cache): the loader places them as it reads
    "placement": {"config", "ops", "model"},
    # checkpoint writes the tokenizer files (tokenizer_config.json, the GGUF vocabulary) from kimik3.tokenizer
    "checkpoint": {"config", "ops", "model", "presets", "quant", "placement", "tokenizer"},
    "atlas": {"config", "ops", "model", "checkpoint", "presets", "tokenizer"},
    "tokenizer": {"config"},
    "vision": {"config", "ops", "model"},
    # the engine serves LoRA adapters (inference/engine -> lora.serving); lora never imports inference
    "inference": {"config", "ops", "model", "checkpoint", "tokenizer", "presets", "quant", "placement", "lora"},
    "serve": {"config", "ops", "model", "checkpoint", "inference", "tokenizer", "presets", "vision"},
    "distributed": {"config", "ops", "model", "checkpoint"},
    # train/draft.py trains the speculative drafter of inference/spec (a model that serves inference)
    "train": {"config", "ops", "model", "checkpoint", "tokenizer", "distributed", "presets", "lora", "inference"},
    "hf": {"config", "ops", "model", "checkpoint", "tokenizer", "inference", "presets"},
    "lora": {"config", "ops", "model", "checkpoint"},
}
TOP_LEVEL = ("cli", "__init__", "__main__")  # the faces: may import anything in the package
FORBIDDEN_EXTERNAL = {"model": {"triton", "torch.distributed"}, "config": {"torch"}}
# the hf and eval extras' libraries: only kimik3.hf (and the cli, lazily) may import them; the core never does
HF_LIBRARIES = ("transformers", "peft", "lm_eval", "trl")
# shipped into checkpoint folders for transformers' trust_remote_code: standalone (test below); kimik3.hf extends it
REMOTE_CODE = {"tokenizer/tokenization_kimi.py", "demo/k3-shakespeare/tokenization_kimi.py"}


def _module_name(path: Path) -> list[str]:
    """Dotted parts of the module a file defines, e.g. src/kimik3/ops/kda/fla.py -> [kimik3, ops, kda, fla]."""
    base = path.relative_to(PKG.parent if path.is_relative_to(PKG) else ROOT).with_suffix("")  # src/ or root
    parts = list(base.parts)
    return parts[:-1] if parts[-1] == "__init__" else parts


def imports(path: Path) -> set[str]:
    """Every module a file imports, relative imports resolved against the file's own package."""
    names = set()
    package = _module_name(path) if path.name == "__init__.py" else _module_name(path)[:-1]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                names.add(node.module or "")
                continue
            anchor = package[: len(package) - (node.level - 1)]
            base = ".".join(anchor + ([node.module] if node.module else []))
            names.add(base)
            if not node.module:  # `from . import x` imports the submodules x
                names.update(f"{base}.{a.name}" for a in node.names)
    return names


def test_relative_imports_are_resolved():
    # `from . import fla` in a package's __init__ and `from ..model import X` in a module both resolve
    assert {"kimik3.ops.kda", "kimik3.ops.kda.fla"} <= imports(PKG / "ops" / "kda" / "__init__.py")
    assert "kimik3.tokenizer.bpe" in imports(PKG / "tokenizer" / "chat.py")


def test_import_direction_inside_the_package():
    bad = []
    for path in PKG.rglob("*.py"):
        rel = path.relative_to(PKG)
        area = rel.parts[0].removesuffix(".py")
        if area in TOP_LEVEL or str(rel) in REMOTE_CODE:
            continue
        assert area in ALLOWED, f"new area {area}: add it to ALLOWED (and to design.md's import direction)"
        for name in imports(path):
            parts = name.split(".")
            if parts[0] in ("tests", "bench", "tools", "recipes"):
                bad.append((str(rel), name))
            if parts[0] == "kimik3" and len(parts) > 1 and parts[1] != area and parts[1] not in ALLOWED[area]:
                bad.append((str(rel), name))
            if any(name == f or name.startswith(f + ".") for f in FORBIDDEN_EXTERNAL.get(area, ())):
                bad.append((str(rel), name))
            if area != "hf" and parts[0] in HF_LIBRARIES:
                bad.append((str(rel), name))
    assert not bad, bad


def test_outer_rooms():
    """tests/ is imported only by tests/; src/ never imports bench/ or tools/; bench/ and tools/ not each other."""
    rules = {"bench": {"tests", "tools"}, "tools": {"tests", "bench"}, "recipes": {"tests", "bench", "tools"}}
    bad = []
    for room, forbidden in rules.items():
        for path in (ROOT / room).rglob("*.py") if (ROOT / room).exists() else ():
            bad += [(str(path.relative_to(ROOT)), n) for n in imports(path) if n.split(".")[0] in forbidden]
    for path in (ROOT / "tests").rglob("*.py"):
        bad += [(str(path.relative_to(ROOT)), n) for n in imports(path) if n.split(".")[0] in ("bench", "tools")]
    assert not bad, bad


def test_remote_code_is_standalone():
    """The tokenizer class a checkpoint folder carries runs where kimik3 is not installed."""
    for rel in REMOTE_CODE:
        assert not [n for n in imports(PKG / rel) if n.split(".")[0] in ("kimik3", "tests")], rel
