"""atlas.json: totals, the released inventory, instances stored vs used, shapes, evidence, formulas, diff, live.

The expected numbers are written out (from the released config and tensors.json), never recomputed here by
the code path under test.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import re
import sys
from collections import Counter

import pytest
import torch

from kimik3.atlas import count_parameters
from kimik3.atlas.build import build_atlas, stored_dtype
from kimik3.atlas.catalog import components
from kimik3.atlas.diff import diff_atlases
from kimik3.atlas.evidence import class_sites, owner_sites
from kimik3.atlas.measure import check_flops
from kimik3.config import K3Config
from kimik3.model import K3ForConditionalGeneration
from kimik3.presets import DEMO_MODEL, load_config
from tests.atlas.test_params import released_inventory
from tests.helpers import REPO

BUILT_AT = "2026-01-01 00:00 UTC"


@pytest.fixture(scope="module")
def k3_atlas():
    return build_atlas(load_config("k3"), name="k3", built_at=BUILT_AT)


@pytest.fixture(scope="module")
def tiny_atlas():
    return build_atlas(load_config("tiny"), name="tiny", built_at=BUILT_AT)


def unseen_config() -> K3Config:
    """A config no preset has: 9 layers, MLA first, two dense layers, AttnRes blocks of 4, 5 experts top-2."""
    d = copy.deepcopy(load_config("tiny").hf)
    t = d["text_config"]
    t.update(num_hidden_layers=9, first_k_dense_replace=2, attn_res_block_size=4, num_experts=5,
             num_experts_per_token=2)
    t["linear_attn_config"].update(kda_layers=[2, 3, 5, 6, 8], full_attn_layers=[1, 4, 7, 9])
    return K3Config.from_hf(d)


def leaf_sum(atlas: dict) -> int:
    return sum(n["total"] for n in atlas["nodes"].values() if n["leaf"])


def test_released_totals(k3_atlas):
    a = k3_atlas
    assert a["totals"]["total"] == 2_779_931_837_184 and a["totals"]["text"] == 2_779_484_478_208
    assert leaf_sum(a) == 2_779_931_837_184
    assert a["totals"]["active"] == 104_189_614_848
    assert a["totals"]["active_with_embedding"] == 105_364_019_968
    assert a["totals"]["active_without_head"] == 103_015_209_728
    n = a["nodes"]
    expect = {  # component: (per instance, instances stored, total)
        "embed": (1_174_405_120, 1, 1_174_405_120), "lm_head": (1_174_405_120, 1, 1_174_405_120),
        "attn_mix": (14_336, 93, 1_333_248), "ffn_mix": (14_336, 93, 1_333_248),
        "input_norm": (7_168, 93, 666_624), "post_norm": (7_168, 93, 666_624),
        "kda": (443_740_416, 69, 30_618_088_704), "mla": (232_196_096, 24, 5_572_706_304),
        "dense_mlp": (726_663_168, 1, 726_663_168), "router": (6_422_528 + 896, 92, 590_872_576 + 82_432),
        "latent_down": (25_690_112, 92, 2_363_490_304), "latent_up": (25_690_112, 92, 2_363_490_304),
        "experts": (33_030_144, 82_432, 2_722_740_830_208), "latent_norm": (3_584, 92, 329_728),
        "shared_expert": (132_120_576, 92, 12_155_092_992), "out_mix": (14_336, 1, 14_336),
        "final_norm": (7_168, 1, 7_168), "vision_block": (14_682_112, 27, 27 * 14_682_112),
    }
    got = {k: (n[k]["per_instance"], n[k]["instances"]["stored"], n[k]["total"]) for k in expect}
    assert got == expect
    assert n["vision_patch"]["total"] == 602_112 + 4_194_304 and n["vision_norm"]["total"] == 1_024
    assert n["projector"]["total"] == 46_144_512
    assert n["moe"]["total"] == 92 * 29_784_936_832
    assert n["experts"]["instances"]["experts_per_layer"] == 896


def test_census_equals_released_inventory(k3_atlas):
    released = released_inventory()
    assert k3_atlas["census"]["tensors"] == len(released) == 497_220
    dtypes = Counter({"bfloat16": "bf16", "float32": "fp32", "uint8": "uint8"}[d] for _, d in released.values())
    assert k3_atlas["census"]["by_dtype"] == dict(dtypes) == {"bf16": 2_122, "fp32": 506, "uint8": 494_592}
    # every stored tensor is in exactly one component
    assert sum(n["tensors_stored"] for n in k3_atlas["nodes"].values() if n["leaf"]) == 497_220
    # the released config's ignore list leaves the latent projections to MXFP4; the checkpoint stores them bf16
    mism = {m["tensor"]: m for m in k3_atlas["quantization_mismatches"]}
    down = "language_model.model.layers.{i}.block_sparse_moe.routed_expert_down_proj.weight"
    assert mism[down]["checkpoint_stores"] == "bf16" and mism[down]["instances"] == 92


def test_expert_rows_show_mxfp4_storage(k3_atlas):
    rows = {r["tensor"]: r for r in k3_atlas["nodes"]["experts"]["rows"]}
    assert rows["w1"]["shape"] == [3072, 3584] and rows["w1"]["count"] == 11_010_048
    assert rows["w1"]["stored_as"] == "uint8 [3072 x 1792] + uint8 [3072 x 112]"
    assert rows["w2"]["stored_as"] == "uint8 [3584 x 1536] + uint8 [3584 x 96]"
    kda = {r["tensor"]: r for r in k3_atlas["nodes"]["kda"]["rows"]}
    assert kda["A_log"]["count"] == 128 and kda["A_log"]["dtype"] == "fp32"


@pytest.mark.parametrize("name", ["tiny", "demo", "unseen"])
def test_component_totals_sum_to_params(name):
    cfg = unseen_config() if name == "unseen" else load_config(DEMO_MODEL if name == "demo" else name)
    atlas = build_atlas(cfg, name=name, built_at=BUILT_AT)
    with torch.device("meta"):
        model = K3ForConditionalGeneration(cfg, stored_dtype(cfg))
    assert leaf_sum(atlas) == count_parameters(model).total == atlas["totals"]["total"]


def test_config_without_mla_moe_or_vision():
    """Components a config lacks are left out (no empty MLA leaf, no MoE frame), and the totals still add up."""
    d = copy.deepcopy(load_config("tiny").hf)
    d["text_config"].update(num_hidden_layers=4, first_k_dense_replace=4)
    d["text_config"]["linear_attn_config"].update(kda_layers=[1, 2, 3, 4], full_attn_layers=[])
    del d["vision_config"]
    cfg = K3Config.from_hf(d)
    atlas = build_atlas(cfg, name="all-kda", built_at=BUILT_AT)
    assert not {"mla", "moe", "router", "experts", "combine", "vision", "projector"} & set(atlas["nodes"])
    assert atlas["nodes"]["kda"]["instances"]["stored"] == 4 and atlas["nodes"]["dense_mlp"]["instances"]["used"] == 4
    with torch.device("meta"):
        model = K3ForConditionalGeneration(cfg, stored_dtype(cfg))
    assert leaf_sum(atlas) == count_parameters(model).total == atlas["totals"]["text"]
    assert all(t["producer"] in atlas["nodes"] for t in atlas["tensors"])


def test_facts_are_this_builds_numbers(k3_atlas, tiny_atlas):
    k3 = {f["topic"]: f["shows"] for f in k3_atlas["facts"]}
    assert k3["How many KDA layers"].startswith("69 KDA layers, of which 68 have a latent MoE")
    assert "8 blocks (7 x 12 + 9 layers)" in k3["AttnRes blocks"] and "9 sources" in k3["AttnRes blocks"]
    assert "MHA at these dims would cache 30,720, 53x more" in k3["MLA cache and positions"]
    assert k3["RMSNorm eps"].startswith("1e-05 in 535 norms, 1e-06 in 48 norms")  # 24 MLA layers x 2 latent norms
    assert "read in 92" in k3["Attention input mix: instances"]
    for atlas in (k3_atlas, tiny_atlas):
        assert all(f["link"] in atlas["nodes"] for f in atlas["facts"])
    assert "L = 64" in {f["topic"]: f["shows"] for f in tiny_atlas["facts"]}["Routed experts' input width"]


def test_packed_model_accounts_the_same():
    from kimik3.atlas.accounting import account
    from kimik3.quant import pack_experts

    cfg = load_config("tiny")
    comps = components(cfg)
    with torch.device("meta"):
        dense = K3ForConditionalGeneration(cfg)
        packed = pack_experts(K3ForConditionalGeneration(cfg))
    a, b = account(dense, comps), account(packed, comps)
    assert {k: (v["total"], v["tensors_stored"], v["bytes_stored"]) for k, v in a.items()} == \
        {k: (v["total"], v["tensors_stored"], v["bytes_stored"]) for k, v in b.items()}


def test_variants(k3_atlas, tiny_atlas):
    k3 = {(v["attention"], v["ffn"], v["starts_block"]): v["layers"] for v in k3_atlas["variants"]}
    assert k3[("kda", "dense", True)] == [0]
    assert k3[("kda", "moe", True)] == [12, 24, 36, 48, 60, 72, 84]
    assert len(k3[("kda", "moe", False)]) == 61 and len(k3[("mla", "moe", False)]) == 24
    assert k3[("mla", "moe", False)][-2:] == [91, 92]
    assert k3_atlas["attnres_blocks"][-1] == "84-92" and len(k3_atlas["attnres_blocks"]) == 8
    assert k3_atlas["depth_mixes_per_forward"] == 186
    tiny = {(v["attention"], v["ffn"], v["starts_block"]): v["layers"] for v in tiny_atlas["variants"]}
    assert tiny == {("kda", "dense", True): [0], ("kda", "moe", False): [1, 2, 4], ("mla", "moe", True): [3, 6],
                    ("mla", "moe", False): [5]}


def _mix_calls(cfg: K3Config) -> dict[str, set]:
    """Which layers' AttnRes pairs a real forward reads, counted independently of the atlas: the mix op is
    wrapped and the (norm, proj) weights it receives are matched to their layers by identity."""
    import kimik3.model.decoder as dec

    model = K3ForConditionalGeneration(cfg, torch.float32).eval()
    owners = {}
    for i, layer in enumerate(model.language_model.model.layers):
        owners[id(layer.self_attention_res_proj.weight)] = ("attn_mix", i)
        owners[id(layer.mlp_res_proj.weight)] = ("ffn_mix", i)
    seen: dict[str, set] = {"attn_mix": set(), "ffn_mix": set()}
    real = dec.attn_res_mix

    def counting(blocks, partial, norm_weight, proj_weight, eps):
        if id(proj_weight) in owners:
            kind, i = owners[id(proj_weight)]
            seen[kind].add(i)
        return real(blocks, partial, norm_weight, proj_weight, eps)

    dec.attn_res_mix = counting
    try:
        with torch.no_grad():
            model(torch.randint(0, cfg.text.vocab_size, (2, 5)))
    finally:
        dec.attn_res_mix = real
    return seen


@pytest.mark.parametrize("name", ["tiny", "unseen"])
def test_used_instances_match_a_real_forward(name, tiny_atlas):
    cfg = unseen_config() if name == "unseen" else load_config(name)
    atlas = tiny_atlas if name == "tiny" else build_atlas(cfg, name=name, built_at=BUILT_AT)
    seen = _mix_calls(cfg)
    for kind in ("attn_mix", "ffn_mix"):
        inst = atlas["nodes"][kind]["instances"]
        assert inst["used"] == len(seen[kind])
        assert inst["unused"] == sorted(set(range(cfg.text.num_layers)) - seen[kind])
    assert atlas["nodes"]["attn_mix"]["instances"]["unused"] == [0]  # no stored sums before layer 0's attention
    assert atlas["nodes"]["attn_mix"]["notes"]
    if name == "tiny":  # the vision leaves run on an image: every block is read
        blocks = atlas["nodes"]["vision_block"]["instances"]
        assert blocks["used"] == blocks["stored"] == cfg.vision.num_layers and not blocks["unused"]
        assert atlas["nodes"]["projector"]["instances"]["used"] == 1


def test_shapes_match_forward_hooks(tiny_atlas):
    """Named-axis shapes on the pages == the shapes a real tiny forward produces (B=2, T=5)."""
    cfg = load_config("tiny")
    model = K3ForConditionalGeneration(cfg, torch.float32).eval()
    lm = model.language_model.model
    B, T = 2, 5
    free = {"B": B, "T": T, "N": B * T}
    mods = {"input_norm": lm.layers[1].input_layernorm, "kda": lm.layers[1].self_attn,
            "mla": lm.layers[3].self_attn, "post_norm": lm.layers[1].post_attention_layernorm,
            "dense_mlp": lm.layers[0].mlp, "latent_down": lm.layers[1].block_sparse_moe.routed_expert_down_proj,
            "latent_up": lm.layers[1].block_sparse_moe.routed_expert_up_proj,
            "latent_norm": lm.layers[1].block_sparse_moe.routed_expert_norm,
            "shared_expert": lm.layers[1].block_sparse_moe.shared_experts, "router": lm.layers[1].block_sparse_moe.gate,
            "lm_head": model.language_model.lm_head, "embed": lm.embed_tokens, "final_norm": lm.norm}
    seen = {}

    def record(k):
        def hook(mod, args, out):  # returns None: a hook's return value would replace the module's output
            seen.setdefault(k, (args, out))
        return hook

    hooks = [m.register_forward_hook(record(k)) for k, m in mods.items()]
    with torch.no_grad():
        model(torch.randint(0, cfg.text.vocab_size, (B, T)))
    for h in hooks:
        h.remove()
    assert set(seen) == set(mods)
    for k, (args, out) in seen.items():
        shapes = tiny_atlas["nodes"][k]["shapes"]

        def size(axes):
            return [free[a] if s is None else s for a, s in axes]

        want_in = size(next(s for s in shapes if s["role"] == "in")["axes"])
        # one "out" entry may name several outputs of one shape ("idx, w")
        want_out = [size(s["axes"]) for s in shapes if s["role"] == "out" for _ in s["name"].split(", ")]
        outs = out if isinstance(out, tuple) else (out,)
        assert list(args[0].shape) == want_in, (k, args[0].shape, want_in)
        assert [list(o.shape) for o in outs] == want_out, (k, [o.shape for o in outs], want_out)


def test_k3_shapes_on_the_meta_device(k3_atlas):
    """The released config's page shapes == the shapes its modules produce, run on the meta device."""
    from kimik3.model.kda import KimiDeltaAttention
    from kimik3.model.mla import MultiHeadLatentAttention
    from kimik3.model.moe import LatentMoE

    cfg = load_config("k3").text
    B, T = 2, 3
    free = {"B": B, "T": T, "N": B * T}
    with torch.device("meta"):
        x_BTD = torch.empty(B, T, cfg.hidden_size, dtype=torch.bfloat16)
        moe = LatentMoE(cfg, torch.bfloat16)
        z = moe.routed_expert_down_proj(x_BTD.reshape(B * T, -1))
        runs = {"kda": (KimiDeltaAttention(cfg, torch.bfloat16), x_BTD),
                "mla": (MultiHeadLatentAttention(cfg, torch.bfloat16), x_BTD),
                "router": (moe.gate, x_BTD.reshape(B * T, -1)), "latent_down": (moe.routed_expert_down_proj,
                                                                                 x_BTD.reshape(B * T, -1)),
                "latent_norm": (moe.routed_expert_norm, z), "latent_up": (moe.routed_expert_up_proj, z),
                "shared_expert": (moe.shared_experts, x_BTD.reshape(B * T, -1))}
        for k, (mod, inp) in runs.items():
            out = mod(inp)
            outs = out if isinstance(out, tuple) else (out,)
            shapes = k3_atlas["nodes"][k]["shapes"]

            def size(axes):
                return [free[a] if s is None else s for a, s in axes]

            assert list(inp.shape) == size(next(s for s in shapes if s["role"] == "in")["axes"]), k
            want = [size(s["axes"]) for s in shapes if s["role"] == "out" for _ in s["name"].split(", ")]
            assert [list(o.shape) for o in outs] == want, (k, [o.shape for o in outs], want)


