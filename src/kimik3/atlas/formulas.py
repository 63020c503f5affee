"""Formulas (TeX for KaTeX) and named-axis shapes per component, with every number taken from the config.

A formula symbol that is itself a diagram box is wrapped as `\\htmlData{node=<id>}{...}`; the page turns
those into links to the box. Shapes are lists of (axis letter, size) with size None for the free axes
(B batch, T tokens, N = B*T flattened tokens, P image patches): tests compare them with the shapes a real
forward produces.
"""

from __future__ import annotations

from kimik3.config import K3Config

Shape = dict  # {"name": str, "role": "in" | "out" | "inner", "axes": [[letter, size | None], ...]}


def _n(tex_id: str, body: str) -> str:
    return rf"\htmlData{{node={tex_id}}}{{{body}}}"


def _shape(name: str, role: str, *axes) -> Shape:
    return {"name": name, "role": role, "axes": [[a, s] for a, s in axes]}


def formulas(cfg: K3Config) -> dict[str, list[str]]:
    """id -> TeX lines (display math, one per line)."""
    t = cfg.text
    kd, ml, mo = t.kda, t.mla, t.moe
    lb = f"{-t.kda.gate_lower_bound:g}"
    b1, b2 = f"{t.situ_beta:g}", f"{t.situ_linear_beta:g}"
    mix = [
        r"h = \sum_{j=0}^{M} \mathrm{softmax}_j\!\left(w^\top \frac{v_j}{\mathrm{rms}(v_j)}\right) v_j",
        r"v = [b_0, \dots, b_{M-1}, s],\quad w = g \odot p \in \mathbb{R}^{" + str(t.hidden_size) + "}",
    ]
    situ = rf"\mathrm{{SiTU}}(a, u) = {b1}\tanh(a/{b1})\,\sigma(a)\cdot {b2}\tanh(u/{b2})"
    out = {
        "embed": [r"h^{(0)}_t = E[\mathrm{id}_t] \in \mathbb{R}^{" + str(t.hidden_size) + "}"],
        "attn_mix": mix,
        "ffn_mix": mix,
        "out_mix": mix,
        "input_norm": [r"\mathrm{RMSNorm}(x) = g \odot \mathrm{bf16}\!\left(\frac{x}{\sqrt{\overline{x^2} + "
                       + f"{t.rms_norm_eps:g}" + r"}}\right)"],
        "kda": [
            r"g_t = -" + lb + r"\,\sigma\!\left(e^{A_h}(W_{f_b} W_{f_a} x_t + \delta)\right)",
            r"\alpha_t = \exp(g_t),\quad \beta_t = \sigma(W_b x_t)",
            r"S \leftarrow \mathrm{Diag}(\alpha_t)\, S,\quad u_t = \beta_t\,(v_t - S^\top \hat k_t)",
            r"S \leftarrow S + \hat k_t u_t^\top,\quad o_t = S^\top \hat q_t / \sqrt{" + str(kd.head_dim) + "}",
            r"y = W_o\!\left(\mathrm{rms}(o) \odot w \odot \sigma(W_g x)\right)",
        ],
        "mla": [
            r"q = W_{qb}\,\mathrm{RMS}(W_{qa} x),\quad [c;\,k_r] = W_{kva} x",
            r"[k_n;\,v] = W_{kvb}\,\mathrm{RMS}(c)",
            r"o = \mathrm{softmax}\!\left(\frac{q\,[k_n; k_r]^\top}{\sqrt{" + str(ml.qk_head_dim) + r"}} + "
            r"\mathrm{causal}\right) v,\quad y = W_o\!\left(o \odot \sigma(W_g x)\right)",
        ],
        "dense_mlp": [r"y = W_{down}\,\mathrm{SiTU}(W_{gate} x,\ W_{up} x)", situ],
        "shared_expert": [r"y = W_{down}\,\mathrm{SiTU}(W_{gate} x,\ W_{up} x)", situ],
        "router": [
            r"s = \sigma(W_r x) \in \mathbb{R}^{" + str(mo.num_experts) + r"},\quad \mathcal{A} = "
            r"\mathrm{top}_{" + str(mo.num_experts_per_token) + r"}(s + b),\quad w_i = \frac{s_i}{\sum_{j \in "
            r"\mathcal{A}} s_j + 10^{-20}}"
        ],
        "experts": [r"e_i(z) = W_2^{(i)}\,\mathrm{SiTU}(W_1^{(i)} z,\ W_3^{(i)} z),\quad z \in \mathbb{R}^{"
                    + str(mo.latent_dim) + "}"],
        "combine": [r"r = \sum_{i \in \mathcal{A}} w_i\,\mathrm{bf16}(e_i(z))\ \text{(fp32)}"],
        "latent_down": [r"z = W_{down}\,x"],
        "latent_up": [r"y = W_{up}\,\mathrm{RMS}(r)"],
        "moe": [
            _n("moe", "y") + " = " + _n("latent_up", "W_{up}") + r"\," + _n("latent_norm", r"\mathrm{RMS}")
            + r"\!\left(" + _n("combine", r"\sum_{i \in \mathcal{A}} w_i") + r"\, " + _n("experts", "e_i")
            + r"(" + _n("latent_down", "W_{down}") + r" x)\right) + " + _n("shared_expert", r"\mathrm{shared}")
            + "(x)",
        ],
        "layers": [
            _n("attn_mix", "a") + r" = \mathrm{MIX}(s, b),\quad s \mathrel{+}= " + _n("attention", r"\mathrm{attn}")
            + r"(" + _n("input_norm", r"\mathrm{RMS}") + r"(a)),\quad " + _n("ffn_mix", "m")
            + r" = \mathrm{MIX}(s, b),\quad s \mathrel{+}= " + _n("ffn", r"\mathrm{ffn}") + "("
            + _n("post_norm", r"\mathrm{RMS}") + "(m))",
        ],
        "residual": [r"\text{block start: } b \leftarrow [b;\ s],\ s \leftarrow \mathrm{attn}(\cdot)",
                     r"\text{else: } s \leftarrow s + \mathrm{attn}(\cdot)"],
        "lm_head": [r"\ell = W_{head}\,h \in \mathbb{R}^{" + str(t.vocab_size) + "}"],
        "model": [_n("lm_head", r"\ell") + " = W_{head}\\," + _n("final_norm", r"\mathrm{RMS}") + r"\!\left("
                  + _n("out_mix", r"\mathrm{MIX}") + r"(s_{" + str(t.num_layers) + r"}, b)\right)"],
    }
    out["final_norm"] = out["post_norm"] = out["latent_norm"] = out["input_norm"]
    if cfg.vision is not None:
        out["vision_block"] = [r"x \mathrel{+}= W_o\,\mathrm{attn}_{\mathrm{RoPE2D}}(W_{qkv}\,\mathrm{RMS}(x))",
                               r"x \mathrel{+}= W_{fc1}\,\mathrm{gelu}(W_{fc0}\,\mathrm{RMS}(x))"]
        out["projector"] = [r"y = \mathrm{RMS}\!\left(W_2\,\mathrm{gelu}(W_0\,[p_{00}; p_{01}; p_{10}; p_{11}])\right)"]
    return out


