"""A LoRA training step against today's full fine-tuning step on the real-dims 4-layer slice
(configs/slice-train-4.json, B=1, T=8192, bf16): peak memory (target <= 0.5x) and step time (target <= 0.7x).

LoRA: rank 16 on every attention projection, the dense MLP, the shared experts and every routed expert (per-expert
factors), the frozen base in bf16 with its routed experts MXFP4-packed (`kimik3.quant.pack_experts`, the W4A16
path of `kimik3.ops.lora.LoraWeights`: the input gradient through the codes, no bf16 copy of the
experts), fp32 factors and AdamW states, the router bias frozen (balancing "frozen", as `kimik3 train` with a
[lora] table). The step is what the trainer runs: forward through `CausalLMLoss` under bf16 autocast, backward,
`optimizer_phase` (clip folded into `build_optimizer`'s AdamW) -- all of it resident and timed as one.

Full fine-tuning: `bench_train.py`'s bf16 step (bf16 experts): forward+backward timed with the gradients allocated,
then the trainer's optimizer phase on those gradients; its step time is their sum. bf16 weights, gradients and
AdamW's two states do not fit one H200 together with a forward's activations, so its peak is reported as measured
in the forward+backward plus the AdamW states that a real step keeps resident (two per weight, the weights'
dtype): the memory that step needs. The ratios are LoRA / full on those numbers.

    PYTHONPATH=src:. python3 bench/bench_lora.py          # device: table + $OUT/bench_lora.json
    .venv/bin/python bench/bench_lora.py --smoke          # CPU: configs/tiny.json, T=128, rank 4, the same code path
    ... --profile    # also: the LoRA step's kernels by device time and category, its aten ops by input shape, and
                     # the full step's fwd+bwd by category (what an ideal LoRA step keeps: all but weight gradients)
    ... --peer 'python3 bench/peer_automodel_lora.py'   # first, in the same call: NeMo AutoModel's PEFT step on
                     # its own K3 slice (nemo-automodel 0.7.0 and fla-core installed), its row and our ratio to it
"""

from __future__ import annotations

import argparse
import datetime
import functools
import os
import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for _p in (ROOT / "src", ROOT):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # before torch touches CUDA

import torch  # noqa: E402

from bench.common import kernel_category, run_peer, sync, table, write_json  # noqa: E402
from bench.train_parts import (  # noqa: E402
    GiB,
    Setup,
    attempt,
    build,
    describe,
    free,
    fwd_bwd,
    make_batch,
    peak_gib,
    release,
    reset_peak,
    set_checkpointing,
    time_fwd_bwd,
    time_ms,
    time_optimizer,
)
from kimik3 import lora  # noqa: E402
from kimik3.lora.memory import BENCH_TARGETS  # noqa: E402
from kimik3.presets import load_config  # noqa: E402
from kimik3.quant import pack_experts  # noqa: E402
from kimik3.train.balancing import Balancer  # noqa: E402
from kimik3.train.optim import build_optimizer  # noqa: E402
from kimik3.train.step import optimizer_phase  # noqa: E402

TARGETS = BENCH_TARGETS  # attention, the dense MLP, shared and routed experts (BENCHMARKS.md's memory table too)
MEMORY_TARGET, TIME_TARGET = 0.5, 0.7  # LoRA / full fine-tuning


def log(msg: str) -> None:
    print(f"[{datetime.datetime.now():%H:%M:%S}] {msg}", flush=True)


