"""The CPU gloo equivalence checks of expert and tensor parallelism, runnable on GPUs with NCCL: every rank
builds the same random model (configs/tiny.json with 4 KDA heads of 22 and 4 MLA heads, 8 experts top-3) and
compares, against the single-process model run in the same process:

    EP  logits (each rank its own uneven share of the batch), and after one backward the gradients: dense
        ones summed over ranks, each rank's expert slice (its experts see every rank's rows)
    TP  logits of the whole batch, and prefill + token-by-token decode through the per-rank caches

    torchrun --nproc_per_node 8 tools/check_parallel.py        # GPUs (NCCL); CPU ranks use gloo
Prints one table on rank 0, writes $OUT/check_parallel.json, exits 1 if a check misses its tolerance: fp32
1e-5 relative (on GPUs, TF32 is off for these checks).
"""

from __future__ import annotations

import copy
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / "src")]  # runnable from a checkout under torchrun

from kimik3.config import K3Config  # noqa: E402
from kimik3.distributed import apply_expert_parallel, apply_tensor_parallel  # noqa: E402
from kimik3.model import K3ForCausalLM  # noqa: E402
from kimik3.presets import resolve_config  # noqa: E402
from kimik3.testing import randomize, rel_err  # noqa: E402

TOL = 1e-5


def _model(device: torch.device) -> K3ForCausalLM:
    d = json.loads(resolve_config("tiny").read_text())
    d["text_config"]["linear_attn_config"].update(num_heads=4, head_dim=22)
    d["text_config"].update(num_attention_heads=4, num_key_value_heads=4)
    return randomize(K3ForCausalLM(K3Config.from_hf(d).text, torch.float32), seed=7).to(device)


def _loss(model, ids) -> torch.Tensor:
    logits = model(ids)
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten(), reduction="sum")


def check_ep(device, rank: int, world: int) -> dict:
    full = _model(device)
    ids = torch.randint(0, full.config.vocab_size, (world * (world + 1) // 2, 32),
                        generator=torch.Generator().manual_seed(5)).to(device)
    mine = ids[rank * (rank + 1) // 2: rank * (rank + 1) // 2 + rank + 1]  # uneven: rank r holds r + 1 rows
    ep = apply_expert_parallel(copy.deepcopy(full))
    with torch.no_grad():
        logits = rel_err(ep(mine), full(mine))
    # the reference is one process on the whole batch: EP sums each token's slot gradients in the reference's
    # order (ascending expert), so what remains is the ranks' micro-batch split (~2e-7 on the CPU)
    _loss(full, ids).backward()
    _loss(ep, mine).backward()
    worst = 0.0
    full_grads = dict(full.named_parameters())
    for name, p in ep.named_parameters():
        g, want = p.grad, full_grads[name].grad
        if g is None or want is None:
            continue
        shard = getattr(ep.get_submodule(name.rsplit(".", 1)[0]), "expert_shard", None)
        if shard is not None:  # this rank's experts already hold every rank's contributions
            want = want[shard.start:shard.stop]
        else:  # dense weights: each rank holds its rows' part
            g = g.clone()
            dist.all_reduce(g)
        worst = max(worst, rel_err(g, want))
    return {"EP logits": logits, "EP gradients (worst tensor)": worst}


def check_tp(device) -> dict:
    full = _model(device)
    tp = apply_tensor_parallel(copy.deepcopy(full))
    V = full.config.vocab_size
    ids = torch.randint(0, V, (2, 37), generator=torch.Generator().manual_seed(5)).to(device)
    with torch.no_grad():
        out = {"TP logits": rel_err(tp(ids), full(ids))}
        runs = []
        for m in (tp, full):
            cache = m.new_cache(2, 48)
            steps = [m(ids[:, :20], cache=cache)[:, -1:]]
            steps += [m(ids[:, t:t + 1], cache=cache) for t in range(20, 37)]
            runs.append(torch.cat(steps, 1))
        out["TP prefill + decode"] = rel_err(*runs)
    return out


def main() -> int:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    torch.manual_seed(0)
    results = {**check_ep(device, rank, world), **check_tp(device)}
    worst = {k: torch.tensor(v, device=device, dtype=torch.float64) for k, v in results.items()}
    for v in worst.values():
        dist.all_reduce(v, op=dist.ReduceOp.MAX)
    worst = {k: float(v) for k, v in worst.items()}
    ok = all(v < TOL for v in worst.values())
    if rank == 0:
        print(f"parallel vs one process, {world} ranks ({dist.get_backend()}), fp32, worst over ranks")
        for k, v in worst.items():
            print(f"  {k:<28} {v:.2e} < {TOL:.1e}  {'ok' if v < TOL else 'MISSED'}")
        out = Path(os.environ.get("OUT", "out/tools"))
        out.mkdir(parents=True, exist_ok=True)
        env = {"torch": torch.__version__, "device": str(device), "ranks": world, "backend": dist.get_backend()}
        (out / "check_parallel.json").write_text(json.dumps({"env": env, "results": worst, "tolerance": TOL, "ok": ok},
                                                                 indent=2))
    dist.barrier()
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
