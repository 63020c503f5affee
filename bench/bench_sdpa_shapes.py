"""What SDPA costs the first time it sees a shape, per backend: the engine's MLA steps change shape every step.

A serving engine's steps are ragged: the number of sequences, the tokens each brings and the key span differ from
one step to the next, so an attention backend that builds a plan per shape (cuDNN's SDPA graphs) pays that build
on the requests' critical path again and again. This bench feeds each backend shapes it has not seen, at K3's MLA
widths (96 heads, qk 192, v 128, bf16), and reports the first call and the warm call at each, for the masked form
(the engine's paged steps) and the causal form (prefill, training per document), with each backend's error
against an fp32 math-kernel truth.

    PYTHONPATH=src:. python3 bench/bench_sdpa_shapes.py     # device: table + $OUT/bench_sdpa_shapes.json
"""

from __future__ import annotations

import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

H, K, V = 96, 192, 128
BACKENDS = {"default": None, "cudnn": SDPBackend.CUDNN_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION}
# (sequences, query rows, key span): fresh shapes, as a stream of mixed engine steps brings them
MASKED = [(64, 5, 1033), (64, 9, 1290), (37, 13, 777), (8, 512, 1024), (8, 300, 905), (3, 117, 1500)]
CAUSAL = [700, 1234, 2049, 3001, 4100]


def _timed(fn) -> tuple[float, torch.Tensor]:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return 1e3 * (time.perf_counter() - t0), out


def run(case: str, backend, shapes: list) -> list[dict]:
    rows, g = [], torch.Generator(device="cuda").manual_seed(0)
    for shape in shapes:
        if case == "masked":
            n, t, s = shape
            q = torch.randn(n, H, t, K, device="cuda", generator=g, dtype=torch.bfloat16)
            k = torch.randn(n, H, s, K, device="cuda", generator=g, dtype=torch.bfloat16)
            v = torch.randn(n, H, s, V, device="cuda", generator=g, dtype=torch.bfloat16)
            # each query sees its sequence's cached keys and the new ones up to itself (ragged: a per-row length)
            lens = torch.randint(t, s + 1, (n,), device="cuda", generator=g)
            pos = lens[:, None] - t + torch.arange(t, device="cuda")[None]  # [n, t] query positions
            mask = (torch.arange(s, device="cuda")[None, None] <= pos[..., None])[:, None]  # [n, 1, t, s]
            kwargs = {"attn_mask": mask}
        else:
            n, t, s = 1, shape, shape
            q, k = (torch.randn(1, H, t, K, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(2))
            v = torch.randn(1, H, t, V, device="cuda", generator=g, dtype=torch.bfloat16)
            kwargs = {"is_causal": True}
        with sdpa_kernel([SDPBackend.MATH]):
            truth = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), **kwargs)

        def call(q=q, k=k, v=v):
            if backend is None:
                return F.scaled_dot_product_attention(q, k, v, **kwargs)
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(q, k, v, **kwargs)

        try:
            first, out = _timed(call)
            warm = min(_timed(call)[0] for _ in range(3))
            err = ((out.float() - truth).norm() / truth.norm()).item()
            rows.append({"shape": shape, "first_ms": first, "warm_ms": warm, "relerr": err})
        except RuntimeError as e:  # this backend does not take this shape or mask
            rows.append({"shape": shape, "error": str(e).splitlines()[0][:120]})
        del q, k, v, truth
    return rows


def main() -> int:
    from bench.common import environment, table, write_json

    results, lines = {}, []
    for case, shapes in (("masked", MASKED), ("causal", CAUSAL)):
        for name, backend in BACKENDS.items():
            rows = results[f"{case} {name}"] = run(case, backend, shapes)
            for r in rows:
                lines.append([case, name, str(r["shape"]), *(
                    [f"{r['first_ms']:.1f}", f"{r['warm_ms']:.2f}", f"{r['relerr']:.1e}"] if "error" not in r
                    else [r["error"], "", ""])])
            print(f"-- {case} {name}: {rows}", flush=True)
    table("SDPA at K3's MLA widths (96 heads, qk 192, v 128, bf16): first call at a new shape vs warm",
          ["form", "backend", "shape", "first ms", "warm ms", "rel err vs fp32"], lines)
    write_json("bench_sdpa_shapes", {"env": environment(), "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