def shapes(cfg: K3Config) -> dict[str, list[Shape]]:
    """id -> named-axis shapes of its inputs, outputs and notable inner tensors."""
    t = cfg.text
    D, kd, ml, mo = t.hidden_size, t.kda, t.mla, t.moe
    B, T, N = ("B", None), ("T", None), ("N", None)
    d = ("D", D)

    def bt(name, role):
        return _shape(name, role, B, T, d)

    out = {
        "embed": [_shape("ids", "in", B, T), bt("h", "out")],
        "attn_mix": [_shape("b", "in", ("M", None), B, T, d), bt("s", "in"), bt("a", "out")],
        "ffn_mix": [_shape("b", "in", ("M", None), B, T, d), bt("s", "in"), bt("m", "out")],
        "out_mix": [_shape("b", "in", ("M", None), B, T, d), bt("s", "in"), bt("h", "out")],
        "input_norm": [bt("a", "in"), bt("x", "out")],
        "post_norm": [bt("m", "in"), bt("x", "out")],
        "final_norm": [bt("h", "in"), bt("x", "out")],
        "kda": [bt("x", "in"), _shape("q, k, v", "inner", B, T, ("H", kd.num_heads), ("K", kd.head_dim)),
                _shape("g", "inner", B, T, ("H", kd.num_heads), ("K", kd.head_dim)),
                _shape("beta", "inner", B, T, ("H", kd.num_heads)),
                _shape("S", "inner", B, ("H", kd.num_heads), ("K", kd.head_dim), ("V", kd.head_dim)),
                bt("y", "out")],
        "mla": [bt("x", "in"), _shape("q", "inner", B, T, ("H", ml.num_heads), ("N+R", ml.qk_head_dim)),
                _shape("c ; k_r", "inner", B, T, ("C+R", ml.kv_lora_rank + ml.qk_rope_head_dim)),
                _shape("k", "inner", B, T, ("H", ml.num_heads), ("N+R", ml.qk_head_dim)),
                _shape("v", "inner", B, T, ("H", ml.num_heads), ("V", ml.v_head_dim)), bt("y", "out")],
        "dense_mlp": [bt("x", "in"), _shape("h", "inner", B, T, ("F", t.intermediate_size)), bt("y", "out")],
        "router": [_shape("x", "in", N, d), _shape("idx, w", "out", N, ("A", mo.num_experts_per_token)),
                   _shape("scores", "out", N, ("E", mo.num_experts))],
        "latent_down": [_shape("x", "in", N, d), _shape("z", "out", N, ("L", mo.latent_dim))],
        "experts": [_shape("z", "in", N, ("L", mo.latent_dim)), _shape("h_i", "inner", ("n_i", None),
                    ("F", mo.expert_dim)), _shape("r", "out", N, ("L", mo.latent_dim))],
        "combine": [_shape("e_i(z)", "in", N, ("A", mo.num_experts_per_token), ("L", mo.latent_dim)),
                    _shape("r", "out", N, ("L", mo.latent_dim))],
        "latent_norm": [_shape("r", "in", N, ("L", mo.latent_dim)), _shape("r", "out", N, ("L", mo.latent_dim))],
        "latent_up": [_shape("r", "in", N, ("L", mo.latent_dim)), _shape("y", "out", N, d)],
        "shared_expert": [_shape("x", "in", N, d), _shape("h", "inner", N, ("F", mo.shared_dim)),
                          _shape("y", "out", N, d)],
        "lm_head": [bt("x", "in"), _shape("logits", "out", B, T, ("Vocab", t.vocab_size))],
    }
    if cfg.vision is not None:
        v = cfg.vision
        P, dv = ("P", None), ("Dv", v.hidden_size)
        kh, kw = v.merge_kernel_size
        out["vision_patch"] = [_shape("pixels", "in", P, ("3", 3), ("p", v.patch_size), ("p", v.patch_size)),
                               _shape("x", "out", P, dv)]
        out["vision_block"] = [_shape("x", "in", P, dv), _shape("x", "out", P, dv)]
        out["vision_norm"] = [_shape("x", "in", P, dv), _shape("x", "out", P, dv)]
        out["projector"] = [_shape("merged", "in", ("P/4", None), ("4Dv", v.mm_hidden_size * kh * kw)),
                            _shape("y", "out", ("P/4", None), d)]
    return out


