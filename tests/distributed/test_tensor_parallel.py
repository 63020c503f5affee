"""Tensor parallelism for inference: W ranks (gloo, CPU) give the logits of one process, full forward and cached.

The in-process tests check the per-rank shards directly (shapes, A_log slices, partial outputs summing to the
full layer's, per-rank caches concatenating to the full cache); the gloo tests run the whole transformation.
"""

from __future__ import annotations

import copy
import json
import math
import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors import safe_open

from kimik3.config import K3Config, TextConfig
from kimik3.distributed.tensor_parallel import (
    apply_tensor_parallel,
    load_tensor_parallel,
    rank_config,
    shard_for_rank,
    shard_tensor,
    tensor_block,
)
from kimik3.model import K3ForCausalLM
from kimik3.model.state import KDAView
from tests.helpers import CONFIGS, free_port, randomize, rel_err, spying_safe_open


def _config(**text) -> TextConfig:
    """configs/tiny.json with 4 KDA heads of 22 (P = 88, distinct from the tiny dims) and 4 MLA heads."""
    d = json.loads((CONFIGS / "tiny.json").read_text())
    t = d["text_config"]
    t["linear_attn_config"].update(num_heads=4, head_dim=22)
    t.update({"num_attention_heads": 4, "num_key_value_heads": 4, **text})
    return K3Config.from_hf(d).text


def _model(seed: int = 7) -> K3ForCausalLM:
    return randomize(K3ForCausalLM(_config(), torch.float32), seed=seed)


def _ragged(V: int, pad: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """A left-padded batch of 3 prompts (9, 3, 14 tokens), its mask, 8 continuation tokens each, the prompts."""
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, V, (n,), generator=g) for n in (9, 3, 14)]
    T = max(len(p) for p in prompts)
    ids, mask = torch.full((3, T), pad), torch.zeros(3, T, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, T - len(p):], mask[i, T - len(p):] = p, 1
    return ids, mask, torch.randint(0, V, (3, 8), generator=g), prompts


@torch.no_grad()
def _cached_run(model, ids, mask, cont) -> torch.Tensor:
    """Prefill the padded prompts, then a 3-token chunk, then 5 single-token decodes: [B, 1 + 8, Vocab]."""
    cache = model.new_cache(ids.shape[0], ids.shape[1] + cont.shape[1])
    out = [model(ids, cache=cache, attention_mask=mask)[:, -1:], model(cont[:, :3], cache=cache)]
    out += [model(cont[:, t:t + 1], cache=cache) for t in range(3, cont.shape[1])]
    return torch.cat(out, 1)


def test_rank_config_divides_the_heads_and_names_what_does_not_divide():
    cfg = _config()
    r = rank_config(cfg, 4)
    assert (r.kda.num_heads, r.kda.a_log_size, r.kda.proj_dim, r.mla.num_heads) == (1, 1, 22, 1)
    assert r.layer_types == cfg.layer_types and r.hidden_size == cfg.hidden_size and r.moe == cfg.moe
    with pytest.raises(ValueError, match=r"linear_attn_config.num_heads \(3\)"):
        rank_config(K3Config.from_file(CONFIGS / "tiny.json").text, 2)
    with pytest.raises(ValueError, match=r"num_attention_heads \(2\)"):
        rank_config(_config(num_attention_heads=2, num_key_value_heads=2), 4)
    with pytest.raises(ValueError, match=r"intermediate_size \(114\)"):
        rank_config(_config(intermediate_size=114), 4)
    with pytest.raises(ValueError, match="world_size"):
        rank_config(cfg, 0)
    with pytest.raises(ValueError, match="process group"):
        apply_tensor_parallel(_model())


