"""Training step of the real-dims 4-layer slice (configs/slice-train-4.json: layer 0 KDA + dense MLP, two
KDA + MoE, one MLA + MoE, 128 experts top-16, released vocabulary) at B=1, T=8192 on one H200, side by side
with NeMo AutoModel 0.7.0's K3 on the same slice (design.md section 6: 732 ms/step, 11,189 tokens/s,
385 TFLOP/s = 56% of the measured bf16 matmul rate). Target: >= 1.2x its tokens/s.

A step is what `kimik3.train.step.train_step` does for one micro-batch: forward through `CausalLMLoss`
(chunked cross-entropy, routers fp32, balancing statistics collected) under bf16 autocast, backward, then
gradient clipping, AdamW and the QB bias update. The slice has 17.9B parameters: fp32 master weights do not
fit one GPU (weights + gradients alone are 143 GB), and bf16 weights + gradients + AdamW states (143 GB) do
not fit together with the activations of a forward. So one process times two phases on the same model,
forward+backward (with the gradients allocated as in training) and then clip + AdamW + QB update on those
gradients, and the step is their sum. fp32 master weights are timed where they fit (`--smoke`; on the GPU
at `--compare-experts` experts per MoE layer, next to bf16 weights at the same size).

Matmul FLOPs per step, forward + backward = 3 x forward (recomputation not counted):
    every nn.Linear, the LM head included    2 T in out
    routers (fp32 matmul)                     2 T D E
    routed experts                            2 T A 3 F L
    MLA attention, causal                     2 H (K_qk + V) T^2 / 2
This is the count behind NeMo's 385 TFLOP/s (6 x active parameters + causal MLA = 281.6 TFLOP per 8192-token
step, over 732 ms). KDA's delta rule is left out (as there); its recurrent-form count is reported alongside.

    PYTHONPATH=src:. python3 bench/bench_train.py      # device: table + $OUT/bench_train.json
    .venv/bin/python bench/bench_train.py --smoke      # CPU: configs/tiny.json, T=128, the same code path
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for _p in (ROOT / "src", ROOT):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # before torch touches CUDA

import torch  # noqa: E402
from torch import nn  # noqa: E402

from bench.common import ceilings, environment, median_ms, table, write_json  # noqa: E402
from kimik3.distributed.parallelize import apply_activation_checkpointing, decoder_layers  # noqa: E402
from kimik3.model import K3ForCausalLM  # noqa: E402
from kimik3.model.kda import KimiDeltaAttention  # noqa: E402
from kimik3.model.mla import MultiHeadLatentAttention  # noqa: E402
from kimik3.model.moe import LatentMoE  # noqa: E402
from kimik3.ops.backend import use_backend  # noqa: E402
from kimik3.presets import load_config  # noqa: E402
from kimik3.train.balancing import Balancer  # noqa: E402
from kimik3.train.loss import CausalLMLoss  # noqa: E402
from kimik3.train.optim import Optimizers, param_groups  # noqa: E402
from kimik3.train.step import autocast, keep_routers_fp32  # noqa: E402

PEER = {"name": "NeMo AutoModel 0.7.0", "ms": 732.0, "tokens_per_s": 11189.0, "tflops": 385.0, "fraction": 0.56}
TARGET = 1.2  # ours / peer, tokens per second
CHECK_TOL = 2e-2  # fast path vs use_backend("torch"): relative difference of the loss and of gradient norms
PROBES = ("lm_head.weight", "embed_tokens.weight", "self_attn.q_proj.weight", "self_attn.A_log",
          "self_attn.q_b_proj.weight", "mlp.down_proj.weight", "gate.weight", "experts.w1", "experts.w2",
          "shared_experts.up_proj.weight", "mlp_res_proj.weight")
PRECISIONS = {"bf16": torch.bfloat16, "fp32-master": torch.float32}
GiB = 2**30


def log(msg: str) -> None:
    print(f"[{datetime.datetime.now():%H:%M:%S}] {msg}", flush=True)


# ---------------------------------------------------------------------------------------------- counting


def matmul_flops(lm: nn.Module, T: int) -> dict[str, float]:
    """Forward matmul FLOPs of one T-token row by component (see the module docstring); `kda` is not counted."""
    out = dict(linear=0.0, lm_head=0.0, router=0.0, experts=0.0, mla_attention=0.0, kda=0.0)
    for m in lm.modules():
        if isinstance(m, nn.Linear):
            out["lm_head" if m is lm.lm_head else "linear"] += 2 * T * m.in_features * m.out_features
        elif isinstance(m, LatentMoE):
            E, F, L = m.experts.w1.shape
            out["router"] += 2 * T * m.gate.weight.shape[1] * E
            out["experts"] += 2 * T * m.gate.top_k * 3 * F * L
        elif isinstance(m, MultiHeadLatentAttention):
            c = m.cfg
            out["mla_attention"] += 2 * c.num_heads * (c.qk_head_dim + c.v_head_dim) * T * T / 2
        elif isinstance(m, KimiDeltaAttention):  # recurrent form: S^T k, k u^T, S^T q per token (metrics.py)
            out["kda"] += 6 * m.num_heads * m.head_dim * m.head_dim * T
    return out


def short(name: str) -> str:
    return name.removeprefix("model.").removesuffix(".weight")


def counted(flops: dict[str, float]) -> float:
    """Forward + backward matmul FLOPs of the headline count (KDA left out)."""
    return 3 * sum(v for k, v in flops.items() if k != "kda")


# ---------------------------------------------------------------------------------------------- timing


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_ms(fn, warmup: int, rep: int, device: torch.device) -> float:
    """Median milliseconds of fn(): CUDA events on the GPU (bench.common.median_ms), perf_counter on the CPU."""
    if device.type == "cuda":
        return median_ms(fn, warmup, rep)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(rep):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


def time_once(fn, device: torch.device) -> float:
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return (time.perf_counter() - t0) * 1e3


def cpu_ceilings() -> dict:
    """The CPU's bf16 matmul rate (1024^3), for --smoke's 'fraction of the matmul rate'."""
    a, b = torch.randn(1024, 1024, dtype=torch.bfloat16), torch.randn(1024, 1024, dtype=torch.bfloat16)
    ms = time_ms(lambda: a @ b, 2, 5, torch.device("cpu"))
    return {"copy_bytes_per_s": None, "bf16_flops_per_s": 2 * 1024**3 / (ms * 1e-3)}


def describe(device: torch.device) -> dict:
    if device.type == "cuda":
        return environment()
    return {"date": datetime.date.today().isoformat(), "cpu": platform.processor() or platform.machine(),
            "threads": torch.get_num_threads(), "torch": torch.__version__, "python": platform.python_version()}


def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def attempt(fn, device: torch.device):
    """(fn(), None), or (None, "out of memory ...") when the GPU runs out; memory is released either way."""
    try:
        return fn(), None
    except torch.OutOfMemoryError as exc:
        msg = str(exc).split("\n")[0][:160]
    free(device)
    return None, f"out of memory: {msg}"


def peak_gib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated() / GiB if device.type == "cuda" else None


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()


# ---------------------------------------------------------------------------------------------- the model


@dataclasses.dataclass
class Setup:
    lm: K3ForCausalLM
    model: CausalLMLoss
    balancer: Balancer


def build(cfg, precision: str, device: torch.device, loss_chunk: int, seed: int = 0) -> Setup:
    """The trainer's objects around a fresh model: meta build, allocated on `device`, training init."""
    with torch.device("meta"):
        lm = K3ForCausalLM(cfg, PRECISIONS[precision])
    lm.to_empty(device=device)
    lm.init_weights(seed)
    model = keep_routers_fp32(CausalLMLoss(lm, loss_chunk))
    return Setup(lm, model, Balancer(lm, "qb"))