def profile(fn, title: str, device: torch.device, iters: int = 2, rows: int = 30, shapes: bool = True) -> dict:
    """fn()'s kernels under torch.profiler (after one untimed call): per-call device ms by kernel (top `rows`), by
    `bench.common.KERNEL_CATEGORIES` category, and (shapes) by aten op and input shapes, which tells the base
    grouped GEMMs from the rank-R factor ones. Prints the three tables; returns the category and kernel sums."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    fn()
    sync(device)
    cuda = device.type == "cuda"
    with torch_profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []),
                       record_shapes=shapes) as prof:
        for _ in range(iters):
            fn()
        sync(device)
    kind = DeviceType.CUDA if cuda else DeviceType.CPU
    self_us = (lambda e: e.self_device_time_total) if cuda else (lambda e: e.self_cpu_time_total)
    kernels: dict[str, tuple[float, float]] = {}
    for e in prof.key_averages():
        if (e.device_type == kind) if cuda else e.key.startswith("aten::"):  # the CPU smoke: ops, not kernels
            ms, n = kernels.get(e.key, (0.0, 0.0))
            kernels[e.key] = (ms + self_us(e) / 1e3 / iters, n + e.count / iters)
    total = sum(ms for ms, _ in kernels.values()) or 1.0
    top = sorted(kernels.items(), key=lambda kv: -kv[1][0])
    table(f"-- profile: {title}, {total:.1f} device ms per call ({sum(n for _, n in kernels.values()):.0f} "
          f"{'kernels' if cuda else 'ops'}), top {rows}", ["kernel", "calls", "ms", "share"],
          [[k[:90], f"{n:.0f}", f"{ms:.2f}", f"{ms / total:.1%}"] for k, (ms, n) in top[:rows]])
    cats: dict[str, float] = {}
    for k, (ms, _) in kernels.items():
        cats[kernel_category(k)] = cats.get(kernel_category(k), 0.0) + ms
    table(f"-- by category: {title} (device ms per call)", ["category", "ms", "share"],
          [[c, f"{ms:.2f}", f"{ms / total:.0%}"] for c, ms in sorted(cats.items(), key=lambda kv: -kv[1])])
    if shapes:
        ops = [e for e in prof.key_averages(group_by_input_shape=True)
               if e.key.startswith("aten::") and self_us(e) > 0]
        ops.sort(key=lambda e: -self_us(e))
        table(f"-- by aten op and input shapes: {title} (self device ms per call)", ["op", "input shapes", "calls",
              "ms"], [[e.key, str(e.input_shapes)[:110], f"{e.count / iters:.0f}", f"{self_us(e) / 1e3 / iters:.2f}"]
                      for e in ops[:rows]])
    return {"device_ms": total, "categories": cats, "top": {k: ms for k, (ms, _) in top[:rows]}}


def full_step(cfg, T: int, device: torch.device, args) -> dict:
    """Today's full fine-tuning step in bf16 (see the module docstring)."""
    s = build(cfg, "bf16", device, args.loss_chunk)
    weights = sum(p.numel() * p.element_size() for p in s.lm.parameters())
    fb = time_fwd_bwd(s, T, True, False, device, args.warmup, args.rep)
    if args.profile and fb.get("error") is None:
        batch = make_batch(s.lm.config.vocab_size, T, device, packed=True)
        fb["profile"] = profile(functools.partial(fwd_bwd, s, batch, device), f"full FT bf16 fwd+bwd T={T}", device,
                                shapes=False)
    opt = time_optimizer(s, T, device, args.warmup, args.rep, kinds=())
    release(s, device)
    del s
    free(device)
    phase = (opt.get("trainer") or {}).get("ms")
    out = {"weights_gib": weights / GiB, "adamw_states_gib": 2 * weights / GiB, "fwd_bwd": fb, "optimizer": opt}
    if fb.get("ms") is not None and phase is not None:
        out["ms"] = fb["ms"] + phase
    if fb.get("peak_gib") is not None:
        out["peak_gib"] = fb["peak_gib"] + out["adamw_states_gib"]
    return out


def lora_setup(cfg, device: torch.device, args) -> Setup:
    """The slice with bf16 (or --base-dtype) frozen weights, MXFP4 routed experts and the rank-R adapter."""
    s = build(cfg, args.base_dtype, device, args.loss_chunk)
    pack_experts(s.lm)  # the bf16 experts are encoded and dropped, layer by layer
    free(device)
    lora.apply(s.lm, lora.LoraConfig(rank=args.rank, alpha=2.0 * args.rank, targets=TARGETS))
    return Setup(s.lm, s.model, Balancer(s.lm, "frozen"))


