"""Many adapters in one engine: requests of two adapters and of none share each step and equal each run alone
(and the single-adapter model of `lora.load`); prefix-cache entries never cross adapters."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kimik3 import lora
from kimik3.inference.engine import Request
from kimik3.inference.engine.request import accumulate
from kimik3.lora.serving import ServedExperts, ServedLinear, check_servable
from tests.helpers import rel_err, requires_cuda
from tests.inference.engine.conftest import greedy, make_engine, random_prompts
from tests.lora.conftest import load_base, randomize_adapter
from tests.lora.test_apply import TARGETS


@pytest.fixture(scope="module")
def adapters(base_dir, tmp_path_factory):
    """"a": rank 4 on attention, dense MLPs, shared and routed experts; "b": rank 2, routed experts (one A per
    layer) and the dense MLPs only (another rank, other targets)."""
    root = tmp_path_factory.mktemp("served")
    a = lora.apply(load_base(base_dir), lora.LoraConfig(rank=4, alpha=8.0, targets=TARGETS))
    randomize_adapter(a, seed=1)
    b = lora.apply(load_base(base_dir), lora.LoraConfig(rank=2, alpha=6.0, experts="shared_a",
                                                         targets=["*.block_sparse_moe.experts", "*.mlp.*"]))
    randomize_adapter(b, seed=2)
    return {"a": lora.save(a, root / "a"), "b": lora.save(b, root / "b")}


def run(engine, jobs, params):
    """jobs: [(prompt, adapter)] all added at once; -> their accumulated outputs in order."""
    for i, (prompt, adapter) in enumerate(jobs):
        engine.add_request(Request(str(i), prompt, params, adapter=adapter))
    done = {}
    while engine.has_unfinished():
        accumulate(done, engine.step())
    return [done[str(i)] for i in range(len(jobs))]


def logprobs(out):
    return torch.tensor([lp.logprob for lp in out.outputs[0].logprobs])


def test_two_adapters_and_none_in_one_batch_equal_each_alone(base_dir, adapters):
    model = load_base(base_dir)
    prompts = random_prompts(model.config.text.vocab_size, (70, 5, 33, 130, 64, 17), generator_seed=4)
    names = ["a", "b", None, "b", "a", None]
    params = greedy(6, logprobs=2)
    engine = make_engine(model, adapters=adapters)
    assert sum(isinstance(m, ServedExperts) for m in model.modules()) > 0
    assert sum(isinstance(m, ServedLinear) for m in model.modules()) > 0
    mixed = run(engine, list(zip(prompts, names)), params)
    for prompt, name, got in zip(prompts, names, mixed):
        alone = run(make_engine(load_base(base_dir), adapters=adapters), [(prompt, name)], params)[0]
        assert got.outputs[0].token_ids == alone.outputs[0].token_ids, name
        assert rel_err(logprobs(got), logprobs(alone)) < 1e-5, name
    # each adapter's requests are what its own model (lora.load, the generate --lora path) computes
    for name in ("a", "b", None):
        single = load_base(base_dir)
        if name is not None:
            lora.load(single, adapters[name])
        jobs = [(p, None) for p, n in zip(prompts, names) if n == name]
        want = run(make_engine(single), jobs, params)
        got = [o for o, n in zip(mixed, names) if n == name]
        for g, w in zip(got, want):
            assert g.outputs[0].token_ids == w.outputs[0].token_ids, name
            assert rel_err(logprobs(g), logprobs(w)) < 1e-5, name
    # and the adapters change the model: the same prompt under a, b and the base differs
    outs = run(make_engine(load_base(base_dir), adapters=adapters), [(prompts[0], n) for n in ("a", "b", None)],
               params)
    lps = [logprobs(o) for o in outs]
    assert not torch.equal(lps[0], lps[2]) and not torch.equal(lps[1], lps[2]) and not torch.equal(lps[0], lps[1])


def test_a_prefix_cached_under_one_adapter_is_never_hit_under_another(base_dir, adapters):
    engine = make_engine(load_base(base_dir), adapters=adapters)
    prompt = random_prompts(engine.vocab_size, (150,), generator_seed=5)[0]
    params = greedy(3)

    def cached(name):
        return run(engine, [(prompt, name)], params)[0].cached_tokens

    assert cached("a") == 0
    assert cached("b") == 0 and cached(None) == 0  # each its own root: nothing from a's entries
    assert cached("a") >= 128 and cached("b") >= 128 and cached(None) >= 128  # each hits its own
    engine.reset_prefix_cache()
    assert cached(None) == 0 and cached("a") == 0  # the base's entries are not a's either


def test_unknown_adapters_and_unservable_targets_are_refused(base_dir, adapters, tmp_path):
    engine = make_engine(load_base(base_dir), adapters=adapters)
    with pytest.raises(ValueError, match="adapter 'c' is not loaded"):
        engine.add_request(Request("x", [1, 2, 3], greedy(2), adapter="c"))
    with pytest.raises(ValueError, match="serves no adapters"):
        make_engine(load_base(base_dir)).add_request(Request("x", [1, 2, 3], greedy(2), adapter="a"))
    attn_res = _adapter_on_attn_res(adapters["a"], tmp_path / "res")
    with pytest.raises(ValueError, match="self_attention_res_proj, which serving cannot run"):
        check_servable(attn_res)
    with pytest.raises(ValueError, match="self_attention_res_proj, which serving cannot run"):
        make_engine(load_base(base_dir), adapters={"res": attn_res})
    with pytest.raises(ValueError, match="not MXFP4-packed"):
        make_engine(load_base(base_dir, packed=False), adapters=adapters)
    with pytest.raises(FileNotFoundError, match="not an adapter folder"):
        make_engine(load_base(base_dir), adapters={"x": tmp_path / "missing"})
    with pytest.raises(ValueError, match="use_cuda_graphs with adapters"):
        make_engine(load_base(base_dir), adapters=adapters, use_cuda_graphs=True)


def _adapter_on_attn_res(like: Path, out: Path) -> Path:
    """A PEFT folder (another tool's) with a factor pair on an AttnRes projection, which `lora.apply` never writes."""
    from safetensors.torch import save_file

    out.mkdir()
    for f in like.iterdir():
        if f.name != "adapter_model.safetensors":
            (out / f.name).write_bytes(f.read_bytes())
    key = "base_model.model.language_model.model.layers.0.self_attention_res_proj"
    save_file({f"{key}.lora_A.weight": torch.zeros(2, 8), f"{key}.lora_B.weight": torch.zeros(1, 2)},
              str(out / "adapter_model.safetensors"))
    return out


def test_kv_b_adapters_are_served_as_generate_runs_them(base_dir, tmp_path):
    """MLA's kv_b_proj is read as a weight (absorbed) or over cached keys (expanded): adapters on it are applied per
    sequence on both paths, several at once, and equal the single-adapter model (`lora.load`, generate --lora)."""
    folders = {}
    for name, rank, seed in (("kv", 4, 3), ("kv2", 2, 4)):
        m = lora.apply(load_base(base_dir), lora.LoraConfig(rank=rank, targets=["*.self_attn.*_proj"]))
        randomize_adapter(m, seed=seed)
        folders[name] = lora.save(m, tmp_path / name)
    model = load_base(base_dir)
    V = model.config.text.vocab_size
    # 150 tokens: a 128-token chunk (expanded keys) then a short one; the others short chunks and decode rows
    prompts = random_prompts(V, (150, 9, 40, 150, 21), generator_seed=8)
    names = ["kv", "kv2", None, "kv2", "kv"]
    params = greedy(5, logprobs=1)
    engine = make_engine(model, adapters=folders)
    assert sum(m.kv_b_updates is not None for m in model.modules() if hasattr(m, "kv_b_updates")) > 0
    mixed = run(engine, list(zip(prompts, names)), params)
    for name in ("kv", "kv2", None):
        single = load_base(base_dir)
        if name is not None:
            lora.load(single, folders[name])
        jobs = [(p, None) for p, n in zip(prompts, names) if n == name]
        want = run(make_engine(single), jobs, params)
        for g, w in zip([o for o, n in zip(mixed, names) if n == name], want):
            assert g.outputs[0].token_ids == w.outputs[0].token_ids, name
            assert rel_err(logprobs(g), logprobs(w)) < 1e-5, name
    base = run(make_engine(load_base(base_dir)), [(prompts[0], None)], params)[0]
    assert not torch.equal(logprobs(base), logprobs(mixed[0]))  # the kv_b adapter does change the output


@pytest.mark.gpu
@requires_cuda
def test_kv_b_adapters_are_served_as_generate_runs_them_gpu(base_dir, tmp_path):
    """The same on CUDA (fp32): the absorbed path's extended latents through the paged Triton kernel."""
    m = lora.apply(load_base(base_dir), lora.LoraConfig(rank=4, targets=["*.self_attn.*_proj"]))
    randomize_adapter(m, seed=3)
    folder = lora.save(m, tmp_path / "kv")
    prompts = random_prompts(m.config.text.vocab_size, (150, 9, 40), generator_seed=8)
    params = greedy(5, logprobs=1)
    served = run(make_engine(load_base(base_dir).cuda(), adapters={"kv": folder}), [(p, "kv") for p in prompts],
                 params)
    single = load_base(base_dir)
    lora.load(single, folder)
    want = run(make_engine(single.cuda()), [(p, None) for p in prompts], params)
    for g, w in zip(served, want):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert rel_err(logprobs(g), logprobs(w)) < 1e-4