def test_tensor_pages_connect_components(k3_atlas, tiny_atlas):
    for atlas in (k3_atlas, tiny_atlas):
        ids = [t["id"] for t in atlas["tensors"]]
        assert len(ids) == len(set(ids)) >= 10
        for t in atlas["tensors"]:
            assert t["producer"] in atlas["nodes"] and all(c in atlas["nodes"] for c in t["consumers"])
    by = {t["id"]: t for t in k3_atlas["tensors"]}
    assert by["z"]["shape"]["label"] == "[N, L=3,584]" and by["logits"]["shape"]["label"] == "[B, T, Vocab=163,840]"
    assert "M grows to 8" in by["b"]["about"]


def test_evidence_ranges_hold_the_definitions(k3_atlas):
    for cid, n in k3_atlas["nodes"].items():
        for e in n.get("evidence", []):
            assert e["path"].startswith("src/kimik3/") and not e["path"].startswith("/")
            lines = (REPO / e["path"]).read_text().splitlines()
            assert "\n".join(lines[e["start"] - 1:e["end"]]) == e["code"], (cid, e)
            if e["kind"] == "defines":
                attr = re.search(r"self\.(\w+)", e["claim"]).group(1)
                assert f"self.{attr} =" in e["code"], (cid, e)
            if e["kind"] == "uses":
                attr = re.search(r"self\.(\w+)", e["claim"]).group(1)
                assert f"self.{attr}" in e["code"], (cid, e)
        if n["leaf"]:
            assert any(e["kind"] == "defines" for e in n["evidence"]), cid
    kinds = {e["kind"] for e in k3_atlas["nodes"]["kda"]["evidence"]}
    assert {"defines", "uses", "class", "computes"} <= kinds
    assert any("def chunk_kda" in e["code"] for e in k3_atlas["nodes"]["kda"]["evidence"])
    assert k3_atlas["nodes"]["attn_mix"]["tests"]


