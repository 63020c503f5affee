"""How the suite is laid out: device tests (marked `gpu`, run on the device machine) are named for it: the test, or
its file, ends in `_gpu`; a file of tests ending in `_gpu` holds device tests only. Checked on the sources (AST),
so an unmarked `_gpu` test or an unnamed device test fails here, on the CPU."""

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def _is_gpu_mark(node: ast.AST, aliases: set[str]) -> bool:
    """`pytest.mark.gpu`, a name bound to it, or a list / call holding one (pytestmark = [...], a param's marks)."""
    if isinstance(node, ast.Attribute):
        return node.attr == "gpu" and isinstance(node.value, ast.Attribute) and node.value.attr == "mark"
    if isinstance(node, ast.Name):
        return node.id in aliases
    if isinstance(node, (ast.List, ast.Tuple)):
        return any(_is_gpu_mark(e, aliases) for e in node.elts)
    return False


def device_tests(path: Path) -> tuple[set[str], set[str]]:
    """(device tests, other tests) of a test file, by function name."""
    tree = ast.parse(path.read_text())
    aliases, whole = set(), False
    for node in tree.body:
        if isinstance(node, ast.Assign):
            names = [t.id for t in node.targets if isinstance(t, ast.Name)]
            if _is_gpu_mark(node.value, aliases):
                aliases.update(n for n in names if n != "pytestmark")
                whole = whole or "pytestmark" in names
    device, other = set(), set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
            marked = whole or any(_is_gpu_mark(d, aliases) for d in node.decorator_list)
            (device if marked else other).add(node.name)
    return device, other


def test_device_tests_are_named_for_the_device():
    bad = []
    for path in sorted(TESTS.rglob("test_*.py")):
        device, other = device_tests(path)
        gpu_file = path.stem.endswith("_gpu")
        bad += [f"{path.relative_to(TESTS)}::{t} is marked gpu" for t in device if not (gpu_file or t.endswith("_gpu"))]
        bad += [f"{path.relative_to(TESTS)}::{t} is not marked gpu" for t in other if gpu_file or t.endswith("_gpu")]
    assert not bad, bad


def test_the_check_reads_marks_as_pytest_does():
    device, other = device_tests(TESTS / "ops" / "test_shortconv.py")
    assert "test_decode_matches_reference_gpu" in device and "test_seq_reference_matches_float64_convolution" in other
    assert device_tests(TESTS / "ops" / "test_kda_gpu.py")[1] == set()  # pytestmark marks the whole file
