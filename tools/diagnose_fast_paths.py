"""Which fast path moves the tiny model's logits, and how: each op family's CUDA path switched on alone
(every other op on its reference, on the same GPU, same dtype), with the per-token error distribution and
the number of tokens whose expert selection flipped in any MoE layer (a flip turns a rounding difference into
an O(1) change of that token's output, so whole-model comparisons must count flips, not only errors).

    python -m tools.diagnose_fast_paths            # on a CUDA device
    python -m tools.diagnose_fast_paths --kda-only # only the KDA op sweep (forward, state, every gradient)
Not part of the package: a debugging aid for the GPU tests.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from kimik3.config import K3Config
from kimik3.model import K3ForCausalLM
from kimik3.model.moe import Router
from kimik3.ops import backend
from kimik3.ops.backend import use_backend
from kimik3.ops.kda import chunk_kda_with_gate
from kimik3.testing import randomize, rel_err, triton_first_config

OPS = ("kda", "mla", "attnres", "moe")
DEV = "cuda" if torch.cuda.is_available() else "cpu"
CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def tiny_head64():
    d = json.loads((CONFIGS / "tiny.json").read_text())
    d["text_config"]["linear_attn_config"]["head_dim"] = 64
    return K3Config.from_hf(d).text


def only(active: str | None):
    """A block where, of OPS, only `active` (None: none) takes its CUDA path (the other ops as always)."""
    off = {op: "torch" for op in OPS if op not in (active, "moe")}
    return backend.use_backend(moe=None if active == "moe" else "torch", **off)


def forward_with_routes(model, ids):
    routes = []
    hooks = [m.register_forward_hook(lambda _m, _i, out: routes.append(out[0].sort(-1).values))
             for m in model.modules() if isinstance(m, Router)]
    with torch.no_grad():
        out = model(ids).float()
    for h in hooks:
        h.remove()
    return out, routes


def report(tag, out, ref, routes, ref_routes):
    tok = ((out - ref).norm(dim=-1) / ref.norm(dim=-1)).flatten()
    flipped = torch.zeros(ref.shape[0] * ref.shape[1], dtype=torch.bool, device=ref.device)
    for a, b in zip(routes, ref_routes):
        flipped |= (a != b).any(-1).view(-1)[: flipped.numel()]
    ok = ~flipped
    print(f"{tag:>14}: all {rel_err(out, ref):.2e} | per token median {tok.median():.2e} p99 {tok.quantile(.99):.2e}"
          f" max {tok.max():.2e} | flipped {int(flipped.sum())}/{flipped.numel()} | unflipped max "
          f"{tok[ok].max() if ok.any() else float('nan'):.2e} worst pos {tok.argmax().item()}", flush=True)


def main(kda_only: bool = False) -> None:
    triton_first_config()  # no autotuning minutes: correctness does not depend on the config
    cfg = tiny_head64()
    torch.manual_seed(0)
    src = randomize(K3ForCausalLM(cfg, torch.float32), seed=51).eval()
    ids = torch.randint(0, 300, (2, 150), device=DEV)
    for dtype in () if kda_only else (torch.float32, torch.bfloat16):
        m = K3ForCausalLM(cfg, dtype)
        m.load_state_dict(src.state_dict())
        m = m.to(DEV).eval()
        with only(None):
            ref, ref_routes = forward_with_routes(m, ids)
        for op in OPS:
            with only(op):
                out, routes = forward_with_routes(m, ids)
            report(f"{op} {str(dtype)[6:]}", out, ref, routes, ref_routes)
    # the KDA op alone, fla vs reference: forward, final state and every gradient, over head counts and dims;
    # first the shape of tests/ops/test_kda_fast.py::test_chunk_kda_gradients
    # (bf16, B=1, T=130, H=2, K=128, initial state)
    bf, f32 = torch.bfloat16, torch.float32
    for dtype, B, T, H, K, h0, dht in (
            (bf, 1, 130, 2, 128, True, True), (bf, 1, 130, 2, 128, False, True), (bf, 1, 130, 2, 128, True, False),
            (bf, 1, 128, 2, 128, True, True), (f32, 1, 130, 2, 128, True, True), (bf, 1, 129, 2, 128, True, True),
            (bf, 1, 194, 2, 128, True, True), (bf, 2, 150, 4, 128, True, True), (bf, 1, 130, 4, 128, True, True),
            (bf, 2, 150, 3, 64, False, True), (bf, 2, 150, 4, 128, False, True), (f32, 2, 150, 4, 128, True, True),
            (f32, 2, 150, 3, 64, False, True), (f32, 2, 150, 4, 128, False, True)):
        kda_op(dtype, H, K, h0, B, T, dht)


def kda_op(dtype, H, K, with_h0, B, T, dht=True):
    g = torch.Generator(device=DEV).manual_seed(0)
    x = {n: torch.randn(B, T, H, K, device=DEV, generator=g).to(dtype) for n in ("q", "k", "v", "g")}
    x["beta"] = torch.randn(B, T, H, device=DEV, generator=g)
    x["A_log"] = torch.rand(max(H, K), device=DEV, generator=g) * 2 - 1
    x["dt_bias"] = 0.5 * torch.randn(H * K, device=DEV, generator=g)
    if with_h0:
        x["initial_state"] = torch.randn(B, H, K, K, device=DEV, generator=g)
    w_o = torch.randn(B, T, H, K, device=DEV, generator=g)
    w_s = torch.randn(B, H, K, K, device=DEV, generator=g) * dht
    kda_compare(x, w_o, w_s, f"kda {str(dtype)[6:]} B={B} T={T} H={H} K={K} h0={with_h0} dht={dht}")


def kda_compare(x, w_o, w_s, tag):
    res = []
    for name in ("auto", "torch"):
        leaves = {n: t.detach().clone().requires_grad_(n != "A_log") for n, t in x.items()}
        with use_backend(name):
            o, s = chunk_kda_with_gate(**leaves, lower_bound=-5.0, output_final_state=True)
        ((o.float() * w_o).sum() + (s * w_s).sum()).backward()
        res.append((o, s, {n: t.grad for n, t in leaves.items() if t.grad is not None}))
    (o, s, gr), (o_r, s_r, gr_r) = res
    tok = ((o - o_r).float().norm(dim=-1) / o_r.float().norm(dim=-1)).flatten()
    grads = " ".join(f"d{n} {rel_err(gr[n], gr_r[n]):.1e}" for n in gr_r)
    print(f"{tag}: o {rel_err(o, o_r):.1e} (token max {tok.max():.1e}) state {rel_err(s, s_r):.1e} | {grads}",
          flush=True)
    for name, g in (("auto", gr), ("torch", gr_r)):
        print(f"  norms {name}:", " ".join(f"{n} {t.double().norm():.6e}" for n, t in g.items()), flush=True)


if __name__ == "__main__":
    import sys

    main(kda_only="--kda-only" in sys.argv[1:])
