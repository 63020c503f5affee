"""The diagram: an SVG column laid out here (no graph library: a column with a repeat frame needs none).

Data flows top to bottom. The decoder layer is drawn once inside a frame with a `×N` badge and its variants;
alternatives that differ by layer (KDA | MLA, dense MLP | latent MoE) sit side by side with their layer
counts. The AttnRes store is a dashed rail on the left: the running sum is stored there at block starts and
every depth mix (attention input, FFN input, output) reads it. The vision tower is a side column whose
projected tokens enter the embedding (dotted). Boxes are `<g>` elements carrying the component id; their text
ignores the pointer, so a click always reaches the group (a browser-only bug otherwise).
"""

from __future__ import annotations

from dataclasses import dataclass
from html import escape

BOX_H, GAP, X0, COL_W, RAIL_X = 46, 30, 70, 560, 34
SIDE_X, SIDE_W = 680, 220


@dataclass
class Box:
    id: str
    x: float
    y: float
    w: float
    h: float = BOX_H


def _subtitle(node: dict) -> str:
    if not node.get("leaf"):
        return {"residual": "add; store at block starts", "combine": "weighted sum, fp32"}.get(node["id"], "")
    inst = node["instances"]
    if inst.get("experts_per_layer"):
        layers = inst["stored"] // inst["experts_per_layer"]
        return f"{node['per_instance']:,} × {inst['experts_per_layer']:,} × {layers}"
    if inst["stored"] > 1:
        return f"{node['per_instance']:,} × {inst['stored']}"
    return f"{node['total']:,}"


class _Svg:
    def __init__(self, nodes: dict):
        self.nodes, self.parts, self.boxes = nodes, [], []

    def box(self, cid: str, x: float, y: float, w: float, badge: str = "") -> Box | None:
        if cid not in self.nodes:
            return None
        n = self.nodes[cid]
        b = Box(cid, x, y, w)
        self.boxes.append(b)
        sub = _subtitle(n)
        self.parts.append(
            f'<g class="node k-{n["kind"]}" data-id="{cid}" tabindex="0" role="button" '
            f'aria-label="{escape(n["title"])}"><title>{escape(n["title"])}: {escape(n["summary"])}</title>'
            f'<rect x="{x}" y="{y}" width="{w}" height="{BOX_H}" rx="6"/>'
            f'<text class="t" x="{x + w / 2}" y="{y + 19}">{escape(n["title"])}</text>'
            f'<text class="s" x="{x + w / 2}" y="{y + 36}">{escape(badge or sub)}</text></g>')
        return b

    def edge(self, x: float, y0: float, y1: float, label: str = "", cls: str = "flow", tensor: str = "") -> None:
        self.parts.append(f'<line class="e {cls}" x1="{x}" y1="{y0}" x2="{x}" y2="{y1 - 2}" marker-end="url(#arrow)"/>')
        text = f'<text class="el" x="{x + 8}" y="{(y0 + y1) / 2 + 4}">{escape(label)}</text>'
        if label and tensor:  # the tensor's own page
            text = f'<a class="tensor" href="t/{tensor}.html" data-tensor="{tensor}">{text}</a>'
        if label:
            self.parts.append(text)

    def route(self, points: list[tuple[float, float]], label: str = "", cls: str = "flow") -> None:
        """An edge along axis-parallel segments through `points`, the arrow at the last one (into a box's top)."""
        for k, ((xa, ya), (xb, yb)) in enumerate(zip(points, points[1:])):
            end = k == len(points) - 2
            self.parts.append(f'<line class="e {cls}" x1="{xa}" y1="{ya}" x2="{xb}" y2="{yb - 2 if end else yb}"'
                              + (' marker-end="url(#arrow)"/>' if end else "/>"))
        if label:
            (xa, ya), (_, yb) = points[0], points[1]
            self.parts.append(f'<text class="el" x="{xa + 8}" y="{(ya + yb) / 2 + 4}">{escape(label)}</text>')

    def hline(self, x0: float, x1: float, y: float, cls: str) -> None:
        self.parts.append(f'<line class="e {cls}" x1="{x0}" y1="{y}" x2="{x1}" y2="{y}"/>')

    def text(self, x: float, y: float, s: str, cls: str, anchor: str = "start") -> None:
        self.parts.append(f'<text class="{cls}" x="{x}" y="{y}" text-anchor="{anchor}">{escape(s)}</text>')


