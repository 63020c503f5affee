"""Which fast path moves the tiny model's logits, and how: each op family's CUDA path switched on alone
(every other op on its reference, on the same GPU, same dtype), with the per-token error distribution and
the number of tokens whose expert selection flipped in any MoE layer (a flip turns a rounding difference into
an O(1) change of that token's output, so whole-model comparisons must count flips, not only errors).

    python bench/diagnose_fast_paths.py            # on a CUDA device
Not part of the package: a debugging aid for the GPU tests.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import torch

from kimik3.config import K3Config
from kimik3.model import K3ForCausalLM
from kimik3.model.moe import Router
from kimik3.ops.kda import chunk_kda_with_gate
from kimik3.ops.backend import use_backend
from tests.conftest import pytest_configure, randomize, rel_err

OPS = ("kda", "mla", "attnres", "moe")
DEV = "cuda" if torch.cuda.is_available() else "cpu"
CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def tiny_head64():
    d = json.loads((CONFIGS / "tiny.json").read_text())
    d["text_config"]["linear_attn_config"]["head_dim"] = 64
    return K3Config.from_hf(d).text


def only(active: str | None):
    """Switch each op family's `use_fast` so only `active` takes its CUDA path."""
    for name in OPS:
        mod = importlib.import_module(f"kimik3.ops.{name}")
        mod.use_fast = (lambda n: lambda t: t.is_cuda and n == active)(name)


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


def main() -> None:
    pytest_configure(None)  # KIMIK3_TEST_TRITON_FIRST_CONFIG=1: no autotuning (see tests/conftest.py)
    cfg = tiny_head64()
    torch.manual_seed(0)
    src = randomize(K3ForCausalLM(cfg, torch.float32), seed=51).eval()
    ids = torch.randint(0, 300, (2, 150), device=DEV)
    for dtype in (torch.float32, torch.bfloat16):
        m = K3ForCausalLM(cfg, dtype)
        m.load_state_dict(src.state_dict())
        m = m.to(DEV).eval()
        only(None)
        ref, ref_routes = forward_with_routes(m, ids)
        for op in OPS:
            only(op)
            out, routes = forward_with_routes(m, ids)
            report(f"{op} {str(dtype)[6:]}", out, ref, routes, ref_routes)
        only(None)
    # the KDA op alone at the tiny model's shapes, fla vs reference
    g = torch.Generator(device=DEV).manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        x = [torch.randn(2, 150, 3, 64, device=DEV, generator=g).to(dtype) for _ in range(4)]
        beta = torch.randn(2, 150, 3, device=DEV, generator=g)
        A_log, dt_bias = torch.rand(64, device=DEV) * 2 - 1, 0.5 * torch.randn(192, device=DEV)
        args = (*x, beta, A_log, dt_bias)
        only("kda")
        o, s = chunk_kda_with_gate(*args, lower_bound=-5.0, output_final_state=True)
        with use_backend("torch"):
            o_ref, s_ref = chunk_kda_with_gate(*args, lower_bound=-5.0, output_final_state=True)
        tok = ((o - o_ref).float().norm(dim=-1) / o_ref.float().norm(dim=-1)).flatten()
        print(f"kda op {str(dtype)[6:]}: o {rel_err(o, o_ref):.2e} state {rel_err(s, s_ref):.2e} first-token "
              f"{tok[0]:.2e} max token {tok.max():.2e}", flush=True)


if __name__ == "__main__":
    main()
