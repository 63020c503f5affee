"""MLA decode: absorbed attention over the 576-wide latent cache vs expanding per-head K/V (K3 shapes).

    PYTHONPATH=src:. python3 bench/bench_mla.py [--smoke]    # --smoke: CPU check, short caches
"""

from __future__ import annotations

import torch

from bench.common import DEVICE, environment, median_ms, table, write_json
from kimik3.ops.mla import mla_latent_attention

H, N, R, V, C = 96, 128, 64, 128, 512


def expanded_decode(q, latent, w, scale):
    """The naive form: up-project every cached latent to per-head K and V, then attend."""
    B, S = latent.shape[:2]
    kv = (latent[..., :C] @ w.T).view(B, S, H, N + V)
    k = torch.cat([kv[..., :N], latent[..., None, C:].expand(B, S, H, R)], -1)
    return torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                            kv[..., N:].transpose(1, 2), scale=scale).transpose(1, 2)


def main(smoke: bool = False):
    rows, results = [], {}
    w = torch.randn(H * (N + V), C, device=DEVICE, dtype=torch.bfloat16) / C**0.5
    for B, S in ((1, 64), (4, 64)) if smoke else ((1, 8192), (8, 8192), (64, 8192), (1, 65536)):
        q = torch.randn(B, 1, H, N + R, device=DEVICE, dtype=torch.bfloat16)
        latent = torch.randn(B, S, C + R, device=DEVICE, dtype=torch.bfloat16)
        mask = torch.ones(B, 1, S, dtype=torch.bool, device=DEVICE)
        a = mla_latent_attention(q, latent, w, qk_nope_head_dim=N, scale=(N + R) ** -0.5, mask=mask)
        b = expanded_decode(q, latent, w, (N + R) ** -0.5)
        err = ((a.float() - b.float()).norm() / b.float().norm()).item()
        t_abs = median_ms(lambda: mla_latent_attention(q, latent, w, qk_nope_head_dim=N, scale=(N + R) ** -0.5,
                                                       mask=mask))
        t_exp = median_ms(lambda: expanded_decode(q, latent, w, (N + R) ** -0.5))
        cache_bytes = B * S * (C + R) * 2
        results[f"B={B} S={S}"] = {"absorbed_ms": t_abs, "expanded_ms": t_exp, "rel_err": err,
                                   "cache_bytes": cache_bytes}
        rows.append([f"B={B} S={S}", f"{t_abs:.3f}", f"{t_exp:.3f}", f"{t_exp / t_abs:.1f}x", f"{err:.1e}"])
    table("MLA decode, one layer (median ms)", ["case", "absorbed", "expanded", "speedup", "rel err"], rows)
    write_json("bench_mla", {"env": environment(), "results": results})


if __name__ == "__main__":
    import sys

    main(smoke="--smoke" in sys.argv[1:])