def release(s: Setup | None, device: torch.device) -> None:
    if s is not None:
        s.balancer.remove()
        s.model.zero_grad(set_to_none=True)
    free(device)


def set_checkpointing(model: nn.Module, on: bool) -> None:
    """Activation checkpointing of every decoder layer on or off (it lives on the instances' `forward`)."""
    if on:
        apply_activation_checkpointing(model)
        return
    for layer in decoder_layers(model):
        if getattr(layer, "_kimik3_checkpointed", False):
            del layer.forward  # the class's forward again
            del layer._kimik3_checkpointed


def make_batch(vocab: int, T: int, device: torch.device, packed: bool, seed: int = 0):
    """(input_ids [1, T], labels [1, T], cu_seqlens [0, T] or None): one random document, next-token labels."""
    row = torch.randint(0, vocab, (1, T + 1), generator=torch.Generator().manual_seed(seed))
    cu = torch.tensor([0, T], dtype=torch.int64, device=device) if packed else None
    return row[:, :-1].to(device), row[:, 1:].contiguous().to(device), cu


def fwd_bwd(s: Setup, batch, device: torch.device) -> torch.Tensor:
    """One micro-batch as train_step runs it: fresh gradients, forward under collecting() + autocast, backward."""
    ids, labels, cu = batch
    s.model.zero_grad(set_to_none=True)
    with s.balancer.collecting(), autocast(device, "bf16"):
        loss = s.model(ids, labels, cu)
    (loss / labels.numel()).backward()
    return loss.detach()


