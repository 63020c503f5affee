"""Check, without a GPU, that Humming's tile heuristics decide on the row sample alone, as `kimik3.ops.moe.humming.
_row_sample` assumes on sm_90: for every routed-row count a serve warm-up asks (1..TOKENS tokens x top-16, K3's two
expert layers, default and batch-invariant), the decision at the count equals the one at its sample.

Humming reads the GPU through one device query (`humming.device._get_device_info_extension`); here it answers with
an H200's profile (below), so the heuristics run on the CPU exactly as their source is written. Needs the pinned
humming-kernels and cuda-bindings importable (no CUDA driver is called):

    pip install --target /tmp/hum --no-deps humming_kernels-0.1.20-*.whl && pip install --target /tmp/hum cuda-bindings
    PYTHONPATH=/tmp/hum:src python3 tools/check_humming_samples.py      # exit 1 if any decision differs
On a GPU machine the same check runs for real as tests/ops/test_moe_humming.py's row-sample test.
"""

from __future__ import annotations

import contextlib
import sys
import time
import types

import torch

TOKENS, TOP_K = 4096, 16  # serve's defaults: 2 x 2,048 tokens a step at most, K3's top-16
E, F, L = 896, 3072, 3584  # K3's routed experts: count, expert width, latent width


class H200:
    """The device profile Humming's heuristics read (an H200 SXM: 132 SMs, 50 MB of L2)."""

    name, sm_version, sm_major, sm_minor, is_ppu = "NVIDIA H200", 90, 9, 0, False
    sm_count, max_registers_per_sm, l2_cache_size = 132, 65536, 50 * 2**20
    memory_bandwidth_gbps, tensorcore_tops = 4800, 989


def main() -> int:
    import humming.device

    humming.device._get_device_info_extension = lambda: types.SimpleNamespace(_DeviceInfo=lambda index: H200())
    torch.cuda.device = lambda index: contextlib.nullcontext()  # the heuristics enter the device's context
    from humming import dtypes
    from humming.schema import HummingWeightSchema
    from humming.transform import prepare_layer_config
    from humming.tune import get_heuristics_class, get_heuristics_config

    schema = HummingWeightSchema(b_dtype=dtypes.float4e2m1, bs_dtype=dtypes.float8e8m0, weight_scale_group_size=32)

    def layer(n: int, k: int):  # as kimik3.ops.moe.humming._relayout prepares it (the values do not matter)
        tensors = {"weight": torch.zeros(E, n, k // 8, dtype=torch.int32),
                   "weight_scale": torch.zeros(E, n, k // 32, dtype=torch.uint8).view(torch.float8_e8m0fnu)}
        return prepare_layer_config(shape_n=n, shape_k=k, weight_schema=schema, num_experts=E, pad_n_to_multiple=256,
                                    pad_k_to_multiple=128, torch_dtype=torch.bfloat16, device=0, tensors=tensors)

    heuristics = get_heuristics_class(0)
    differ, total, t0 = [], 0, time.perf_counter()
    for name, config in (("w13", layer(2 * F, L)), ("w2", layer(L, F))):
        for invariant in (False, True):
            for n in range(1, TOKENS + 1):
                rows = n * TOP_K
                sample = heuristics.get_shape_m_sample(config, rows)
                at = [get_heuristics_config(layer_config=config, shape_m=m, gemm_type="indexed", device=0,
                                            use_batch_invariant=invariant) for m in (rows, sample)]
                total += 1
                if at[0] != at[1]:
                    differ.append((name, invariant, rows, sample))
    print(f"{heuristics.__name__}: {total} row counts, {len(differ)} decided otherwise than their sample "
          f"({time.perf_counter() - t0:.1f} s)")
    for case in differ[:10]:
        print("  differs: layer %s, invariant %s, rows %d, sample %d" % case)
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