def test_evidence_follows_the_file(tmp_path, monkeypatch):
    """Line numbers come from the live source: the same class written lower in a file moves its evidence."""
    src = ("import torch\nfrom torch import nn\n\n\nclass Owner(nn.Module):\n    def __init__(self):\n"
           "        super().__init__()\n        self.proj = nn.Linear(3, 4)\n\n    def forward(self, x):\n"
           "        y = x * 2\n        return self.proj(y)\n")
    sites = []
    for pad in (0, 7):
        path = tmp_path / f"synthetic_{pad}.py"
        path.write_text("\n" * pad + src)
        spec = importlib.util.spec_from_file_location(f"synthetic_{pad}", path)
        mod = importlib.util.module_from_spec(spec)
        monkeypatch.setitem(sys.modules, spec.name, mod)
        spec.loader.exec_module(mod)
        sites.append({s["kind"]: s for s in owner_sites(mod.Owner, ("proj",), "the projection")})
        assert [s["kind"] for s in class_sites(mod.Owner)] == ["class", "computes"]
    for kind, line in (("defines", 8), ("uses", 12)):
        assert sites[0][kind]["start"] == line and sites[1][kind]["start"] == line + 7
        assert sites[0][kind]["code"] == sites[1][kind]["code"]
    assert sites[1]["defines"]["code"].strip() == "self.proj = nn.Linear(3, 4)"