# ---------------------------------------------------------------------------------------------- phases


def correctness(s: Setup, T: int, device: torch.device) -> dict:
    """Loss and probe-gradient norms of one T-token step on the fast path vs `use_backend("torch")`."""
    names = {}
    for suffix in PROBES:
        hit = next((n for n, p in s.lm.named_parameters() if n.endswith(suffix)), None)
        if hit is not None:
            names[suffix] = hit
    params = dict(s.lm.named_parameters())
    batch = make_batch(s.lm.config.vocab_size, T, device, packed=True, seed=1)
    runs = {}
    for backend in ("auto", "torch"):
        with use_backend(backend):
            loss = float(fwd_bwd(s, batch, device)) / T
        runs[backend] = {"loss": loss, "grads": {k: params[n].grad.detach().clone() for k, n in names.items()}}
    s.model.zero_grad(set_to_none=True)
    s.balancer.step()  # drop the statistics of these two forwards
    fast, ref = runs["auto"], runs["torch"]
    rows = {"loss": {"fast": fast["loss"], "reference": ref["loss"],
                     "rel": abs(fast["loss"] - ref["loss"]) / max(abs(ref["loss"]), 1e-30)}}
    for k, n in names.items():
        a, b = fast["grads"][k], ref["grads"][k]  # kept in the gradients' dtype: the probes are GBs at K3 size
        na, nb = float(a.float().norm()), float(b.float().norm())
        rows[n] = {"fast": na, "reference": nb, "rel": abs(na - nb) / max(nb, 1e-30),
                   "rel_vector": float((a.float() - b.float()).norm()) / max(nb, 1e-30)}  # reported, not asserted
        del fast["grads"][k], ref["grads"][k]
    ok = all(r["rel"] < CHECK_TOL for r in rows.values())
    return {"tokens": T, "tolerance": CHECK_TOL, "ok": ok, "rows": rows}


def time_fwd_bwd(s: Setup, T: int, packed: bool, ac: bool, device: torch.device, warmup: int, rep: int) -> dict:
    set_checkpointing(s.model, ac)
    batch = make_batch(s.lm.config.vocab_size, T, device, packed)
    reset_peak(device)
    ms, err = attempt(lambda: time_ms(lambda: fwd_bwd(s, batch, device), warmup, rep, device), device)
    out = {"packed": packed, "checkpointing": ac, "ms": ms, "peak_gib": peak_gib(device)}
    if err:
        s.model.zero_grad(set_to_none=True)
        free(device)
        out["error"] = err
    return out


def _split(items: list, parts: int) -> list[list]:
    """Consecutive runs of about equal element counts."""
    total = sum(p.numel() for p, _ in items)
    out, run, acc = [], [], 0
    for p, wd in items:
        run.append((p, wd))
        acc += p.numel()
        if acc >= total * (len(out) + 1) / parts and len(out) < parts - 1:
            out.append(run)
            run = []
    return [r for r in out + [run] if r]


def adamw_ms(s: Setup, fused: bool, parts: int, device: torch.device, warmup: int, rep: int) -> float:
    """One AdamW step over every parameter with a gradient, grouped as build_optimizer does (decay 0.1 on
    matrices, none on norms / KDA islands / AttnRes queries). fused=False is torch's default, the one
    build_optimizer gets (foreach on CUDA). parts > 1: one optimizer per slice of the parameters at a time
    (its states freed before the next), summed: for when all states do not fit at once."""
    groups = param_groups(s.model, use_muon=False)
    items = [(p, 0.1) for _, p in groups["decay"]] + [(p, 0.0) for _, p in groups["plain"]]
    items = [(p, wd) for p, wd in items if p.grad is not None]
    total = 0.0
    for part in _split(items, parts):
        spec = [{"params": [p for p, w in part if w == wd], "weight_decay": wd} for wd in (0.1, 0.0)]
        kw = {"fused": True} if fused else {}
        opt = Optimizers([torch.optim.AdamW([g for g in spec if g["params"]], lr=3e-4, betas=(0.9, 0.95),
                                            eps=1e-8, **kw)])
        try:
            total += time_ms(opt.step, warmup, rep, device)
        finally:
            opt.optimizers.clear()
            del opt
            free(device)
    return total