def lora_step(cfg, T: int, device: torch.device, args) -> dict:
    s = lora_setup(cfg, device, args)
    log(lora.format_adapter_size(s.lm))
    frozen = sum(p.numel() * p.element_size() for p in s.lm.parameters() if not p.requires_grad)
    frozen += sum(b.numel() * b.element_size() for b in s.lm.buffers())
    trainable = [p for p in s.lm.parameters() if p.requires_grad]
    opt = build_optimizer(s.model, "adamw", 3e-4, 0.0, (0.9, 0.95), 1e-8)
    set_checkpointing(s.model, False)
    batch = make_batch(s.lm.config.vocab_size, T, device, packed=True)

    def step():
        fwd_bwd(s, batch, device, precision="bf16")
        optimizer_phase(s.model, opt, s.balancer, 1.0)

    out = {"base_dtype": args.base_dtype, "rank": args.rank,
           "frozen_gib": frozen / GiB, "adapter_params": sum(p.numel() for p in trainable),
           "adapter_gib": sum(p.numel() * p.element_size() for p in trainable) / GiB}
    _, err = attempt(step, device)  # the optimizer states exist from here on, as in a running job
    if err:
        out["error"] = err
    else:
        reset_peak(device)
        ms, err = attempt(lambda: time_ms(step, args.warmup, args.rep, device), device)
        out.update(ms=ms, peak_gib=peak_gib(device), error=err)
        out["finite_gradients"] = bool(all(p.grad is None or torch.isfinite(p.grad).all() for p in trainable))
        if args.profile and err is None:
            out["profile"] = profile(step, f"LoRA step r={args.rank} T={T}", device)
    opt.optimizers.clear()
    release(s, device)
    free(device)
    return out


PEER_LINE = re.compile(r"peer lora step: ([\d.]+) ms at T=(\d+), peak ([\d.]+) GiB, (\d+) adapter parameters, "
                       r"experts (\w+)")


def measure_peer(command: str, timeout: float, T: int) -> dict:
    """The peer's LoRA step, run before ours: its line, or why none came (with the end of its output)."""
    log(f"peer: {command} (limit {timeout:.0f} s)")
    out, why = run_peer(command, timeout)
    m = PEER_LINE.search(out)
    if m is None or int(m.group(2)) != T:
        log(f"peer: no LoRA step line at T={T} ({why}). Its output ends:\n" + out[-2000:])
        return {"error": f"no step line ({why})", "output_tail": out[-2000:]}
    peer = {"ms": float(m.group(1)), "peak_gib": float(m.group(3)), "adapter_params": int(m.group(4)),
            "experts": m.group(5), "notes": [line for line in out.splitlines() if line.startswith("NeMo PEFT")]}
    log(f"peer: {peer['ms']:.1f} ms, peak {peer['peak_gib']} GiB, experts {peer['experts']}")
    return peer


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="CPU logic check: configs/tiny.json, T=128, rank 4")
    ap.add_argument("--config", default="configs/slice-train-4.json")
    ap.add_argument("--tokens", type=int, default=8192, help="T of the one-row batch (B=1)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--base-dtype", choices=("bf16", "fp32-master"), default="bf16",
                    help="the frozen non-expert weights (kimik3 train loads an fp32 base today)")
    ap.add_argument("--loss-chunk", type=int, default=1024)
    ap.add_argument("--skip-full", action="store_true", help="time the LoRA step only")
    ap.add_argument("--profile", action="store_true",
                    help="profile the LoRA step (kernels, categories, aten ops by shape) and the full fwd+bwd")
    ap.add_argument("--peer", metavar="COMMAND",
                    help="a shell command that runs the peer's LoRA step first, in the same call, e.g.\n"
                         "'python3 bench/peer_automodel_lora.py' (its 'peer lora step' line is read)")
    ap.add_argument("--peer-timeout", type=float, default=300.0)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rep", type=int, default=6)
    args = ap.parse_args()
    if args.smoke:
        args.config, args.tokens, args.device, args.rank, args.warmup, args.rep = "configs/tiny.json", 128, "cpu", \
            4, 1, 2
        os.environ.setdefault("OUT", tempfile.mkdtemp(prefix="bench_lora_smoke_"))
    return args