def test_formula_links_and_no_k3_constants_in_tiny(tiny_atlas, k3_atlas):
    for atlas in (tiny_atlas, k3_atlas):
        for n in atlas["nodes"].values():
            for f in n["formula"]:
                for target in re.findall(r"\\htmlData\{node=(\w+)\}", f):
                    assert target in atlas["nodes"], target
    text = json.dumps({k: v for k, v in tiny_atlas["nodes"].items()})
    for token in ("7168", "7,168", "896", "163,840", "163840", "3584"):
        assert not re.search(rf"(?<![\d,]){re.escape(token)}(?![\d,])", text), token


def test_memory_and_flops_numbers(k3_atlas):
    m = k3_atlas["memory"]
    assert m["kda_state_per_sequence"] == 69 * 96 * 128 * 128 * 4 == 434_110_464
    assert m["kda_conv_per_sequence"] == 69 * 221_184
    assert m["mla_latent_per_token"] == 24 * 576 * 2 == 27_648
    assert m["weights"] == k3_atlas["census"]["bytes"] == 1_560_860_324_864
    f = k3_atlas["nodes"]
    assert f["experts"]["flops"]["weights"] == 2 * 16 * 33_030_144
    assert f["shared_expert"]["flops"]["weights"] == 2 * 132_120_576
    assert f["attn_mix"]["flops"] is None  # read as a vector by the mix, never a matmul
    assert f["mla"]["flops"]["core"] == 2 * 96 * (192 + 128) * 131072
    assert f["kda"]["flops"]["core"] == 4 * 96 * 128 * 128