def time_optimizer(s: Setup, T: int, device: torch.device, warmup: int, rep: int, kinds=("fused", "foreach")) -> dict:
    """clip + AdamW (each kind; whole, else in 4 parts) + QB update, on the gradients of one fwd+bwd."""
    set_checkpointing(s.model, True)  # the smallest activation peak: only the gradients must survive
    batch = make_batch(s.lm.config.vocab_size, T, device, packed=True)
    _, err = attempt(lambda: fwd_bwd(s, batch, device), device)
    if err:
        return {"error": f"fwd+bwd for the gradients: {err}"}
    free(device)
    out = {"grad_gib": sum(p.grad.nbytes for p in s.model.parameters() if p.grad is not None) / GiB}
    params = [p for p in s.model.parameters() if p.grad is not None]
    out["clip_ms"] = time_ms(lambda: float(torch.nn.utils.clip_grad_norm_(params, 1.0)), warmup, rep, device)
    out["qb_update_ms"] = time_once(s.balancer.step, device)  # statistics of every forward since the last one
    for kind in kinds:
        res = {}
        for parts in (1, 4):
            reset_peak(device)
            ms, err = attempt(lambda: adamw_ms(s, kind == "fused", parts, device, warmup, rep), device)
            if err is None:
                res = {"ms": ms, "parts": parts, "peak_gib": peak_gib(device)}
                break
            res[f"error_parts_{parts}"] = err
        out[kind] = res
    s.model.zero_grad(set_to_none=True)
    free(device)
    return out


def fits_fp32_master(cfg, device: torch.device) -> tuple[bool, str]:
    """fp32 weights + fp32 gradients must leave room for activations (a quarter of the GPU, at least)."""
    if device.type != "cuda":
        return True, ""
    with torch.device("meta"):
        n = sum(p.numel() for p in K3ForCausalLM(cfg, torch.float32).parameters())
    need, have = 8 * n, torch.cuda.get_device_properties(device).total_memory
    if need > 0.75 * have:
        return False, f"fp32 weights + gradients alone are {need / 1e9:.0f} GB of the GPU's {have / 1e9:.0f} GB"
    return True, ""


def with_experts(cfg, E: int):
    return dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, num_experts=E))


# ---------------------------------------------------------------------------------------------- main


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="CPU logic check: configs/tiny.json, T=128, 2 timed steps")
    ap.add_argument("--config", default="configs/slice-train-4.json")
    ap.add_argument("--tokens", type=int, default=8192, help="T of the one-row batch (B=1)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--precision", choices=("bf16", "fp32-master", "both"), default="both",
                    help="bf16 weights, or fp32 master weights under bf16 autocast (the trainer's)")
    ap.add_argument("--checkpointing", choices=("off", "on", "both"), default="both")
    ap.add_argument("--unpacked", action=argparse.BooleanOptionalAction, default=True,
                    help="also time the row without cu_seqlens (the trainer always passes them)")
    ap.add_argument("--loss-chunk", type=int, default=1024, help="train.loss_chunk_tokens")
    ap.add_argument("--check-tokens", type=int, default=256, help="T of the fast-vs-reference check (0: skip)")
    ap.add_argument("--compare-experts", type=int, default=32,
                    help="also time both precisions with this many experts per MoE layer (0: skip)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rep", type=int, default=6)
    args = ap.parse_args()
    if args.smoke:
        args.config, args.tokens, args.device = "configs/tiny.json", 128, "cpu"
        args.check_tokens, args.compare_experts, args.warmup, args.rep = 64, 4, 1, 2
        os.environ.setdefault("OUT", tempfile.mkdtemp(prefix="bench_train_smoke_"))
    return args


