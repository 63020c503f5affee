"""The pieces of `bench_train.py`: FLOP counting, device timing helpers, the model set-up, forward+backward,
the fast-vs-reference check and the optimizer-phase timing (see bench_train.py for what a step is)."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import gc
import platform
import time

import torch
from torch import Tensor, nn

from bench.common import environment, median_ms, sync
from kimik3.distributed.parallelize import apply_activation_checkpointing, decoder_layers
from kimik3.model import K3ForCausalLM
from kimik3.model.init import allocate
from kimik3.model.kda import KimiDeltaAttention
from kimik3.model.mla import MultiHeadLatentAttention
from kimik3.model.moe import LatentMoE
from kimik3.ops.backend import use_backend
from kimik3.ops.optim import grad_norm
from kimik3.train.balancing import Balancer
from kimik3.train.loss import CausalLMLoss
from kimik3.train.optim import Optimizers, build_optimizer, param_groups
from kimik3.train.step import autocast, keep_routers_fp32, optimizer_phase

CHECK_TOL = 2e-2  # fast path vs use_backend("torch"): relative difference of the loss and of gradient norms
# The verdict in bf16 (where the check above compares two runs each ~2% from the truth, so their difference
# can exceed 2e-2 with neither at fault): each bf16 run against the fp32 truth, the fast path's error at most
# 1.5x the reference's (+ 1e-3 for rows where both are at the rounding level).
TRUTH_FACTOR, TRUTH_FLOOR = 1.5, 1e-3
PROBES = ("lm_head.weight", "embed_tokens.weight", "self_attn.q_proj.weight", "self_attn.A_log",
          "self_attn.q_b_proj.weight", "mlp.down_proj.weight", "gate.weight", "experts.w1", "experts.w2",
          "shared_experts.up_proj.weight", "mlp_res_proj.weight")
PRECISIONS = {"bf16": torch.bfloat16, "fp32-master": torch.float32}
GiB = 2**30


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
    allocate(lm, device)
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


def fwd_bwd(s: Setup, batch, device: torch.device, precision: str = "bf16", balance: bool = True) -> torch.Tensor:
    """One micro-batch as train_step runs it: fresh gradients, forward under collecting() + autocast (none for
    precision "fp32"), backward. balance=False skips the balancing statistics (a top-k-of-k copy has none)."""
    ids, labels, cu = batch
    s.model.zero_grad(set_to_none=True)
    with s.balancer.collecting() if balance else contextlib.nullcontext(), autocast(device, precision):
        loss = s.model(ids, labels, cu)
    (loss / labels.numel()).backward()
    return loss.detach()


# ---------------------------------------------------------------------------------------------- phases


def probe_names(lm: nn.Module) -> dict[str, str]:
    """The first parameter name ending in each of PROBES (those the config has)."""
    names = {}
    for suffix in PROBES:
        hit = next((n for n, _ in lm.named_parameters() if n.endswith(suffix)), None)
        if hit is not None:
            names[suffix] = hit
    return names


def probe_runs(s: Setup, batch, T: int, device: torch.device) -> dict[str, tuple[float, dict[str, Tensor]]]:
    """backend ("auto": fast path, "torch": reference ops) -> (mean loss, {probe parameter name: gradient copy})
    of one fwd+bwd on `batch` each (no balancing statistics); the model's gradients are cleared after."""
    params = dict(s.lm.named_parameters())
    names = probe_names(s.lm).values()
    runs = {}
    for backend in ("auto", "torch"):
        with use_backend(backend):
            loss = float(fwd_bwd(s, batch, device, balance=False)) / T
        runs[backend] = (loss, {n: params[n].grad.detach().clone() for n in names})
    s.model.zero_grad(set_to_none=True)
    return runs


def correctness(s: Setup, T: int, device: torch.device) -> dict:
    """Loss and probe-gradient norms of one T-token step on the fast path vs `use_backend("torch")`."""
    batch = make_batch(s.lm.config.vocab_size, T, device, packed=True, seed=1)
    (loss, fast), (ref_loss, ref) = probe_runs(s, batch, T, device).values()
    rows = {"loss": {"fast": loss, "reference": ref_loss, "rel": abs(loss - ref_loss) / max(abs(ref_loss), 1e-30)}}
    for n in list(fast):
        a, b = fast.pop(n), ref.pop(n)  # kept in the gradients' dtype: the probes are GBs at K3 size
        na, nb = float(a.float().norm()), float(b.float().norm())
        rows[n] = {"fast": na, "reference": nb, "rel": abs(na - nb) / max(nb, 1e-30),
                   "rel_vector": float((a.float() - b.float()).norm()) / max(nb, 1e-30)}  # reported, not asserted
    ok = all(r["rel"] < CHECK_TOL for r in rows.values())
    return {"tokens": T, "tolerance": CHECK_TOL, "ok": ok, "rows": rows}