def edge_label(shape: Shape) -> str:
    """'[B, T, D=7168]': free axes by letter, fixed ones with their size."""
    return "[" + ", ".join(a if s is None else f"{a}={s:,}" for a, s in shape["axes"]) + "]"


def tensors(cfg: K3Config) -> list[dict]:
    """The tensors on the diagram's edges (the seeds' tensor pages): id, symbol, what it is, shape, the
    component that produces it and those that read it."""
    t = cfg.text
    D, mo = t.hidden_size, t.moe
    B, T, N, d = ("B", None), ("T", None), ("N", None), ("D", D)
    blocks = len(t.snapshot_layers)

    def row(tid, sym, title, axes, producer, consumers, about):
        return {"id": tid, "symbol": sym, "title": title, "shape": _shape(sym, "edge", *axes),
                "producer": producer, "consumers": consumers, "about": about}

    out = [
        row("h0", "h", "Token embeddings", (B, T, d), "embed", ["attn_mix", "residual"],
            "the embedding rows of the input ids (images' projected tokens replace the media pads); the first "
            "running sum, stored as depth source 0 at layer 0"),
        row("b", "b", "Stored block sums", (("M", None), B, T, d), "residual", ["attn_mix", "ffn_mix", "out_mix"],
            f"the running sum as it stood at each block start (M grows to {blocks}: layers "
            f"{', '.join(map(str, t.snapshot_layers))}); values of every depth mix, never added again"),
        row("s", "s", "Running sum", (B, T, d), "residual", ["attn_mix", "ffn_mix", "out_mix"],
            "the current block's sum of sublayer outputs; each layer's output, and the last source of every mix"),
        row("a", "a", "Attention input", (B, T, d), "attn_mix", ["input_norm"],
            "the depth mix that replaces the residual stream as the attention's input"),
        row("x_attn", "x", "Normalized attention input", (B, T, d), "input_norm", ["kda", "mla"],
            "RMSNorm of the attention input mix"),
        row("m", "m", "FFN input mix", (B, T, d), "ffn_mix", ["post_norm"],
            "the depth mix after the attention sublayer, the FFN's input before its norm"),
        row("x_ffn", "x", "FFN input", (N, d), "post_norm", ["dense_mlp", "router", "latent_down", "shared_expert"],
            "the normalized features entering the FFN: the router and the shared expert read them at full width, "
            "the routed experts only after the latent down projection"),
        row("z", "z", "Expert latent", (N, ("L", mo.latent_dim)), "latent_down", ["experts"],
            f"the {mo.latent_dim}-wide latent every routed expert reads"),
        row("r", "r", "Combined expert output", (N, ("L", mo.latent_dim)), "combine", ["latent_norm"],
            "the routing-weighted sum of the selected experts' outputs, in fp32"),
        row("logits", "logits", "Logits", (B, T, ("Vocab", t.vocab_size)), "lm_head", [],
            "the LM head's output in the compute dtype (no fp32 upcast)"),
    ]
    for r in out:
        r["shape"]["label"] = edge_label(r["shape"])
    return out