@pytest.mark.parametrize("name", ["tiny", "unseen"])
def test_flop_formulas_match_torch_flop_counter(name):
    cfg = unseen_config() if name == "unseen" else load_config(name)
    rows = check_flops(cfg, components(cfg))
    leaves = {r["leaf"] for r in rows}
    assert {"kda", "mla", "experts", "router", "shared_expert", "lm_head", "latent_down"} <= leaves
    assert {(r["leaf"], r["what"]) for r in rows} >= {("mla", "core"), ("kda", "core (decode)")}
    bad = [r for r in rows if r["formula"] != r["counted"] or r["counted"] == 0]
    assert not bad, bad


def test_diff_deltas_sum_to_total(k3_atlas, tiny_atlas):
    d = diff_atlases(k3_atlas, tiny_atlas)
    assert sum(c["delta"] for c in d["components"]) == d["totals"]["delta"] == \
        tiny_atlas["totals"]["total"] - k3_atlas["totals"]["total"]
    assert {f["field"] for f in d["config"]} >= {"layers", "hidden", "experts"}
    unseen = build_atlas(unseen_config(), name="unseen", built_at=BUILT_AT)
    d2 = diff_atlases(tiny_atlas, unseen)
    assert sum(c["delta"] for c in d2["components"]) == d2["totals"]["delta"]
    assert any(v["variant"] == "MLA + moe, block start" for v in d2["variants"])