def main() -> int:
    args = parse()
    device, T = torch.device(args.device), args.tokens
    in_repo = ROOT / args.config  # a path from the repository root works from any directory
    cfg = load_config(in_repo if not Path(args.config).exists() and in_repo.exists() else args.config).text
    torch.manual_seed(0)
    env = describe(device)
    log(f"{env}")
    ceil = ceilings() if device.type == "cuda" else cpu_ceilings()
    rate = ceil["bf16_flops_per_s"]
    log(f"measured bf16 matmul rate {rate / 1e12:.1f} TFLOP/s")
    precisions = ["bf16", "fp32-master"] if args.precision == "both" else [args.precision]
    acs = {"off": [False], "on": [True], "both": [False, True]}[args.checkpointing]
    result = {"env": env, "ceilings": ceil, "config": args.config, "tokens": T, "batch": 1, "peer": PEER,
              "target": TARGET, "loss_chunk_tokens": args.loss_chunk, "modes": {}, "skipped": {}}

    flops = None
    for prec in precisions:
        ok, why = (True, "") if prec == "bf16" else fits_fp32_master(cfg, device)
        if not ok:
            result["skipped"][prec] = why
            log(f"{prec}: skipped ({why})")
            continue
        log(f"{prec}: building the model on {device}")
        s = build(cfg, prec, device, args.loss_chunk)
        mode = {"parameters": sum(p.numel() for p in s.lm.parameters())}
        flops = matmul_flops(s.lm, T)
        if args.check_tokens:
            log(f"{prec}: fast path vs reference ops, T={args.check_tokens}")
            mode["check"] = correctness(s, args.check_tokens, device)
            log(f"{prec}: check {'passed' if mode['check']['ok'] else 'FAILED'}: " + ", ".join(
                f"{short(k)} {v['rel']:.1e}" for k, v in mode["check"]["rows"].items()))
        mode["fwd_bwd"] = []
        for packed in ([True, False] if args.unpacked else [True]):
            for ac in (acs if packed else [False]):
                log(f"{prec}: fwd+bwd T={T} {'packed' if packed else 'unpacked'} checkpointing={ac}")
                r = time_fwd_bwd(s, T, packed, ac, device, args.warmup, args.rep)
                log("    " + (r.get("error") or f"{r['ms']:.1f} ms"))
                mode["fwd_bwd"].append(r)
        log(f"{prec}: clip + AdamW + QB update")
        mode["optimizer"] = time_optimizer(s, T, device, args.warmup, args.rep)
        result["modes"][prec] = mode
        release(s, device)
        del s
        free(device)

    if args.compare_experts:
        E = args.compare_experts
        small = with_experts(cfg, E)
        result["compare"] = {"experts": E, "modes": {}}
        for prec in ("bf16", "fp32-master"):
            log(f"compare, {E} experts: {prec}")
            s, err = attempt(lambda: build(small, prec, device, args.loss_chunk), device)
            if err:
                result["compare"]["modes"][prec] = {"error": err}
                continue
            r = time_fwd_bwd(s, T, True, False, device, args.warmup, args.rep)
            r["optimizer"] = time_optimizer(s, T, device, args.warmup, args.rep)
            result["compare"]["modes"][prec] = r
            release(s, device)
            del s
            free(device)

    result["flops_forward"] = flops
    ok = summarize(result, flops, rate, T)
    path = write_json("bench_train_smoke" if args.smoke else "bench_train", result)
    print(f"(json: {path})", flush=True)
    return 0 if ok else 1


def _fmt(x, spec: str, missing: str = "-") -> str:
    return missing if x is None else format(x, spec)