def main() -> int:
    args = parse()
    device, T = torch.device(args.device), args.tokens
    in_repo = ROOT / args.config
    cfg = load_config(in_repo if not Path(args.config).exists() and in_repo.exists() else args.config).text
    torch.manual_seed(0)
    env = describe(device)
    log(f"{env}")
    result = {"env": env, "config": args.config, "tokens": T, "batch": 1, "targets": TARGETS,
              "memory_target": MEMORY_TARGET, "time_target": TIME_TARGET}
    if args.peer:  # first: the peer has the GPU to itself, as it would alone
        result["peer"] = measure_peer(args.peer, args.peer_timeout, T)
    log(f"LoRA rank {args.rank}, {args.base_dtype} base, MXFP4 routed experts: step T={T}")
    result["lora"] = lo = lora_step(cfg, T, device, args)
    log("    " + (lo.get("error") or f"{lo['ms']:.1f} ms, peak {lo['peak_gib']} GiB"))
    full = None
    if not args.skip_full:
        log(f"full fine-tuning, bf16: fwd+bwd and the optimizer phase, T={T}")
        result["full"] = full = full_step(cfg, T, device, args)
        log(f"    {full.get('ms')} ms, peak (fwd+bwd + AdamW states) {full.get('peak_gib')} GiB")
    rows = []
    gib = lambda x: "-" if x is None else f"{x:.1f}"  # noqa: E731
    rows.append([f"LoRA r={args.rank} ({args.base_dtype} base, MXFP4 experts)", gib(lo.get("ms")),
                 gib(lo.get("peak_gib")), f"{lo['adapter_params']:,}", lo.get("error") or ""])
    if full is not None:
        fb, tr = full["fwd_bwd"], (full["optimizer"].get("trainer") or {})
        rows.append(["full FT bf16: fwd+bwd", gib(fb.get("ms")), gib(fb.get("peak_gib")), "", fb.get("error") or ""])
        rows.append(["full FT bf16: optimizer phase", gib(tr.get("ms")), gib(tr.get("peak_gib")), "",
                     tr.get("error", "")[:40]])
        rows.append(["full FT bf16: step (sum; peak + AdamW states)", gib(full.get("ms")), gib(full.get("peak_gib")),
                     "", ""])
        if lo.get("ms") and full.get("ms"):
            result["time_ratio"] = lo["ms"] / full["ms"]
        if lo.get("peak_gib") and full.get("peak_gib"):
            result["memory_ratio"] = lo["peak_gib"] / full["peak_gib"]
    peer = result.get("peer") or {}
    if peer:
        rows.append([f"peer: NeMo AutoModel 0.7.0 PEFT (experts {peer.get('experts', '?')})", gib(peer.get("ms")),
                     gib(peer.get("peak_gib")), f"{peer['adapter_params']:,}" if peer.get("adapter_params") else "",
                     peer.get("error", "")[:60]])
        if lo.get("ms") and peer.get("ms"):
            result["peer_time_ratio"] = lo["ms"] / peer["ms"]
            log(f"ours / peer: time {result['peer_time_ratio']:.2f}x")
        if lo.get("peak_gib") and peer.get("peak_gib"):
            result["peer_memory_ratio"] = lo["peak_gib"] / peer["peak_gib"]
            log(f"ours / peer: memory {result['peer_memory_ratio']:.2f}x")
    table(f"LoRA vs full fine-tuning, {args.config}, B=1, T={T}", ["step", "ms", "peak GiB", "adapter params", ""],
          rows)
    ok = lo.get("error") is None and lo.get("finite_gradients", False)
    for key, target in (("memory_ratio", MEMORY_TARGET), ("time_ratio", TIME_TARGET)):
        if key in result:
            met = result[key] <= target
            result[key.replace("ratio", "target_met")] = met
            print(f"{key.replace('_', ' ')}: LoRA / full = {result[key]:.2f}x (target <= {target}x: "
                  f"{'MET' if met else 'NOT MET'})", flush=True)
    path = write_json("bench_lora", result)
    print(f"(json: {path})", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
