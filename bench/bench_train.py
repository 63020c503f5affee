"""Training step of the real-dims 4-layer slice (configs/slice-train-4.json: layer 0 KDA + dense MLP, two
KDA + MoE, one MLA + MoE, 128 experts top-16, released vocabulary) at B=1, T=8192 on one H200, side by side
with NeMo AutoModel 0.7.0's K3 on the same slice (design.md section 6: 732 ms/step, 11,189 tokens/s,
385 TFLOP/s = 56% of the measured bf16 matmul rate). Target: >= 1.2x its tokens/s.

A step is what `kimik3.train.step.train_step` does for one micro-batch: forward through `CausalLMLoss`
(chunked cross-entropy, routers fp32, balancing statistics collected) under bf16 autocast, backward, then
`kimik3.train.step.optimizer_phase` -- the trainer's own code: the gradient norm and `build_optimizer`'s AdamW
with the clip folded into its pass (both `kimik3.ops.optim`), the QB bias update -- timed as such (torch's fused
and foreach AdamW and the previous trainer's separate clip are timed beside it). The slice has 17.9B
parameters: fp32 master weights do not fit one GPU (weights + gradients alone are 143 GB), and bf16 weights +
gradients + AdamW states (143 GB) do not fit together with the activations of a forward. So one process times
two phases on the same model, forward+backward (with the gradients allocated as in training) and then clip +
AdamW + QB update on those gradients, and the step is their sum. fp32 master weights are timed where they fit
(`--smoke`; on the GPU at `--compare-experts` experts per MoE layer, next to bf16 weights at the same size).

Matmul FLOPs per step, forward + backward = 3 x forward (recomputation not counted):
    every nn.Linear, the LM head included    2 T in out
    routers (fp32 matmul)                     2 T D E
    routed experts                            2 T A 3 F L
    MLA attention, causal                     2 H (K_qk + V) T^2 / 2
This is the count behind NeMo's 385 TFLOP/s (6 x active parameters + causal MLA = 281.6 TFLOP per 8192-token
step, over 732 ms). KDA's delta rule is left out (as there); its recurrent-form count is reported alongside.

    PYTHONPATH=src:. python3 bench/bench_train.py      # device: table + $OUT/bench_train.json
    ... --peer 'python3 peer/automodel_slice.py peer/config.json'   # the peer first, in the same call (copy the
                                                       # script and config.json from ../shared into an untracked
                                                       # folder so that they travel; install its two wheels)
    .venv/bin/python bench/bench_train.py --smoke      # CPU: configs/tiny.json, T=128, the same code path
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
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

from bench.common import ceilings, profile_top, run_peer, table, write_json  # noqa: E402
from bench.train_parts import (  # noqa: E402
    TRUTH_FLOOR,
    attempt,
    build,
    correctness,
    counted,
    cpu_ceilings,
    describe,
    free,
    fwd_bwd,
    make_batch,
    matmul_flops,
    release,
    short,
    time_fwd_bwd,
    time_optimizer,
    truth_check,
)
from kimik3.model import K3ForCausalLM  # noqa: E402
from kimik3.presets import load_config  # noqa: E402

PEER = {"name": "NeMo AutoModel 0.7.0", "ms": 732.0, "tokens_per_s": 11189.0, "tflops": 385.0, "fraction": 0.56,
        "source": "design.md 6"}
# the peer script's (../shared/peers/automodel_slice.py) forward+backward line
PEER_LINE = re.compile(r"fwd\+bwd: ([\d.]+) ms at T=(\d+) -> [\d.]+ tok/s, ([\d.]+) TFLOP/s")
TARGET = 1.2  # ours / peer, tokens per second


def log(msg: str) -> None:
    print(f"[{datetime.datetime.now():%H:%M:%S}] {msg}", flush=True)


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


def measure_peer(command: str, timeout: float, T: int, rate: float) -> dict:
    """Run the peer's script (a shell command) before our model takes the GPU and read its forward+backward line:
    the peer's row of this run. Falls back to the recorded PEER (and says why) if the line does not come."""
    log(f"peer: {command} (limit {timeout:.0f} s)")
    out, why = run_peer(command, timeout)
    m = PEER_LINE.search(out)
    if m is None or int(m.group(2)) != T:
        log(f"peer: no fwd+bwd line at T={T} ({why}); keeping the recorded {PEER['ms']} ms. Its output ends:\n"
            + out[-1500:])
        return {**PEER, "attempted": why}
    ms, tflops = float(m.group(1)), float(m.group(3))
    log(f"peer: fwd+bwd {ms:.1f} ms")
    return {**PEER, "ms": ms, "tokens_per_s": T / ms * 1e3, "tflops": tflops, "fraction": tflops * 1e12 / rate,
            "source": "measured in this run"}


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
    ap.add_argument("--profile", action="store_true",
                    help="print the kernels of one bf16 fwd+bwd (packed, AC off) by device time")
    ap.add_argument("--truth-experts", type=int, default=16,
                    help="routed experts of the config copy for the fp32-truth report (0: skip; 16 = top-16 of 16:\n"
                         "every expert active, so no routing flip muddles the comparison)")
    ap.add_argument("--peer", metavar="COMMAND",
                    help="a shell command that runs the peer first, in the same call, e.g.\n"
                         "'python3 peer/automodel_slice.py peer/config.json' (its fwd+bwd line replaces the\n"
                         "recorded 732 ms)")
    ap.add_argument("--peer-timeout", type=float, default=240.0)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rep", type=int, default=6)
    args = ap.parse_args()
    if args.smoke:
        args.config, args.tokens, args.device = "configs/tiny.json", 128, "cpu"
        args.check_tokens, args.compare_experts, args.warmup, args.rep = 64, 4, 1, 2
        args.truth_experts = 3  # top-3 of 3 (tiny's k): every expert active, as top-16 of 16 at real dims
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
    # first: the peer has the GPU to itself, as it would alone
    peer = measure_peer(args.peer, args.peer_timeout, T, rate) if args.peer else PEER
    precisions = ["bf16", "fp32-master"] if args.precision == "both" else [args.precision]
    acs = {"off": [False], "on": [True], "both": [False, True]}[args.checkpointing]
    result = {"env": env, "ceilings": ceil, "config": args.config, "tokens": T, "batch": 1, "peer": peer,
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
                if args.profile and prec == "bf16" and packed and not ac and not r.get("error"):
                    batch = make_batch(s.lm.config.vocab_size, T, device, packed=True)
                    profile_top(lambda: fwd_bwd(s, batch, device), f"bf16 fwd+bwd T={T}", iters=2, rows=40)
        log(f"{prec}: clip + AdamW + QB update")
        mode["optimizer"] = time_optimizer(s, T, device, args.warmup, args.rep)
        result["modes"][prec] = mode
        release(s, device)
        del s
        free(device)

    if args.truth_experts and args.check_tokens:
        E, T_check = args.truth_experts, args.check_tokens
        log(f"fp32 truth vs the bf16 fast path and reference ops: {E} experts, T={T_check}")
        truth, err = attempt(lambda: truth_check(with_experts(cfg, E), T_check, device, args.loss_chunk), device)
        result["truth"] = truth or {"error": err}
        if truth:
            table(f"Relative error from the fp32 truth (reference ops, no autocast), {E} experts, T={T_check}",
                  ["", "fast path (bf16)", "reference ops (bf16)"],
                  [[short(n), f"{r['auto']:.1e}", f"{r['torch']:.1e}"] for n, r in truth["rows"].items()])

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
    peer = result["peer"]
    if flops is None:
        print("nothing was measured", flush=True)
        return False
    total = counted(flops)
    fb = lambda ms: [f"{ms:.1f}", f"{T / ms * 1e3:,.0f}", f"{total / ms * 1e-9:.4g}",  # noqa: E731
                     f"{total / ms * 1e3 / rate:.0%}"]
    rows, best = [], None
    for prec, mode in result["modes"].items():
        opt = mode["optimizer"]
        phase = (opt.get("trainer") or {}).get("ms")  # the trainer's own optimizer_phase, when its states fit
        adam = (opt.get("fused") or {}).get("ms")
        extra = phase if phase is not None else (opt.get("clip_ms") or 0) + (opt.get("qb_update_ms") or 0) + (adam or 0)
        have_opt = phase is not None or adam is not None
        for r in mode["fwd_bwd"]:
            name = f"{prec}, {'packed' if r['packed'] else 'unpacked'}, AC {'on' if r['checkpointing'] else 'off'}"
            if r["ms"] is None:
                rows.append([f"fwd+bwd {name}", r.get("error", "")[:40], "", "", "", "", ""])
                continue
            rows.append([f"fwd+bwd {name}", *fb(r["ms"]), _fmt(r["peak_gib"], ".1f"),
                         f"{T / r['ms'] * 1e3 / peer['tokens_per_s']:.2f}x"])
            if have_opt and (best is None or r["ms"] + extra < best["ms"]):
                best = {"ms": r["ms"] + extra, "fwd_bwd_ms": r["ms"], "variant": name, "precision": prec,
                        "packed": r["packed"], "checkpointing": r["checkpointing"], "optimizer_phase_ms": phase,
                        "clip_ms": opt["clip_ms"], "adamw_ms": adam,
                        "adamw_parts": (opt.get("fused") or {}).get("parts"), "qb_update_ms": opt["qb_update_ms"]}
        for kind in ("fused", "foreach"):
            k = opt.get(kind) or {}
            label = f"torch's AdamW {kind} ({prec}{', in 4 parts' if k.get('parts') == 4 else ''})"
            ms = _fmt(k.get("ms"), ".1f", "OOM" if k else "-")
            rows.append([label, ms, "", "", "", _fmt(k.get("peak_gib"), ".1f"), ""])
        tr = opt.get("trainer") or {}
        rows.append([(f"optimizer phase as kimik3 train runs it ({prec}: norm, AdamW with the clip folded in, "
                      "QB)"), _fmt(tr.get("ms"), ".1f", tr.get("error", "-")[:30]), "", "", "",
                     _fmt(tr.get("peak_gib"), ".1f"), ""])
        rows.append([f"  its gradient norm alone ({prec})", _fmt(opt.get("norm_ms"), ".1f"), "", "", "", "", ""])
        rows.append([f"clip grad norm, separate pass: the previous trainer ({prec})",
                     _fmt(opt.get("clip_ms"), ".1f"), "", "", "", "", ""])
        qb = f"{_fmt(opt.get('qb_update_ms'), '.1f')} / {_fmt(opt.get('qb_update_first_ms'), '.1f')}"
        rows.append([f"QB bias update ({prec}; warm / first call)", qb, "", "", "", "", ""])
    if best is not None:
        how = "the optimizer phase" if best["optimizer_phase_ms"] is not None else "clip + AdamW + QB"
        rows.append([f"STEP = best fwd+bwd + {how} ({best['variant']})", *fb(best["ms"]), "",
                     f"{T / best['ms'] * 1e3 / peer['tokens_per_s']:.2f}x"])
    rows.append([f"{peer['name']} ({peer['source']})", f"{peer['ms']:.0f}", f"{peer['tokens_per_s']:,.0f}",
                 f"{peer['tflops']:.0f}", f"{peer['fraction']:.0%}", "", "1.00x"])
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
        ratio = T / best["ms"] * 1e3 / peer["tokens_per_s"]
        best.update(tokens_per_s=T / best["ms"] * 1e3, tflops=total / best["ms"] * 1e-9,
                    fraction_of_bf16=total / best["ms"] * 1e3 / rate, ratio_tokens_per_s=ratio,
                    ratio_without_optimizer=T / fb_best * 1e3 / peer["tokens_per_s"], target_met=ratio >= TARGET)
        result["headline"] = best
        how = ("the trainer's optimizer phase" if best["optimizer_phase_ms"] is not None else
               f"AdamW fused{' in 4 parts' if best['adamw_parts'] == 4 else ''}")
        print(f"\nheadline: {best['variant']}, {how}: "
              f"{best['ms']:.1f} ms/step = {best['tokens_per_s']:,.0f} tokens/s, {best['tflops']:.4g} TFLOP/s "
              f"({best['fraction_of_bf16']:.0%} of the measured bf16 rate)\n"
              f"ours / {peer['name']}: {ratio:.2f}x tokens/s (forward+backward alone: "
              f"{best['ratio_without_optimizer']:.2f}x); target >= {TARGET}x: "
              f"{'MET' if best['target_met'] else 'NOT MET'}", flush=True)
    for c in checks:
        print(f"check (fast vs reference ops, T={c['tokens']}): {'passed' if c['ok'] else 'FAILED'}, max rel "
              f"{max(r['rel'] for r in c['rows'].values()):.1e} (tolerance {c['tolerance']:.0e})", flush=True)
    truth = result.get("truth") or {}
    if "ok" in truth:
        worst = max(r["auto"] / max(r["torch"], 1e-30) for r in truth["rows"].values())
        print(f"verdict (fp32 truth, {truth['experts']} experts): {'passed' if truth['ok'] else 'FAILED'}, the fast "
              f"path's error at most {worst:.2f}x the reference's (allowed {truth['factor']}x + {TRUTH_FLOOR:.0e})"
              " -- this decides; the check above compares two bf16 runs", flush=True)
        return truth["ok"]
    return all(c["ok"] for c in checks)


if __name__ == "__main__":
    sys.exit(main())