def truth_check(cfg, T: int, device: torch.device, loss_chunk: int) -> dict:
    """How far each bf16 run is from the truth, for the loss and every probe gradient (relative error of the
    whole vector): the fast path and the reference ops on bf16 weights under bf16 autocast (as trained), the
    truth being the same weights in fp32 on the reference ops without autocast. ok (the bf16 verdict): the fast
    path's error is within TRUTH_FACTOR of the reference's (+ TRUTH_FLOOR) in every row. Holds an fp32 copy and
    its gradients, so run it on a reduced-expert copy of a real-dims config."""
    s = build(cfg, "bf16", device, loss_chunk)
    batch = make_batch(s.lm.config.vocab_size, T, device, packed=True, seed=1)
    runs = probe_runs(s, batch, T, device)
    t = build(cfg, "fp32-master", device, loss_chunk)
    t.lm.load_state_dict(s.lm.state_dict())  # the bf16 weights, exactly, in fp32
    release(s, device)
    del s
    with use_backend("torch"):
        true_loss = float(fwd_bwd(t, batch, device, precision="fp32", balance=False)) / T
    params = dict(t.lm.named_parameters())
    rows = {"loss": {b: abs(runs[b][0] - true_loss) / abs(true_loss) for b in runs}}
    for n in runs["auto"][1]:
        truth = params[n].grad.float()
        rows[n] = {b: float((runs[b][1][n].float() - truth).norm() / truth.norm().clamp_min(1e-30)) for b in runs}
    release(t, device)
    ok = all(r["auto"] <= TRUTH_FACTOR * r["torch"] + TRUTH_FLOOR for r in rows.values())
    return {"tokens": T, "experts": cfg.moe.num_experts, "factor": TRUTH_FACTOR, "ok": ok, "rows": rows}


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


def balancer_snapshot(b: Balancer) -> list:
    """The statistics a Balancer holds between the forwards and its step (to replay that step)."""
    clone = lambda t: t.clone() if isinstance(t, Tensor) else t  # noqa: E731
    return [(clone(st.hist), clone(st.loads), st.lo, st.hi, clone(st.clamped), list(st.required)) for st in b.layers]


def balancer_restore(b: Balancer, snap: list) -> None:
    for st, (hist, loads, lo, hi, clamped, required) in zip(b.layers, snap):
        st.hist = hist.clone() if hist is not None else None
        st.loads = loads.clone() if loads is not None else None
        st.lo, st.hi, st.clamped, st.required = lo, hi, clamped, list(required)


def trainer_phase_ms(s: Setup, snap: list, device: torch.device, warmup: int, rep: int) -> dict:
    """Median ms of `kimik3.train.step.optimizer_phase` -- the trainer's own clip + AdamW + QB code -- with the
    trainer's `build_optimizer` (fused AdamW, the clip folded into it). Each repeat replays the same step: the
    balancer's statistics are restored before it and the gradients are kept (zero_grad is skipped)."""
    opt = build_optimizer(s.model, "adamw", 3e-4, 0.1, (0.9, 0.95), 1e-8)
    opt.zero_grad = lambda: None  # keep this fwd+bwd's gradients for the next repeat (the trainer frees them)

    def phase():
        balancer_restore(s.balancer, snap)
        optimizer_phase(s.model, opt, s.balancer, 1.0)

    try:
        reset_peak(device)
        ms = time_ms(phase, warmup, rep, device)
        return {"ms": ms, "fused": opt.optimizers[0].defaults.get("fused"), "folds_clipping": opt.folds_clipping,
                "peak_gib": peak_gib(device)}
    finally:
        opt.optimizers.clear()  # the fused AdamW states (two moments per parameter) go with it
        free(device)


def time_optimizer(s: Setup, T: int, device: torch.device, warmup: int, rep: int, kinds=("fused", "foreach")) -> dict:
    """The trainer's optimizer phase (`optimizer_phase`), then its parts and the previous trainer's way (separate
    clip, foreach AdamW): norm, clip, AdamW (each kind; whole, else in 4 parts), QB update (warm, and one cold
    call), on the gradients of one fwd+bwd."""
    set_checkpointing(s.model, True)  # the smallest activation peak: only the gradients must survive
    batch = make_batch(s.lm.config.vocab_size, T, device, packed=True)
    _, err = attempt(lambda: fwd_bwd(s, batch, device), device)
    if err:
        return {"error": f"fwd+bwd for the gradients: {err}"}
    free(device)
    out = {"grad_gib": sum(p.grad.nbytes for p in s.model.parameters() if p.grad is not None) / GiB}
    params = [p for p in s.model.parameters() if p.grad is not None]
    snap = balancer_snapshot(s.balancer)
    # one cold QB update (lazy kernel loads included): what earlier runs reported as the update
    out["qb_update_first_ms"] = time_once(s.balancer.step, device)

    def qb():
        balancer_restore(s.balancer, snap)
        s.balancer.step()

    out["qb_update_ms"] = time_ms(qb, warmup, rep, device)
    out["norm_ms"] = time_ms(lambda: float(grad_norm([p.grad for p in params])), warmup, rep, device)  # the trainer's
    out["clip_ms"] = time_ms(lambda: float(torch.nn.utils.clip_grad_norm_(params, 1.0)), warmup, rep, device)
    res, err = attempt(lambda: trainer_phase_ms(s, snap, device, warmup, rep), device)
    out["trainer"] = res or {"error": err}
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
