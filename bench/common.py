"""Shared by the GPU benchmarks: ceilings measured in the same run, median timing, tables, JSON results.

Run on the device from the repository root, e.g. `PYTHONPATH=src:. python3 bench/bench_layer.py`.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import time
from pathlib import Path

import torch

from kimik3.config import K3Config
from kimik3.ops.backend import use_backend

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def smoke_config(name: str) -> K3Config:
    """`configs/NAME.json` at toy sizes, same layer pattern and features (for `--smoke` runs on the CPU)."""
    d = json.loads((CONFIGS / f"{name}.json").read_text())
    t = d["text_config"]
    t["linear_attn_config"].update(num_heads=2, head_dim=32)
    t.update(hidden_size=64, intermediate_size=128, num_attention_heads=2, num_key_value_heads=2, q_lora_rank=32,
             kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, num_experts=8,
             num_experts_per_token=2, routed_expert_hidden_size=32, moe_intermediate_size=64, vocab_size=1024,
             bos_token_id=768, eos_token_id=770, pad_token_id=1023)
    d.update(bos_token_id=768, eos_token_id=770, pad_token_id=1023)
    return K3Config.from_hf(d)


def sync(device: torch.device = DEVICE) -> None:
    """Wait for the device's queued work (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize()


def median_ms(fn, warmup: int = 10, rep: int = 50) -> float:
    """Median wall time of fn() in milliseconds, timed with CUDA events around each call (CPU: perf_counter)."""
    if DEVICE.type != "cuda":
        times = []
        for _ in range(max(rep // 10, 1)):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return sorted(times)[len(times) // 2]
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(rep):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def graphed(fn):
    """Capture fn() (static shapes, no host syncs) in a CUDA graph; returns replay (for decode timing)."""
    if DEVICE.type != "cuda":
        return fn
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def run_peer(command: str, timeout: float) -> tuple[str, str]:
    """Run a peer's script (a shell command) to its end or `timeout`: (its stdout + stderr, how it ended)."""
    try:
        proc = subprocess.run(command, shell=True, capture_output=True, text=True, timeout=timeout)
        return proc.stdout + proc.stderr, f"exit {proc.returncode}"
    except subprocess.TimeoutExpired as e:
        out = "".join(x.decode() if isinstance(x, bytes) else x or "" for x in (e.stdout, e.stderr))
        return out, f"timed out after {timeout:.0f} s"


def profile_top(fn, title: str, iters: int = 5, rows: int = 25) -> None:
    """Print the kernels fn() launches, by total device time over `iters` calls (torch.profiler; eager)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn()
    sync()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if DEVICE.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(iters):
            fn()
        sync()
    key = "self_device_time_total" if DEVICE.type == "cuda" else "self_cpu_time_total"
    events = prof.key_averages()
    # the launch count is what decode fusions cut (issue 18 counts "kernels per layer" before and after)
    kernels = sum(e.count for e in events if e.device_type == DeviceType.CUDA) / iters
    print(f"-- profile: {title} ({iters} calls" + (f", {kernels:.0f} kernels per call)" if DEVICE.type == "cuda"
                                                  else ")"), flush=True)
    print(events.table(sort_by=key, row_limit=rows, max_name_column_width=70), flush=True)
    if DEVICE.type == "cuda":
        device_ms = {e.key: e.self_device_time_total / 1e3 / iters for e in events if e.device_type == DeviceType.CUDA}
        category_table(device_ms, title)


# (category, name fragments), first match wins: a profile's kernels summed into what a note can reason about
KERNEL_CATEGORIES = (
    ("MoE W4A16 experts", ("humming", "_gate_up_kernel", "_down_kernel", "_tiles_kernel", "_tables_kernel",
                           "_situ_kernel")),
    # LoRA over packed experts (kimik3.ops.lora.experts_grouped): a layer's codes decoded into a transient bf16 buffer
    ("MXFP4 decode (transient expert weights)", ("_mxfp4_decode_kernel",)),
    # torch's own CUTLASS 3.x kernels (at::cuda::detail::enable_3x_kernel_for_sm9x) are its grouped GEMM here
    ("grouped expert GEMMs and their gathers", ("grouped", "_sum_rows_kernel", "_combine_backward_kernel",
                                                "enable_3x_kernel_for_s", "_lowrank_add_kernel")),
    ("attention (cuDNN / SDPA)", ("cudnn", "fmha", "flash", "attention", "sdpa")),
    ("KDA (fla)", ("kda", "gla", "delta_rule", "chunk_", "recompute_w_u", "rms_norm_gated", "fused_recurrent")),
    ("dense GEMMs (cuBLAS)", ("nvjet", "gemm", "cutlass", "splitkreduce", "xmma", "cublas")),
    # the batch-invariant mode's products (kimik3.ops.matmul): the dense GEMMs' place in a deterministic step
    ("dense GEMMs (ours, batch-invariant)", ("_matmul_kernel",)),
    ("copies, casts and fills", ("copy", "memcpy", "catarray", "memset", "fill")),
    ("torch elementwise and reductions", ("elementwise", "reduce", "softmax", "sort", "scan", "index", "gather",
                                          "scatter", "where")),
    # (the paged MLA decode's two stages are `_split_kernel` and `_combine_kernel`)
    ("fused Triton (ours)", ("_fwd_kernel", "_bwd_kernel", "_forward_kernel", "_backward_kernel", "_decode_kernel",
                             "_route_kernel", "_seq_", "_gathered_", "_gemv", "_reduce_kernel", "_split_kernel",
                             "_combine_kernel")),
)


def kernel_category(name: str) -> str:
    low = name.lower()
    return next((cat for cat, frags in KERNEL_CATEGORIES if any(f.lower() in low for f in frags)), "other")


def category_table(device_ms: dict[str, float], title: str) -> str:
    """Device ms per call by KERNEL_CATEGORIES (and each category's share), largest first."""
    sums: dict[str, float] = {}
    for name, ms in device_ms.items():
        sums[kernel_category(name)] = sums.get(kernel_category(name), 0.0) + ms
    total = sum(sums.values()) or 1.0
    rows = [[cat, f"{ms:.3f}", f"{ms / total:.0%}"] for cat, ms in sorted(sums.items(), key=lambda kv: -kv[1])]
    return table(f"-- by category: {title} (device ms per call)", ["category", "ms", "share"], rows)


def ceilings() -> dict:
    """Measured device-to-device copy bandwidth (bytes read + written per second) and bf16 matmul rate."""
    n, m = (2**31, 8192) if DEVICE.type == "cuda" else (2**22, 256)
    x = torch.empty(n // 2, dtype=torch.bfloat16, device=DEVICE).normal_()
    y = torch.empty_like(x)
    copy_ms = median_ms(lambda: y.copy_(x), 3, 20)
    a = torch.randn(m, m, device=DEVICE, dtype=torch.bfloat16)
    b = torch.randn(m, m, device=DEVICE, dtype=torch.bfloat16)
    mm_ms = median_ms(lambda: a @ b, 3, 20)
    return {"copy_bytes_per_s": 2 * n / (copy_ms * 1e-3), "bf16_flops_per_s": 2 * m**3 / (mm_ms * 1e-3)}


def environment() -> dict:
    versions = {}
    for name in ("triton", "fla"):
        try:
            versions[name] = getattr(__import__(name), "__version__", None)
        except ImportError:
            versions[name] = None
    gpu = torch.cuda.get_device_name() if DEVICE.type == "cuda" else "none (CPU smoke run)"
    return {"date": datetime.date.today().isoformat(), "gpu": gpu, "torch": torch.__version__, **versions,
            "python": platform.python_version()}


FUSED_COLUMNS = ["shape", "pass", "reference", "fused", "speedup", "of bytes floor", "rel err"]


def fused_case(name: str, shape, fwd, fwd_bwd, floors: dict) -> tuple[dict, float, list[list[str]]]:
    """A fused op against its reference, on one shape: the median ms of fwd() (no gradient) and fwd_bwd() with each
    backend ("auto PASS" the fused kernels, "torch PASS" the reference), the fused output's relative error from the
    reference's, and the two table rows (fwd, fwd+bwd; columns FUSED_COLUMNS). floors: the bytes floor of each
    pass, in ms. Returns (results entry: the medians and floors, error, rows)."""
    res = {}
    for backend in ("auto", "torch"):
        with use_backend(backend), torch.no_grad():
            res[f"{backend} fwd"] = median_ms(fwd, 3, 20)
        with use_backend(backend):
            res[f"{backend} fwd+bwd"] = median_ms(fwd_bwd, 3, 20)
    with torch.no_grad():
        with use_backend("torch"):
            ref = fwd().float()
        error = float((fwd().float() - ref).norm() / ref.norm())
    rows = []
    for kind in ("fwd", "fwd+bwd"):
        fast, ref_ms = res[f"auto {kind}"], res[f"torch {kind}"]
        rows.append([f"{name} {list(shape)}", kind, f"{ref_ms:.3f}", f"{fast:.3f}", f"{ref_ms / fast:.1f}x",
                     f"{floors[kind] / fast:.0%}", f"{error:.1e}"])
    return {**res, **{f"floor {k} ms": v for k, v in floors.items()}}, error, rows


def table(title: str, headers: list[str], rows: list[list]) -> str:
    cells = [[str(c) for c in r] for r in [headers, *rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = [title] + ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells]
    text = "\n".join(lines)
    print(text, flush=True)
    return text


def write_json(name: str, data: dict) -> Path:
    """Write $OUT/NAME.json (OUT unset: out/bench/, which git ignores); returns the path."""
    out = Path(os.environ.get("OUT", "out/bench"))
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    path.write_text(json.dumps(data, indent=2, default=str))
    return path


def byte_compile(prefix: str = "/tmp/kimik3-bench-pycache") -> float:
    """Byte-compile every module on the path into `prefix` and point this process's children there
    (PYTHONPYCACHEPREFIX): what pip does at install time. The device image's site-packages is read-only and has no
    .pyc, so each new process there compiled ~3,000 modules' source (7.4 s of a 16 s `kimik3 generate` under
    cProfile on the H200): a cost no installed user pays. Returns the seconds it took (part of no row)."""
    import sys
    import sysconfig

    root = Path(__file__).resolve().parents[1]
    t0 = time.monotonic()
    dirs = {sysconfig.get_paths()["purelib"], str(root / "src"), *(p for p in sys.path if p.startswith("/tmp/site"))}
    subprocess.run([sys.executable, "-m", "compileall", "-q", "-j", "0", *sorted(d for d in dirs if Path(d).is_dir())],
                   env={**os.environ, "PYTHONPYCACHEPREFIX": prefix}, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    os.environ["PYTHONPYCACHEPREFIX"] = prefix
    seconds = time.monotonic() - t0
    print(f"byte-compiled the path in {seconds:.1f} s (as pip does at install; part of no row)", flush=True)
    return seconds


def capture_graphs(engine) -> None:
    """Capture the engine's graphs of every batch bucket now, as a warming engine does (an engine without warm-up
    captures each at its first step: a timed step would include it)."""
    with torch.no_grad(), engine.mode():
        engine.runner.capture_graphs()


def decoding_engine(model, B: int, s: dict, max_model_len: int | None, graphs: bool, spare: int = 0,
                    deterministic: bool = False):
    """An engine whose B sequences of `context` tokens are prefilled and decoding (s: context, steps, budget;
    the MLA pool sized for that context alone, plus `spare` tokens' blocks and one more slot when `spare`)."""
    from kimik3.inference import SamplingParams
    from kimik3.inference.engine import Engine, EngineConfig, Request

    def greedy(n: int) -> SamplingParams:
        return SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True)

    per_seq = -(-(s["context"] + s["steps"] + 64) // 64)
    engine = Engine(model, EngineConfig(max_num_seqs=B + (spare > 0),
                                        max_num_batched_tokens=max(s["budget"], s["context"] + 64),
                                        max_model_len=max_model_len, use_cuda_graphs=graphs, enable_prefix_cache=False,
                                        num_blocks=B * per_seq + -(-spare // 64) + 8, deterministic=deterministic))
    capture_graphs(engine)
    g = torch.Generator().manual_seed(B)
    for i in range(B):
        prompt = torch.randint(0, 1000, (s["context"],), generator=g).tolist()
        engine.add_request(Request(str(i), prompt, greedy(s["steps"] + 8)))
    while engine.stats["waiting"] or any(q.num_computed < len(q.tokens) - 1 for q in engine.scheduler.running):
        engine.step()  # prefills
    return engine
