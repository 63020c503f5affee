"""The diagram's geometry: every box is connected (an edge arrives at or leaves its border); the dense MLP and the
shared expert, which sit beside the MoE chain, have both an input and an output."""

from __future__ import annotations

import re

import pytest

from kimik3.atlas.build import build_atlas
from kimik3.atlas.layout import diagram
from kimik3.presets import load_config

LINE = re.compile(r'<line class="e (\w+)" x1="([\d.]+)" y1="([\d.]+)" x2="([\d.]+)" y2="([\d.]+)"')


def _touching(box, lines):
    """(edges ending on the box's top, edges starting at its bottom): vertical segments only (arrows come in from
    above and leave below)."""
    def on(x, y, edge_y):
        return box.x - 1 <= x <= box.x + box.w + 1 and abs(y - edge_y) <= 3
    ins = [ln for ln in lines if ln[0] == ln[2] and on(ln[2], ln[3], box.y)]
    outs = [ln for ln in lines if ln[0] == ln[2] and on(ln[0], ln[1], box.y + box.h)]
    return ins, outs


@pytest.mark.parametrize("name", ["k3", "tiny"])
def test_every_box_has_an_edge_and_side_boxes_have_both(name):
    atlas = build_atlas(load_config(name), name=name, built_at="2026-01-01 00:00 UTC")
    svg, boxes = diagram(atlas)
    lines = [tuple(float(v) for v in m.groups()[1:]) for m in LINE.finditer(svg)]
    rails = {m.group(1) for m in LINE.finditer(svg)}
    assert "flow" in rails
    loose = [b.id for b in boxes if b.id not in ("out_mix",) and not any(_touching(b, lines))]
    assert loose == [], f"boxes with no edge: {loose}"
    for cid in ("dense_mlp", "shared_expert"):
        (box,) = [b for b in boxes if b.id == cid]
        ins, outs = _touching(box, lines)
        assert ins and outs, f"{cid}: in {ins}, out {outs}"
