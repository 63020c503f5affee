"""The defining inference invariant: cached prefill + decode == one full forward (fp32, tiny config)."""

import pytest
import torch

from kimik3.model import K3ForCausalLM
from kimik3.model.state import KDAView, MLAView
from kimik3.ops.mla import EXPANDED_FROM_TOKENS
from tests.helpers import randomize, rel_err


@pytest.fixture(scope="module")
def model(tiny_config):
    return randomize(K3ForCausalLM(tiny_config.text, torch.float32), seed=21)


@torch.no_grad()
@pytest.mark.parametrize("prefix", [1, 5, 70, EXPANDED_FROM_TOKENS + 2])  # the last prefill expands MLA's latents
def test_prefill_then_decode_equals_full_forward(model, prefix):
    T = max(78, prefix + 8)
    ids = torch.randint(0, model.config.vocab_size, (2, T))
    full = model(ids)
    cache = model.new_cache(2, T + 2)
    out = [model(ids[:, :prefix], cache=cache)]
    for t in range(prefix, ids.shape[1]):
        out.append(model(ids[:, t:t + 1], cache=cache))
    assert cache.length == T
    assert rel_err(torch.cat(out, 1), full) < 1e-5


@torch.no_grad()
def test_chunked_prefill_equals_one_shot(model):
    ids = torch.randint(0, model.config.vocab_size, (3, 300))
    one = model(ids, cache=model.new_cache(3, 300))
    cache = model.new_cache(3, 300)
    # chunks below and above EXPANDED_FROM_TOKENS: latent (absorbed) and expanded MLA over a non-empty cache
    chunks = [model(ids[:, a:b], cache=cache) for a, b in ((0, 7), (7, 71), (71, 72), (72, 100), (100, 300))]
    assert rel_err(torch.cat(chunks, 1), one) < 1e-5
    assert rel_err(one, model(ids)) < 1e-5


@torch.no_grad()
def test_multi_token_decode(model):
    ids = torch.randint(0, model.config.vocab_size, (1, 30))
    cache = model.new_cache(1, 30)
    parts = [model(ids[:, :10], cache=cache), model(ids[:, 10:13], cache=cache), model(ids[:, 13:], cache=cache)]
    assert rel_err(torch.cat(parts, 1), model(ids)) < 1e-5


@torch.no_grad()
@pytest.mark.parametrize("lengths", [(9, 3, 14), (EXPANDED_FROM_TOKENS + 5, 3, 40)])
def test_ragged_left_padded_batch_equals_each_alone(model, lengths):
    """Masked-out tokens are not appended: each row computes what it would alone. With a long row beside short
    ones, one step carries an expanded chunk and latent-attention rows together."""
    V, pad = model.config.vocab_size, model.config.pad_token_id
    prompts = [torch.randint(0, V, (n,)) for n in lengths]
    steps = 6
    T = max(len(p) for p in prompts)
    ids = torch.full((3, T), pad)
    mask = torch.zeros(3, T, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, T - len(p):], mask[i, T - len(p):] = p, 1
    cont = torch.randint(0, V, (3, steps))
    cache = model.new_cache(3, T + steps)
    last = [model(ids, cache=cache, attention_mask=mask)[:, -1]]
    for t in range(steps):
        last.append(model(cont[:, t:t + 1], cache=cache)[:, -1])
    batched = torch.stack(last, 1)
    for i, p in enumerate(prompts):
        alone = model(torch.cat([p, cont[i]])[None])[0, len(p) - 1:]
        assert rel_err(batched[i], alone) < 1e-5, i


@torch.no_grad()
def test_decode_does_not_recompute_the_prefix(model):
    """Every projection sees only the new tokens (one per row); KDA work is O(1) per token, MLA attends
    S = t keys."""
    seen_tokens, mla_keys = [], []
    hooks = [m.register_forward_hook(lambda mod, inp, out: seen_tokens.append(inp[0].numel() // inp[0].shape[-1]))
             for name, m in model.named_modules() if name.endswith(("q_proj", "q_a_proj"))]
    import kimik3.model.mla as mla_mod

    real = mla_mod.paged_latent_attention

    def spy(q, latent, *a, **kw):
        mla_keys.append(kw["max_seq_len"])
        return real(q, latent, *a, **kw)

    mla_mod.paged_latent_attention = spy
    try:
        ids = torch.randint(0, model.config.vocab_size, (2, 40))
        cache = model.new_cache(2, 40)
        model(ids[:, :32], cache=cache)
        seen_tokens.clear(), mla_keys.clear()
        for t in range(32, 40):
            model(ids[:, t:t + 1], cache=cache)
    finally:
        mla_mod.paged_latent_attention = real
        for h in hooks:
            h.remove()
    n_attn = len(model.config.layer_types)
    assert seen_tokens == [2] * (8 * n_attn)
    n_mla = model.config.layer_types.count("mla")
    assert mla_keys == [t + 1 for t in range(32, 40) for _ in range(n_mla)]


def test_cache_shapes_and_errors(model, tiny_config):
    """The layers declare their state; the pool stacks it over layers (one tensor per kind)."""
    cache = model.new_cache(2, 16)
    t = tiny_config.text
    pool = cache.pool
    kinds = [type(layer) for layer in pool.layers]
    assert kinds == [KDAView if k == "kda" else MLAView for k in t.layer_types]
    n_kda, n_mla = t.layer_types.count("kda"), t.layer_types.count("mla")
    W, P = t.kda.short_conv_kernel_size, t.kda.proj_dim
    assert pool.recurrent.shape == (n_kda, 3, t.kda.num_heads, t.kda.head_dim, t.kda.head_dim)  # 2 slots + scratch
    assert pool.recurrent.dtype == torch.float32
    assert pool.conv.shape == (n_kda, 3, 3, W - 1, P)
    assert pool.latent.shape[0] == n_mla and pool.latent.shape[2] == t.mla.kv_lora_rank + t.mla.qk_rope_head_dim
    kda = next(layer for layer in pool.layers if isinstance(layer, KDAView))
    assert kda.recurrent.data_ptr() == pool.recurrent[0].data_ptr()  # views, not copies
    with pytest.raises(ValueError, match="holds 16 tokens"):
        model(torch.zeros(2, 17, dtype=torch.long), cache=cache)
    with pytest.raises(ValueError, match="attention_mask"):
        model(torch.zeros(2, 4, dtype=torch.long), cache=model.new_cache(2, 8), attention_mask=torch.ones(2, 5))
    with pytest.raises(ValueError, match="cu_seqlens"):
        model(torch.zeros(1, 4, dtype=torch.long), cache=model.new_cache(1, 8), cu_seqlens=torch.tensor([0, 4]))
