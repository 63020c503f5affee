"""Where a CUDA-graphed decode step departs from eager at the same static shapes (a device diagnostic).

Rebuilds `tests/model/test_model_gpu.py::test_cuda_graph_decode_equals_eager`'s model and inputs (tiny config with
KDA head_dim 64, `randomize(seed=51)`, global seed 1234) and compares 10 graphed decode steps with eager ones.
With hooks (the default) every module records its inputs and outputs in the eager step and in the captured
graph, and each step prints the modules whose inputs agree bit for bit while their outputs do not.

    PYTHONPATH=src python3 tools/diagnose_cuda_graph.py
Environment:
    KIMIK3_TEST_TRITON_FIRST_CONFIG=1   every Triton autotuner on its first config, as the GPU tests run
    DIAG_HOOKS=0                        no hooks (they add clones, which changes the memory layout)
    DIAG_HISTORY=-m,gpu,-q,PATH,...     run these pytest arguments first, in this process (a suite's history)
    DIAG_DIRTY=nan|rand                 leave freed memory holding NaN or random values first
    DIAG_EMPTY_CACHE=1                  ... and hand it back to the driver (graph pools then reuse it)
    DIAG_VARIANTS=none,moe_bmm,attnres_ref,none   run the case once per variant: moe_bmm swaps the
                                        grouped-GEMM experts for a gathered bmm, attnres_ref the AttnRes kernel
                                        for its reference (which op family a difference comes from)
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402

from kimik3.config import K3Config  # noqa: E402
from kimik3.inference.cuda_graph import GraphedDecoder, eager_step  # noqa: E402
from kimik3.model import K3ForCausalLM  # noqa: E402
from kimik3.testing import randomize, rel_err, triton_first_config  # noqa: E402

REC: list | None = None


def tensors(x):
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (tuple, list)):
        return [t for y in x for t in tensors(y)]
    return []


def hook(name):
    def fn(mod, args, out):
        if REC is not None:
            REC.append((name, [t.clone() for t in tensors(args)], [t.clone() for t in tensors(out)]))
    return fn


def same(a, b):
    return len(a) == len(b) and all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(a, b))


def moe_bmm(z, topk_idx, topk_weight, w1, w3, w2, beta, linear_beta):
    """The routed experts without torch._grouped_mm: per routed row, its expert's weights gathered, bmm."""
    from kimik3.ops.situ import situ_glu
    N, A = topk_idx.shape
    e = topk_idx.reshape(-1)
    tok = torch.arange(N * A, device=z.device) // A
    x_M1L = z[tok][:, None]
    g = torch.bmm(x_M1L, w1[e].transpose(1, 2))
    u = torch.bmm(x_M1L, w3[e].transpose(1, 2))
    y = torch.bmm(situ_glu(g, u, beta, linear_beta), w2[e].transpose(1, 2))[:, 0]
    out = torch.zeros(z.shape, dtype=torch.float32, device=z.device)
    return out.index_add(0, tok, y.float() * topk_weight.reshape(-1, 1).float()).to(z.dtype)


def patched(variant):
    import contextlib
    from unittest import mock
    if variant == "moe_bmm":
        return mock.patch("kimik3.ops.moe.grouped.routed_experts", moe_bmm)
    if variant == "attnres_ref":
        from kimik3.ops.attnres import reference
        return mock.patch("kimik3.model.decoder.attn_res_mix", reference.attn_res_mix)
    return contextlib.nullcontext()


def main():
    global REC
    if os.environ.get("KIMIK3_TEST_TRITON_FIRST_CONFIG") == "1":
        triton_first_config()
    history = os.environ.get("DIAG_HISTORY")  # pytest args run first, in this process (the suite's history)
    if history:
        import pytest
        print("history:", pytest.main(history.split(",")))
    dirty = os.environ.get("DIAG_DIRTY")  # leave freed memory holding NaN or random bits
    if dirty:
        junk = [torch.empty(1 << 28, dtype=torch.float32, device="cuda") for _ in range(4)]
        for j in junk:
            j.fill_(float("nan")) if dirty == "nan" else j.uniform_(-1e3, 1e3)
        keep = junk[:2]
        del junk
        torch.cuda.synchronize()
        if os.environ.get("DIAG_EMPTY_CACHE") == "1":
            del keep
            torch.cuda.empty_cache()
    for variant in os.environ.get("DIAG_VARIANTS", "none").split(","):
        print(f"== variant {variant}")
        with patched(variant):
            case(os.environ.get("DIAG_HOOKS", "1") == "1" and variant == "none")


def case(hooks):
    global REC
    d = json.loads(open(os.path.join(os.path.dirname(__file__), "..", "configs", "tiny.json")).read())
    d["text_config"]["linear_attn_config"]["head_dim"] = 64
    cfg = K3Config.from_hf(d).text
    cpu = randomize(K3ForCausalLM(cfg, torch.float32), seed=51).eval()
    torch.manual_seed(1234)
    model = K3ForCausalLM(cfg, torch.bfloat16)
    model.load_state_dict(cpu.state_dict())
    model = model.cuda().eval()
    handles = []
    if hooks:
        for n, m in model.named_modules():
            handles.append(m.register_forward_hook(hook(n or "root")))
    torch.set_grad_enabled(False)
    ids = torch.randint(0, 300, (4, 33), device="cuda")
    ec, gc = model.new_cache(4, 64), model.new_cache(4, 64)
    model(ids, cache=ec), model(ids, cache=gc)
    from kimik3.inference.cuda_graph import _tensors
    print("prefill caches equal:", all(torch.equal(a, b) for a, b in zip(_tensors(ec), _tensors(gc))))
    REC = []
    dec = GraphedDecoder(model, gc)
    graph_rec = REC[2 * (len(REC) // 3):]
    REC = None
    tokens = torch.randint(0, 300, (4,), device="cuda")
    for i in range(10):
        REC = []
        a = eager_step(model, ec, tokens)
        eager_rec, REC = REC, None
        b = dec(tokens).clone()
        torch.cuda.synchronize()
        err = rel_err(b.float(), a.float())
        rows = [rel_err(b[r].float(), a[r].float()) for r in range(4)]
        print(f"step {i}: rel {err:.3e} rows {[f'{x:.1e}' for x in rows]}")
        first, shown = None, 0
        for (n, ei, eo), (gn, gi, go) in zip(eager_rec, graph_rec):
            assert n == gn, (n, gn)
            if same(ei, gi) and not same(eo, go) and shown < 12:
                shown += 1
                diffs = [(x.float() - y.float()).abs().max().item() for x, y in zip(eo, go)]
                kind = type(model.get_submodule("" if n == "root" else n)).__name__
                print(f"   inputs equal, outputs differ: {n} {kind}"
                      f" in {[tuple(t.shape) for t in ei]} max|diff| {diffs}")
                if first is None:
                    first = n
        if first is None and err > 0:
            firstd = next((n for (n, _, eo), (_, _, go) in zip(eager_rec, graph_rec) if not same(eo, go)), None)
            print("   no module with equal inputs and different outputs; first differing output:", firstd)
        tokens = a.argmax(-1)
        if i >= 2 and err > 0 and hooks:
            break
    for h in handles:
        h.remove()
    REC = None



if __name__ == "__main__":
    main()