def summarize(result: dict, flops: dict | None, rate: float, T: int) -> bool:
    """Tables, the headline (fastest measured full-size step) and the ratio to the peer; True if checks pass."""
    if flops is None:
        print("nothing was measured", flush=True)
        return False
    total = counted(flops)
    fb = lambda ms: [f"{ms:.1f}", f"{T / ms * 1e3:,.0f}", f"{total / ms * 1e-9:.4g}",  # noqa: E731
                     f"{total / ms * 1e3 / rate:.0%}"]
    rows, best = [], None
    for prec, mode in result["modes"].items():
        opt = mode["optimizer"]
        adam = (opt.get("fused") or {}).get("ms")
        extra = (opt.get("clip_ms") or 0) + (opt.get("qb_update_ms") or 0) + (adam or 0)
        for r in mode["fwd_bwd"]:
            name = f"{prec}, {'packed' if r['packed'] else 'unpacked'}, AC {'on' if r['checkpointing'] else 'off'}"
            if r["ms"] is None:
                rows.append([f"fwd+bwd {name}", r.get("error", "")[:40], "", "", "", "", ""])
                continue
            rows.append([f"fwd+bwd {name}", *fb(r["ms"]), _fmt(r["peak_gib"], ".1f"),
                         f"{T / r['ms'] * 1e3 / PEER['tokens_per_s']:.2f}x"])
            if adam is not None and (best is None or r["ms"] + extra < best["ms"]):
                best = {"ms": r["ms"] + extra, "fwd_bwd_ms": r["ms"], "variant": name, "precision": prec,
                        "packed": r["packed"], "checkpointing": r["checkpointing"], "clip_ms": opt["clip_ms"],
                        "adamw_ms": adam, "adamw_parts": opt["fused"]["parts"], "qb_update_ms": opt["qb_update_ms"]}
        for kind in ("fused", "foreach"):
            k = opt.get(kind) or {}
            label = f"AdamW {kind} ({prec}{', in 4 parts' if k.get('parts') == 4 else ''})"
            ms = _fmt(k.get("ms"), ".1f", "OOM" if k else "-")
            rows.append([label, ms, "", "", "", _fmt(k.get("peak_gib"), ".1f"), ""])
        rows.append([f"clip grad norm ({prec})", _fmt(opt.get("clip_ms"), ".1f"), "", "", "", "", ""])
        rows.append([f"QB bias update ({prec})", _fmt(opt.get("qb_update_ms"), ".1f"), "", "", "", "", ""])
    if best is not None:
        rows.append([f"STEP = best fwd+bwd + clip + AdamW + QB ({best['variant']})", *fb(best["ms"]), "",
                     f"{T / best['ms'] * 1e3 / PEER['tokens_per_s']:.2f}x"])
    rows.append([f"{PEER['name']} (design.md 6)", f"{PEER['ms']:.0f}", f"{PEER['tokens_per_s']:,.0f}",
                 f"{PEER['tflops']:.0f}", f"{PEER['fraction']:.0%}", "", "1.00x"])
    for name, skip in result["skipped"].items():
        rows.append([f"{name}: skipped ({skip})", "", "", "", "", "", ""])
    title = (f"Training step, {result['config']}, B=1, T={T}: {total / 1e12:.2f} TFLOP of matmuls per step "
             f"(fwd+bwd; KDA recurrent-form {3 * flops['kda'] / 1e12:.2f} TFLOP not counted), measured bf16 "
             f"matmul rate {rate / 1e12:.4g} TFLOP/s")
    table(title, ["case", "ms", "tokens/s", "TFLOP/s", "of bf16", "peak GiB", "tok/s vs peer"], rows)
    if "compare" in result:
        c, crow = result["compare"], []
        for prec, r in c["modes"].items():
            opt = r.get("optimizer") or {}
            crow.append([prec, _fmt(r.get("ms"), ".1f", r.get("error", "")[:30]), _fmt(r.get("peak_gib"), ".1f"),
                         _fmt((opt.get("fused") or {}).get("ms"), ".1f", "OOM"),
                         _fmt((opt.get("foreach") or {}).get("ms"), ".1f", "OOM")])
        table(f"Precision at {c['experts']} experts per MoE layer (fwd+bwd packed, AC off; AdamW on its gradients)",
              ["weights", "fwd+bwd ms", "peak GiB", "AdamW fused ms", "AdamW foreach ms"], crow)
    checks = [m["check"] for m in result["modes"].values() if "check" in m]
    if best is not None:
        fb_best = min(r["ms"] for m in result["modes"].values() for r in m["fwd_bwd"] if r["ms"] is not None)
        ratio = T / best["ms"] * 1e3 / PEER["tokens_per_s"]
        best.update(tokens_per_s=T / best["ms"] * 1e3, tflops=total / best["ms"] * 1e-9,
                    fraction_of_bf16=total / best["ms"] * 1e3 / rate, ratio_tokens_per_s=ratio,
                    ratio_without_optimizer=T / fb_best * 1e3 / PEER["tokens_per_s"], target_met=ratio >= TARGET)
        result["headline"] = best
        print(f"\nheadline: {best['variant']}, AdamW fused{' in 4 parts' if best['adamw_parts'] == 4 else ''}: "
              f"{best['ms']:.1f} ms/step = {best['tokens_per_s']:,.0f} tokens/s, {best['tflops']:.4g} TFLOP/s "
              f"({best['fraction_of_bf16']:.0%} of the measured bf16 rate)\n"
              f"ours / {PEER['name']}: {ratio:.2f}x tokens/s (forward+backward alone: "
              f"{best['ratio_without_optimizer']:.2f}x); target >= {TARGET}x: "
              f"{'MET' if best['target_met'] else 'NOT MET'}", flush=True)
    for c in checks:
        print(f"check (fast vs reference ops, T={c['tokens']}): {'passed' if c['ok'] else 'FAILED'}, max rel "
              f"{max(r['rel'] for r in c['rows'].values()):.1e} (tolerance {c['tolerance']:.0e})", flush=True)
    return all(c["ok"] for c in checks)


if __name__ == "__main__":
    sys.exit(main())
