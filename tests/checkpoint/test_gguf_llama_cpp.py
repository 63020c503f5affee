"""kimik3's GGUF against llama.cpp itself (llama-cpp-python 0.3.36, built from source when missing: slow).

    kimik3's GGUF of the demo runs in llama.cpp: the same token ids, logits and greedy text as kimik3's fp32
        forward on 8 prompts; where a greedy token differs, the tie is checked against the reference math
    llama.cpp's own converter's GGUF of the demo loads in kimik3 (experts byte for byte) and holds the same bytes
        as kimik3's export, tensor for tensor
    the chat template inside the GGUF renders encode_chat's prompt in llama-cpp-python's chat formatter
    a routed-expert adapter exported with `kimik3 lora export` changes llama.cpp's logits as it changes kimik3's

Each test prints its numbers (run with -s to read them); docs/gguf.md quotes them.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import kimik3
from kimik3.checkpoint.gguf_read import open_gguf
from kimik3.checkpoint.gguf_write import save_gguf
from kimik3.cli import main
from kimik3.presets import DEMO_MODEL
from kimik3.tokenizer import Tokenizer, render_chat
from tests.checkpoint.test_gguf import differing
from tests.llama_cpp_oracle import convert_with_llama_cpp, llama_cpp
from tests.tokenizer.test_template import CASES

pytestmark = pytest.mark.slow

PROMPTS = ["ROMEO:", "JULIET:\nO Romeo, Romeo! wherefore art thou", "To be, or not to be, that is the question:",
           "KING RICHARD III:\nNow is the winter of our discontent", "First Citizen:\nBefore we proceed any further,",
           "HAMLET:\nAlas, poor Yorick! I knew him,", "O, what a rogue and peasant slave am I!",
           "Friends, Romans, countrymen, lend me your ears;"]
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def demo_gguf(tmp_path_factory):
    out = tmp_path_factory.mktemp("llama") / "demo.gguf"
    save_gguf(kimik3.load(DEMO_MODEL, keep_experts_packed=True, quiet=True), out, quiet=True)
    return out


def greedy(step, ids: list[int], n: int) -> list[int]:
    out = []
    for _ in range(n):
        out.append(int(np.argmax(step(ids + out))))
    return out


def test_kimik3_gguf_runs_in_llama_cpp(demo_gguf):
    llm = llama_cpp().Llama(model_path=str(demo_gguf), n_ctx=256, logits_all=True, n_threads=2, verbose=False)
    tok = Tokenizer.from_file(DEMO_MODEL)
    model = kimik3.load(DEMO_MODEL, dtype=torch.float32, quiet=True).eval()
    precise = kimik3.load(DEMO_MODEL, dtype=torch.float32, quiet=True).eval().double()

    def ours(ids, m=model) -> np.ndarray:
        with torch.no_grad():
            return m(torch.tensor([ids]))[0].double().numpy()

    def theirs(ids) -> np.ndarray:
        llm.reset()
        llm.eval(ids)
        return np.array(llm.scores[: len(ids)], dtype=np.float64)

    rows, worst = [], 0.0
    for prompt in PROMPTS:
        ids = tok.encode(prompt)
        assert llm.tokenize(prompt.encode(), add_bos=False, special=False) == ids, prompt  # same pre-tokenizer
        a, b = ours(ids), theirs(ids)
        diff = float(np.abs(a - b).max())
        worst = max(worst, diff)
        mine = greedy(lambda s: ours(s)[-1], ids, NEW_TOKENS)
        llama = greedy(lambda s: theirs(s)[-1], ids, NEW_TOKENS)
        row = {"prompt": prompt, "max_logit_diff": diff, "logit_scale": float(np.abs(a).max()),
               "rel_err": float(np.linalg.norm(a - b) / np.linalg.norm(a)), "greedy_equal": mine == llama}
        if mine != llama:  # the first disagreement: which token the reference math prefers, and by how much
            j = next(i for i, (x, y) in enumerate(zip(mine, llama, strict=True)) if x != y)
            prefix = ids + mine[:j]
            fp32, fp64, them = ours(prefix)[-1], ours(prefix, precise)[-1], theirs(prefix)[-1]
            row["first_difference"] = {
                "step": j, "kimik3": mine[j], "llama.cpp": llama[j],
                "fp32_margin": float(fp32[mine[j]] - fp32[llama[j]]),
                "fp64_margin": float(fp64[mine[j]] - fp64[llama[j]]),
                "llama_margin": float(them[llama[j]] - them[mine[j]])}
        rows.append(row)
    print(json.dumps({"max_logit_diff": worst, "greedy_agree": sum(r["greedy_equal"] for r in rows),
                      "prompts": rows}, indent=1))
    assert worst < 0.1, worst  # bf16 weights in both; llama.cpp rounds activations to bf16 in its CPU matmuls
    for r in rows:
        d = r.get("first_difference")
        # a greedy difference is only acceptable as a near-tie that the higher-precision reference settles for
        # kimik3's token: the two logits closer than the largest difference between the implementations
        assert d is None or (0 <= d["fp32_margin"] < worst and d["fp64_margin"] >= 0), r


def test_llama_cpp_converter_gguf_loads_in_kimik3(demo_gguf, tmp_path):
    theirs = convert_with_llama_cpp(DEMO_MODEL, tmp_path / "converted.gguf")
    a, b = open_gguf(theirs), open_gguf(demo_gguf)
    assert set(a.tensors) == set(b.tensors)
    for name, t in a.tensors.items():  # kimik3's export is the converter's, byte for byte
        u = b.tensors[name]
        assert (t.type, t.shape) == (u.type, u.shape) and np.array_equal(np.asarray(t.data), np.asarray(u.data)), name
    original = kimik3.load(DEMO_MODEL, dtype=torch.float32, keep_experts_packed=True, quiet=True)
    loaded = kimik3.load(theirs, dtype=torch.float32, keep_experts_packed=True, quiet=True)
    folded = differing(original, loaded)  # everything else equal, the MXFP4 experts byte for byte
    assert folded and all(n.endswith(("A_log", "_res_norm.weight", "_res_proj.weight")) for n in folded)
    ids = torch.tensor([Tokenizer.from_file(DEMO_MODEL).encode(PROMPTS[1])])
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids), original(ids), rtol=1e-5, atol=1e-5)
    assert a.config() == original.config and a.tokenizer()._enc._mergeable_ranks == Tokenizer.from_file(
        DEMO_MODEL)._enc._mergeable_ranks
    print(json.dumps({"tensors": len(a.tensors), "folded_in_function_only": len(folded)}))


def test_gguf_chat_template_renders_encode_chat_in_llama_cpp_python(demo_gguf):
    from_gguf = open_gguf(demo_gguf).kv["tokenizer.chat_template"]
    formatter = llama_cpp().llama_chat_format.Jinja2ChatFormatter
    for case, (messages, kwargs) in CASES.items():
        fmt = formatter(template=from_gguf, eos_token="[EOS]", bos_token="[BOS]",
                        add_generation_prompt=kwargs.get("add_generation_prompt", True))
        extra = {k: v for k, v in kwargs.items() if k not in ("tools", "tool_choice", "add_generation_prompt")}
        got = fmt(messages=messages, tools=kwargs.get("tools"), tool_choice=kwargs.get("tool_choice"), **extra).prompt
        assert got == render_chat(messages, **kwargs), case


def test_expert_lora_gguf_applies_in_llama_cpp(demo_gguf, tmp_path):
    """`kimik3 lora export`'s GGUF on kimik3's GGUF: llama.cpp's logits with the adapter are kimik3's with it."""
    from tests.lora.test_gguf_export import adapter_on

    model, folder = adapter_on(["*.block_sparse_moe.experts"], tmp_path / "adapter", seed=2)
    assert main(["lora", "export", str(folder), str(tmp_path / "adapter.gguf")]) == 0
    llm = llama_cpp().Llama(model_path=str(demo_gguf), lora_path=str(tmp_path / "adapter.gguf"), n_ctx=256,
                            logits_all=True, n_threads=2, verbose=False)
    base = kimik3.load(DEMO_MODEL, dtype=torch.float32, quiet=True).eval()
    ids = Tokenizer.from_file(DEMO_MODEL).encode(PROMPTS[2])
    with torch.no_grad():
        want, plain = model.eval()(torch.tensor([ids]))[0].numpy(), base(torch.tensor([ids]))[0].numpy()
    llm.eval(ids)
    got = np.array(llm.scores[: len(ids)])
    diff, effect = float(np.abs(got - want).max()), float(np.abs(want - plain).max())
    print(json.dumps({"lora_max_logit_diff": diff, "adapter_effect": effect}))
    assert diff < 0.1 < effect


def routing_margins(model, ids: list[int]) -> np.ndarray:
    """Per position, the smallest gap over the MoE layers between the last expert the router picks and the first it
    leaves out (scores + correction bias, as it selects): where it is tiny, any rounding may pick another expert."""
    from kimik3.model.moe import Router

    gaps = []

    def hook(mod, inp, out):
        top = (out[2] + mod.e_score_correction_bias).topk(mod.top_k + 1, dim=-1).values
        gaps.append((top[:, -2] - top[:, -1]).double())

    handles = [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, Router)]
    with torch.no_grad():
        model(torch.tensor([ids]))
    for h in handles:
        h.remove()
    return torch.stack(gaps).min(0).values.numpy()


def test_lora_merged_gguf_with_bf16_experts_runs_in_llama_cpp(tmp_path):
    """`lora merge ... OUT.gguf` (attention and experts adapted; experts merged dense, BF16) in llama.cpp.

    A random adapter on every projection makes the model more sensitive to rounding, so llama.cpp is judged against
    the reference math: kimik3's fp32 agrees with its float64 build, and llama.cpp (bf16 activations in its matrix
    products) may depart from it by what computing in bf16 costs kimik3 itself, except at one position where the
    float64 router has a near-tie (another expert is picked: a jump, not a drift)."""
    from tests.lora.test_gguf_export import adapter_on

    _, folder = adapter_on(["*self_attn*", "*.block_sparse_moe.experts"], tmp_path / "adapter", seed=4)
    assert main(["lora", "merge", str(DEMO_MODEL), str(folder), str(tmp_path / "m.gguf"), "--quiet"]) == 0
    llm = llama_cpp().Llama(model_path=str(tmp_path / "m.gguf"), n_ctx=256, logits_all=True, n_threads=2,
                            verbose=False)
    ids = Tokenizer.from_file(DEMO_MODEL).encode(PROMPTS[3])
    models = {d: kimik3.load(tmp_path / "m.gguf", dtype=torch.float32 if d != "bf16" else torch.bfloat16,
                             quiet=True).eval() for d in ("fp32", "fp64", "bf16")}
    models["fp64"] = models["fp64"].double()
    with torch.no_grad():
        out = {d: m(torch.tensor([ids]))[0].double().numpy() for d, m in models.items()}
    llm.eval(ids)
    theirs = np.array(llm.scores[: len(ids)], dtype=np.float64)
    per_position = np.abs(theirs - out["fp32"]).max(-1)
    bf16 = float(np.abs(out["bf16"] - out["fp32"]).max())
    margins = routing_margins(models["fp64"], ids)
    jumps = np.flatnonzero(per_position > 1.5 * bf16)
    print(json.dumps({"llama_vs_fp32": float(per_position.max()), "fp32_vs_fp64": float(
        np.abs(out["fp32"] - out["fp64"]).max()), "bf16_vs_fp32": bf16, "logit_scale": float(np.abs(out["fp32"]).max()),
        "positions_past_bf16": jumps.tolist(), "fp64_routing_margins": margins[jumps].tolist()}))
    assert np.abs(out["fp32"] - out["fp64"]).max() < 1e-4
    assert len(jumps) <= 1 and all(margins[j] < 1e-3 for j in jumps)
