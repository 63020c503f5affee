"""`bench.common.kernel_category`: kernel names from the H200 profiles in bench/results land in the category a
closing note reasons about (the first matching category wins, so the order of KERNEL_CATEGORIES matters).

Benchmarks are scripts: like tests/bench/test_bench_smoke.py, this runs them in a subprocess and never imports
them (tests/test_layering.py)."""

import json
import os
import subprocess
import sys

from tests.helpers import REPO

SEEN = {  # a kernel name as the profiler printed it on the H200: its category
    "void humming<MmaOpClass, Shape<0u, 6144u, 3584u>, Shape<8u, 256u, 1...": "MoE W4A16 experts",
    "_gate_up_kernel": "MoE W4A16 experts",
    "_tables_kernel": "MoE W4A16 experts",
    "_situ_kernel": "MoE W4A16 experts",  # Humming's path: the SiTU between its two GEMMs
    "_sum_rows_kernel": "grouped expert GEMMs and their gathers",
    "_combine_backward_kernel": "grouped expert GEMMs and their gathers",
    "_lowrank_add_kernel": "grouped expert GEMMs and their gathers",  # LoRA's rank-R products over the experts
    # torch._grouped_mm's CUTLASS kernel (bench_train's profile: the 54 aten::_grouped_mm calls' device time)
    "_ZN7cutlass13device_kernelIN2at4cuda6detail25enable_3x_kernel_for_s...": "grouped expert GEMMs and their gathers",
    "nvjet_sm90_tst_128x8_64x12_4x1_v_bz_TNT": "dense GEMMs (cuBLAS)",
    "void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat1...": "dense GEMMs (cuBLAS)",
    "void cutlass::Kernel2<cutlass_75_tensorop_s1688gemm_bf16_128x128_tn...": "dense GEMMs (cuBLAS)",
    "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_...": "attention (cuDNN / SDPA)",
    "chunk_kda_fwd_kernel_inter_solve_fused": "KDA (fla)",
    "chunk_gated_delta_rule_fwd_kernel_h_blockdim64": "KDA (fla)",
    "fused_recurrent_kda_fwd_kernel": "KDA (fla)",
    "recompute_w_u_fwd_kda_kernel": "KDA (fla)",
    "Memcpy DtoD (Device -> Device)": "copies, casts and fills",
    "void at::native::(anonymous namespace)::CatArrayBatchedCopy<at::nat...": "copies, casts and fills",
    "void at::native::vectorized_elementwise_kernel<8, at::native::FillF...": "copies, casts and fills",
    "void at::native::elementwise_kernel<128, 2, at::native::gpu_kernel_...": "torch elementwise and reductions",
    "void at::native::radixSortKVInPlace<-2, -1, 16, 2, long, long, unsi...": "torch elementwise and reductions",
    "_fwd_kernel": "fused Triton (ours)",
    "_forward_kernel": "fused Triton (ours)",
    "_route_kernel": "fused Triton (ours)",
    "_decode_kernel": "fused Triton (ours)",
    "_split_kernel": "fused Triton (ours)",  # the paged MLA decode's two stages
    "_combine_kernel": "fused Triton (ours)",
    "_mxfp4_decode_kernel": "MXFP4 decode (transient expert weights)",
    "_matmul_kernel": "dense GEMMs (ours, batch-invariant)",  # kimik3.ops.matmul, the deterministic mode's products
    "some_new_kernel": "other",
}
PROBE = """
import json, sys
from bench.common import category_table, kernel_category
names = json.loads(sys.argv[1])
text = category_table({"nvjet_a": 3.0, "nvjet_b": 1.0, "_route_kernel": 1.0, "mystery": 0.0}, "t")
print(json.dumps({"categories": {n: kernel_category(n) for n in names}, "table": text}))
"""


def test_profiled_kernels_land_in_their_category():
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    proc = subprocess.run([sys.executable, "-c", PROBE, json.dumps(list(SEEN))], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["categories"] == SEEN
    lines = result["table"].splitlines()  # largest first, with shares of the total
    assert "dense GEMMs (cuBLAS)" in lines[2] and "4.000" in lines[2] and "80%" in lines[2]
    assert "fused Triton (ours)" in lines[3] and "20%" in lines[3]