def test_live_numbers_on_the_demo_model():
    from kimik3.atlas.live import load_and_run

    live = load_and_run(DEMO_MODEL, "ROMEO: But soft, what light")
    cfg = load_config(DEMO_MODEL).text
    n = live["tokens"]
    assert n > 3 and live["expert_load"]
    for layer, counts in live["expert_load"].items():
        assert cfg.moe_layers[int(layer)] and len(counts) == cfg.moe.num_experts
        assert sum(counts) == n * cfg.moe.num_experts_per_token
    mixes = live["depth_mixes"]
    first_attn = [m for m in mixes if m["sublayer"] == "attention"]
    assert len(mixes) == 2 * cfg.num_layers and mixes[-1]["sublayer"] == "output"  # 2N - 1 + the output mix
    assert min(m["layer"] for m in first_attn) == 1
    for m in mixes:
        assert abs(sum(m["weights"]) - 1) < 1e-5 and min(m["weights"]) >= 0
    assert len(mixes[-1]["weights"]) == len(cfg.snapshot_layers) + 1
    lo = torch.tensor(cfg.kda.gate_lower_bound).exp().item()
    for d in live["kda_decay"].values():
        assert all(lo <= v <= 1 for v in d["per_head_mean"]) and len(d["A"]) == cfg.kda.num_heads
        assert sum(d["histogram"]) == n * cfg.kda.num_heads * cfg.kda.head_dim