def _shape_of(nodes: dict, cid: str, role: str = "out") -> str:
    for s in nodes.get(cid, {}).get("shapes", []):
        if s["role"] == role:
            return f"{s['name']} {s['label']}"
    return ""


def diagram(atlas: dict) -> tuple[str, list[Box]]:
    """(SVG markup, the boxes drawn) for an atlas dict."""
    nodes, cfg = atlas["nodes"], atlas["config"]
    g = _Svg(nodes)
    cx = X0 + COL_W / 2
    y = 20
    g.box("embed", X0 + 110, y, COL_W - 220)
    y += BOX_H
    g.edge(cx, y, y + GAP + 12, _shape_of(nodes, "embed"), tensor="h0")
    y += GAP + 12

    frame_top = y
    y += 30 + 16 * len(atlas["variants"])
    for k, v in enumerate(atlas["variants"]):
        what = f"{v['attention'].upper()} + {'latent MoE' if v['ffn'] == 'moe' else 'dense MLP'}"
        start = ", starts an AttnRes block" if v["starts_block"] else ""
        g.text(X0 + 14, frame_top + 40 + 16 * k, f"{what}{start}: {v['count']} layer{'s' * (v['count'] != 1)}",
               "variant")
    mixes_y = []
    mixes_y.append(y)
    g.box("attn_mix", X0 + 110, y, COL_W - 220)
    y += BOX_H
    g.edge(cx, y, y + GAP, _shape_of(nodes, "attn_mix"), tensor="a")
    y += GAP
    g.box("input_norm", X0 + 110, y, COL_W - 220)
    y += BOX_H
    kinds = [k for k in ("kda", "mla") if k in nodes and nodes[k].get("rows")]
    w = (COL_W - 20 * (len(kinds) - 1)) / max(len(kinds), 1)
    centers = [X0 + j * (w + 20) + w / 2 for j in range(len(kinds))]
    if len(kinds) > 1:  # alternatives side by side: the edge forks to each and joins below them
        g.edge(cx, y, y + GAP / 2 + 2, "x [B, T, D]", tensor="x_attn")
        for xc in centers:
            g.route([(cx, y + GAP / 2), (xc, y + GAP / 2), (xc, y + GAP)])
    else:
        g.edge(cx, y, y + GAP, "x [B, T, D]", tensor="x_attn")
    y += GAP
    for j, k in enumerate(kinds):
        n = nodes[k]["instances"]["stored"]
        g.box(k, X0 + j * (w + 20), y, w, f"{n} layers, {nodes[k]['per_instance']:,} each")
    y += BOX_H
    if len(kinds) > 1:
        for xc in centers:
            g.route([(xc, y), (xc, y + GAP / 2), (cx, y + GAP / 2), (cx, y + GAP / 2 + 2)])
        g.edge(cx, y + GAP / 2, y + GAP, "attn(x) [B, T, D]")
    else:
        g.edge(cx, y, y + GAP, "attn(x) [B, T, D]")
    y += GAP
    store_y = y + BOX_H / 2
    g.box("residual", X0 + 110, y, COL_W - 220)
    y += BOX_H
    g.edge(cx, y, y + GAP, "s [B, T, D]", tensor="s")
    y += GAP
    mixes_y.append(y)
    g.box("ffn_mix", X0 + 110, y, COL_W - 220)
    y += BOX_H
    g.edge(cx, y, y + GAP, _shape_of(nodes, "ffn_mix"), tensor="m")
    y += GAP
    g.box("post_norm", X0 + 110, y, COL_W - 220)
    y += BOX_H
    g.edge(cx, y, y + GAP, "x [B, T, D]", tensor="x_ffn")
    y += GAP
    y = _ffn(g, nodes, y, cx)
    frame_bottom = y + 14
    g.parts.insert(0, f'<rect class="frame" x="{X0 - 16}" y="{frame_top}" width="{COL_W + 32}" '
                      f'height="{frame_bottom - frame_top}" rx="10"/>'
                      f'<a class="frame-link" href="c/layers.html"><text class="ftitle" x="{X0 - 4}" '
                      f'y="{frame_top + 20}">decoder layer, drawn once</text></a>'
                      f'<g class="badge"><rect x="{X0 + COL_W - 60}" y="{frame_top - 13}" width="76" height="26" '
                      f'rx="13"/><text x="{X0 + COL_W - 22}" y="{frame_top + 5}" text-anchor="middle">'
                      f'×{cfg["layers"]}</text></g>')
    y = frame_bottom
    g.edge(cx, y, y + GAP, "s [B, T, D]")
    y += GAP
    mixes_y.append(y)
    g.box("out_mix", X0 + 110, y, COL_W - 220)
    y += BOX_H
    g.edge(cx, y, y + GAP, _shape_of(nodes, "out_mix"))
    y += GAP
    g.box("final_norm", X0 + 110, y, COL_W - 220)
    y += BOX_H
    g.edge(cx, y, y + GAP, "x [B, T, D]")
    y += GAP
    g.box("lm_head", X0 + 110, y, COL_W - 220)
    y += BOX_H
    g.edge(cx, y, y + GAP, _shape_of(nodes, "lm_head"), tensor="logits")
    y += GAP + 10

    # the AttnRes rail: stored at block starts (from the running-sum box), read by the three mixes
    g.parts.append(f'<line class="e rail" x1="{RAIL_X}" y1="{mixes_y[0] + BOX_H / 2}" x2="{RAIL_X}" '
                   f'y2="{mixes_y[-1] + BOX_H / 2}"/>')
    g.hline(RAIL_X, X0 + 110, store_y, "rail")
    for my in mixes_y:
        g.hline(RAIL_X, X0 + 110, my + BOX_H / 2, "rail")
    g.parts.append(f'<a class="tensor" href="t/b.html" data-tensor="b"><text class="rl" transform="translate('
                   f'{RAIL_X - 8},{(store_y + mixes_y[1]) / 2 + 60}) rotate(-90)">'
                   'stored block sums b [M, B, T, D]</text></a>')
    width = X0 + COL_W + 30
    if "vision" in nodes:
        width = _vision(g, nodes, cfg)
    legend_y = y
    for k, (kind, label) in enumerate(atlas["kinds"].items()):
        lx = 20 + (k % 3) * 190
        ly = legend_y + (k // 3) * 24
        g.parts.append(f'<g class="legend k-{kind}"><rect x="{lx}" y="{ly}" width="18" height="14" rx="3"/>'
                       f'<text x="{lx + 26}" y="{ly + 12}">{escape(label)}</text></g>')
    ly = legend_y + 56
    for k, (cls, label) in enumerate((("flow", "data flow, shapes with named axes"),
                                      ("rail", "AttnRes store / depth-mix reads"), ("aux", "auxiliary input"))):
        lx = 20 + k * 260
        g.parts.append(f'<line class="e {cls}" x1="{lx}" y1="{ly}" x2="{lx + 30}" y2="{ly}"/>'
                       f'<text class="lg" x="{lx + 36}" y="{ly + 4}">{label}</text>')
    height = ly + 20
    svg = (f'<svg id="diagram" xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {width} {height}" '
           f'width="{width}" height="{height}" role="img" aria-label="architecture diagram">'
           '<defs><marker id="arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" markerHeight="7" '
           'orient="auto-start-reverse"><path d="M 0 0 L 10 5 L 0 10 z"/></marker></defs>'
           + "".join(g.parts) + "</svg>")
    return svg, g.boxes


def _ffn(g: _Svg, nodes: dict, y: float, cx: float) -> float:
    """Dense MLP (left) beside the latent MoE frame (right); returns the y below both."""
    has_dense = "dense_mlp" in nodes and nodes["dense_mlp"].get("rows")
    has_moe = "router" in nodes and nodes["router"].get("rows")
    if has_dense and not has_moe:
        g.box("dense_mlp", X0 + 110, y, COL_W - 220)
        return y + BOX_H
    mx, dense_x = X0, X0 - 6 + 158 / 2
    if has_dense:  # beside the MoE frame: x forks to it from the edge above; its output joins the frame's
        n = nodes["dense_mlp"]["instances"]["stored"]
        g.box("dense_mlp", X0 - 6, y + 40, 158, f"{n} layer{'s' * (n != 1)}, {nodes['dense_mlp']['per_instance']:,}")
        g.route([(cx, y - GAP / 2), (dense_x, y - GAP / 2), (dense_x, y + 40)])
        mx = X0 + 164
    mw = X0 + COL_W - mx
    top = y
    y += 34
    col_w = mw - 150
    ix = mx + 14
    router_x = ix + (col_w - 14) / 2
    g.route([(cx, top - GAP / 2), (router_x, top - GAP / 2), (router_x, y)])
    chain = ["router", "latent_down", "experts", "combine", "latent_norm", "latent_up"]
    labels = {"router": "idx, w [N, A]", "latent_down": "z [N, L]", "experts": "e_i(z) [N, A, L]",
              "combine": "r [N, L]", "latent_norm": "r [N, L]"}
    for k, cid in enumerate(chain):
        if cid not in nodes:
            continue
        g.box(cid, ix, y, col_w - 14)
        y += BOX_H
        if k < len(chain) - 1:
            tensor = {"latent_down": "z", "combine": "r"}.get(cid, "")
            g.edge(ix + (col_w - 14) / 2, y, y + 22, labels.get(cid, ""), tensor=tensor)
            y += 22
    sx, sy, sw = mx + col_w + 12, top + 34 + (BOX_H + 22) * 2, mw - col_w - 24
    if g.box("shared_expert", sx, sy, sw) is not None:  # on x itself, beside the latent path; the sum leaves below
        g.route([(sx + sw / 2, top + 34), (sx + sw / 2, sy)], "x")
        g.route([(sx + sw / 2, sy + BOX_H), (sx + sw / 2, y + 14)], "+")
    g.edge(router_x, y, y + 14)
    y += 14
    if has_dense:
        g.route([(dense_x, top + 40 + BOX_H), (dense_x, y)], "mlp(x)")
    g.parts.insert(0, f'<rect class="frame moe" x="{mx}" y="{top}" width="{mw}" height="{y - top}" rx="8"/>'
                      f'<a class="frame-link" href="c/moe.html"><text class="ftitle" x="{mx + 10}" y="{top + 20}">'
                      'latent MoE '
                      f'({nodes["router"]["instances"]["stored"]} layers)</text></a>')
    return y


def _vision(g: _Svg, nodes: dict, cfg: dict) -> float:
    y = 20
    x = SIDE_X
    for k, cid in enumerate(("vision_patch", "vision_block", "vision_norm", "projector")):
        badge = ""
        if cid == "vision_block":
            n = nodes[cid]["instances"]["stored"]
            badge = f"×{n} blocks, {nodes[cid]['per_instance']:,} each"
        g.box(cid, x, y, SIDE_W, badge)
        y += BOX_H
        if k < 3:
            g.edge(x + SIDE_W / 2, y, y + 24, "", "aux")
            y += 24
    # projected image tokens replace media-pad embeddings
    g.parts.append(f'<path class="e aux" d="M {x} {y - BOX_H / 2} H {X0 + COL_W + 30} V {20 + BOX_H / 2} '
                   f'H {X0 + COL_W - 108}" fill="none" marker-end="url(#arrow)"/>')
    g.text(x, y + 18, "image tokens [P/4, D] -> media pads", "el")
    return SIDE_X + SIDE_W + 20
