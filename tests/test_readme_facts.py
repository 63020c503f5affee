"""Facts of the docs that must match the code: docs/model.md's `kimik3 params` block is the real table, not a summary
of it."""

from __future__ import annotations

from kimik3.atlas.params import COMPONENTS
from tests.test_readme import page_blocks


def test_params_block_is_the_whole_table():
    block = next(b for b in page_blocks("docs/model.md") if b.marker == ("output of", "kimik3 params"))
    rows = {line.strip("│ ").split("│")[0].strip() for line in block.code.splitlines() if line.startswith("│")}
    assert set(COMPONENTS) | {"text model", "total", "active (card: no embedding)"} <= rows