def test_per_rank_shapes_and_keys_on_the_meta_device():
    cfg = _config()
    with torch.device("meta"):
        full = K3ForCausalLM(cfg, torch.float32)
    keys = set(full.state_dict())
    m = shard_for_rank(full, 1, 2)
    assert set(m.state_dict()) == keys
    D, P, K = cfg.hidden_size, cfg.kda.proj_dim, cfg.kda.head_dim
    kda, mla = m.model.layers[0].self_attn, m.model.layers[3].self_attn
    assert kda.q_proj.weight.shape == (P // 2, D) and kda.f_b_proj.weight.shape == (P // 2, K)
    assert kda.q_conv1d.weight.shape == (P // 2, 1, 4) and kda.dt_bias.shape == (P // 2,)
    assert kda.b_proj.weight.shape == (2, D) and kda.A_log.shape == (2,) and kda.o_proj.weight.shape == (D, P // 2)
    assert kda.f_a_proj.weight.shape == (K, D) and kda.o_norm.weight.shape == (K,)
    c = cfg.mla
    assert mla.q_b_proj.weight.shape == (2 * c.qk_head_dim, c.q_lora_rank)
    assert mla.kv_b_proj.weight.shape == (2 * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank)
    assert mla.g_proj.weight.shape == (2 * c.v_head_dim, D) and mla.o_proj.weight.shape == (D, 2 * c.v_head_dim)
    assert mla.kv_a_proj_with_mqa.weight.shape == (c.kv_lora_rank + c.qk_rope_head_dim, D)
    assert m.model.layers[0].mlp.down_proj.weight.shape == (D, cfg.intermediate_size // 2)
    moe = m.model.layers[1].block_sparse_moe
    assert moe.shared_experts.gate_proj.weight.shape == (cfg.moe.shared_dim // 2, D)
    assert moe.experts.w1.shape == (cfg.moe.num_experts, cfg.moe.expert_dim, cfg.moe.latent_dim)  # replicated
    with pytest.raises(ValueError, match="already tensor-parallel"):
        shard_for_rank(m, 0, 2)


@pytest.mark.parametrize("rank", [0, 3])
def test_shard_tensor_slices_a_full_state_dict_into_the_sharded_model(rank):
    """The per-key rule a loader uses equals the module rebuild, bit for bit (with the wrapper's prefix)."""
    full = _model()
    want = shard_for_rank(copy.deepcopy(full), rank, 4).state_dict()
    for k, t in full.state_dict().items():
        assert torch.equal(shard_tensor("language_model." + k, t, full.config, rank, 4), want[k]), k
    fc0 = torch.randn(4, 4)
    assert shard_tensor("vision_tower.encoder.blocks.0.mlp.fc0.weight", fc0, full.config, rank, 4) is fc0


@torch.no_grad()
@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])  # 4: -m slow
def test_rank_shards_sum_to_the_full_layers_and_caches_concatenate(world):
    """Without the all-reduce each rank's o_proj / down_proj output is a partial sum; the W partials add up to
    the unsharded layer's output, and the per-rank caches are the full cache split by head (MLA: replicated)."""
    full = _model()
    ranks = [shard_for_rank(copy.deepcopy(full), r, world) for r in range(world)]
    H = full.config.kda.num_heads
    for r, m in enumerate(ranks):
        torch.testing.assert_close(m.model.layers[0].self_attn.A_log, full.model.layers[0].self_attn.A_log[:H]
                                   .chunk(world)[r], rtol=0, atol=0)
    B, T, S = 2, 11, 16
    x = torch.randn(B, T, full.config.hidden_size)
    full_cache, caches = full.new_cache(B, S), [m.new_cache(B, S) for m in ranks]
    step, _ = full_cache.step([T] * B)  # every rank's step is the same: slots and blocks do not depend on heads
    for c in caches:
        c.step([T] * B)
    x = x.reshape(1, B * T, -1)  # a step packs its sequences in one row
    for i, layer in enumerate(full.model.layers):
        want = layer.self_attn(x, None, full_cache.pool.layers[i], step)[0]
        got = sum(m.model.layers[i].self_attn(x, None, c.pool.layers[i], step)[0] for m, c in zip(ranks, caches))
        assert rel_err(got, want) < 1e-5, i
        if isinstance(full_cache.pool.layers[i], KDAView):
            parts = [c.pool.layers[i] for c in caches]
            whole = full_cache.pool.layers[i]
            assert parts[0].recurrent[:B].shape == (B, H // world, 22, 22)
            assert rel_err(torch.cat([p.recurrent[:B] for p in parts], 1), whole.recurrent[:B]) < 1e-5
            assert rel_err(torch.cat([p.conv_k[:B] for p in parts], -1), whole.conv_k[:B]) < 1e-6
        else:
            for c in caches:
                assert torch.equal(c.pool.layers[i].latent, full_cache.pool.layers[i].latent)
    # the dense MLP (layer 0) and a shared expert (layer 1): partial sums of the unsharded module's output
    mlps = [lambda m: m.model.layers[0].mlp, lambda m: m.model.layers[1].block_sparse_moe.shared_experts]
    for mlp in mlps:
        assert rel_err(sum(mlp(m)(x) for m in ranks), mlp(full)(x)) < 1e-5


def test_a_forward_that_records_autograd_is_refused():
    m = shard_for_rank(_model(), 0, 2, reduce=lambda t: None)
    with pytest.raises(RuntimeError, match="inference-only"):
        m(torch.zeros(1, 4, dtype=torch.long))



def _tp_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))  # no hang
    try:
        model = apply_tensor_parallel(_model())
        V, pad = model.config.vocab_size, model.config.pad_token_id
        ids = torch.randint(0, V, (2, 37), generator=torch.Generator().manual_seed(5))
        with torch.no_grad():
            full = model(ids)
        padded, mask, cont, _ = _ragged(V, pad)
        kda = next(layer for layer in model.new_cache(3, 4).pool.layers if isinstance(layer, KDAView))
        torch.save({"full": full, "cached": _cached_run(model, padded, mask, cont),
                    "kda_state": tuple(kda.recurrent[:3].shape), "conv": tuple(kda.conv_q[:3].shape)},
                   os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.barrier()
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])  # 4: -m slow
def test_tensor_parallel_logits_equal_one_process(world, tmp_path):
    """The defining invariant under TP: full forward, and left-padded prefill + chunk + token-by-token decode
    with the per-rank caches, give one process's logits on every rank (fp32)."""
    mp.start_processes(_tp_worker, args=(world, free_port(), str(tmp_path)), nprocs=world, start_method="spawn")
    model = _model()
    V, pad = model.config.vocab_size, model.config.pad_token_id
    ids = torch.randint(0, V, (2, 37), generator=torch.Generator().manual_seed(5))
    padded, mask, cont, prompts = _ragged(V, pad)
    with torch.no_grad():
        full = model(ids)
        cached = _cached_run(model, padded, mask, cont)
        alone = [model(torch.cat([p, cont[i]])[None])[0, len(p) - 1:] for i, p in enumerate(prompts)]
    for i in range(3):  # the single-process reference itself: each row as if alone
        assert rel_err(cached[i], alone[i]) < 1e-5
    H, K = model.config.kda.num_heads, model.config.kda.head_dim
    for r in range(world):
        got = torch.load(tmp_path / f"rank{r}.pt")
        assert rel_err(got["full"], full) < 1e-5, r
        assert rel_err(got["cached"], cached) < 1e-5, r
        assert got["kda_state"] == (3, H // world, K, K) and got["conv"] == (3, 3, H * K // world)


def _load_worker(rank: int, world: int, port: int, ckpt: str, out_dir: str) -> None:
    """Rank `rank` loads only its shards (safetensors reads counted) and runs the same forward."""
    from kimik3.checkpoint import loader

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    read: dict[str, int] = {}  # checkpoint tensor -> elements read
    loader.safe_open = spying_safe_open(loader.safe_open, lambda name, t: read.__setitem__(name, t.numel()))
    try:
        model = load_tensor_parallel(ckpt, dtype=torch.float32, quiet=True).language_model
        ids = torch.randint(0, model.config.vocab_size, (2, 37), generator=torch.Generator().manual_seed(5))
        with torch.no_grad():
            logits = model(ids)
        torch.save({"logits": logits, "read": read}, os.path.join(out_dir, f"load{rank}.pt"))
    finally:
        dist.barrier()
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])  # 4: -m slow
def test_load_tensor_parallel_reads_only_this_ranks_blocks(world, tmp_path):
    """Each rank reads the replicated tensors whole and 1/W of every split one (rows, or o_proj / down_proj
    columns), and the model it builds gives one process's logits."""
    import kimik3
    from kimik3.config import K3Config

    d = json.loads((CONFIGS / "tiny.json").read_text())
    d["text_config"]["linear_attn_config"].update(num_heads=4, head_dim=22)
    d["text_config"].update(num_attention_heads=4, num_key_value_heads=4)
    full = kimik3.model.K3ForConditionalGeneration(K3Config.from_hf(d), torch.float32)
    full.language_model.load_state_dict(_model().state_dict())
    path = kimik3.save(full, tmp_path / "ckpt", experts="bf16", dtype=torch.float32, quiet=True)
    mp.start_processes(_load_worker, args=(world, free_port(), str(path), str(tmp_path)), nprocs=world,
                       start_method="spawn")
    ids = torch.randint(0, full.config.text.vocab_size, (2, 37), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = full.language_model(ids)
    shapes = {}  # checkpoint tensor -> full shape (per-expert names, unlike the stacked state_dict)
    for shard in path.glob("*.safetensors"):
        with safe_open(shard, "pt") as f:
            shapes.update({k: tuple(f.get_slice(k).get_shape()) for k in f.keys()})
    cfg = full.config.text

    def expected(name: str, r: int) -> int:
        n = math.prod(shapes[name])
        if tensor_block(name, shapes[name], cfg, r, world) is None:
            return n
        return cfg.kda.num_heads // world if name.endswith("A_log") else n // world

    split_total = sum(math.prod(v) for k, v in shapes.items() if tensor_block(k, v, cfg, 0, world) is not None)
    assert split_total > 0.3 * sum(math.prod(v) for v in shapes.values())  # the check is about most of the model
    for r in range(world):
        got = torch.load(tmp_path / f"load{r}.pt")
        assert rel_err(got["logits"], want) < 1e-5, r
        assert got["read"] == {name: expected(name, r) for name in shapes}, r
