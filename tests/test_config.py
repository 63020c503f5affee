import copy
import json

import pytest

from kimik3.config import K3Config
from tests.helpers import CONFIGS


def _hf(name: str) -> dict:
    return json.loads((CONFIGS / f"{name}.json").read_text())


def test_released_config(k3_config):
    t = k3_config.text
    assert t.num_layers == 93 and t.hidden_size == 7168 and t.vocab_size == 163840
    mla = [i for i, k in enumerate(t.layer_types) if k == "mla"]
    assert len(mla) == 24 and t.layer_types.count("kda") == 69
    assert mla == [*range(3, 92, 4), 92]  # 1-based lists: config layer n is layers.{n-1}
    assert t.moe_layers == (False,) + (True,) * 92
    assert t.snapshot_layers == (0, 12, 24, 36, 48, 60, 72, 84)
    assert (t.kda.num_heads, t.kda.head_dim, t.kda.a_log_size, t.kda.gate_lower_bound) == (96, 128, 128, -5.0)
    assert (t.mla.qk_head_dim, t.mla.v_head_dim, t.mla.kv_lora_rank, t.mla.q_lora_rank) == (192, 128, 512, 1536)
    assert t.mla.latent_norm_eps == 1e-6 and t.rms_norm_eps == 1e-5
    assert t.mla.softmax_scale == 192**-0.5
    m = t.moe
    assert (m.num_experts, m.num_experts_per_token, m.expert_dim, m.latent_dim, m.shared_dim) == (896, 16, 3072,
                                                                                               3584, 6144)
    assert (t.situ_beta, t.situ_linear_beta, k3_config.storage.experts) == (4.0, 25.0, "mxfp4")
    assert k3_config.eos_token_id == 163586 and k3_config.media_placeholder_token_id == 163605
    v = k3_config.vision
    assert (v.num_layers, v.hidden_size, v.num_heads, v.head_dim, v.intermediate_size) == (27, 1024, 12, 128, 4096)


def test_tiny_config_has_every_feature(tiny_config):
    t = tiny_config.text
    assert {"kda", "mla"} == set(t.layer_types) and t.layer_types[-2:] == ("mla", "mla")
    assert t.moe_layers[0] is False and all(t.moe_layers[1:])
    full_blocks = t.num_layers // t.attn_res_block_size
    assert full_blocks >= 2 and t.num_layers % t.attn_res_block_size != 0  # >= 2 blocks plus a partial one
    assert t.moe.num_experts >= 8 and t.moe.num_experts_per_token >= 2 and t.moe.num_shared_experts >= 1
    assert t.moe.latent_dim != t.hidden_size and t.mla.num_heads != t.kda.num_heads
    assert t.kda.a_log_size > t.kda.num_heads  # the stored A_log is padded, as released
    dims = [t.hidden_size, t.intermediate_size, t.vocab_size, t.kda.proj_dim, t.kda.head_dim, t.mla.q_lora_rank,
            t.mla.kv_lora_rank, t.mla.kv_lora_rank + t.mla.qk_rope_head_dim, t.mla.qk_nope_head_dim,
            t.mla.qk_rope_head_dim, t.mla.v_head_dim, t.mla.qk_head_dim, t.mla.num_heads * t.mla.qk_head_dim,
            t.mla.num_heads * t.mla.v_head_dim, t.moe.expert_dim, t.moe.latent_dim, t.moe.shared_dim,
            t.moe.num_experts]
    assert len(dims) == len(set(dims)), dims


def _mutate(path: list[str], value):
    d = _hf("tiny")
    node = d
    for key in path[:-1]:
        node = node[key]
    if value is KeyError:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return d


@pytest.mark.parametrize("path, value, field", [
    (["text_config", "linear_attn_config", "kda_layers"], [1, 2, 3, 4, 5], "kda_layers"),       # 4 in both
    (["text_config", "linear_attn_config", "kda_layers"], [1, 2, 3], "kda_layers"),             # 5 in neither
    (["text_config", "linear_attn_config", "full_attn_layers"], [4, 6, 7, 8], "full_attn_layers"),  # out of range
    (["text_config", "num_experts_per_token"], 9, "num_experts_per_token"),
    (["text_config", "hidden_act"], "silu", "hidden_act"),
    (["text_config", "hidden_size"], KeyError, "hidden_size"),
    (["text_config", "linear_attn_config", "head_dim"], KeyError, "head_dim"),
    (["text_config", "linear_attn_config"], KeyError, "linear_attn_config"),
    (["text_config", "num_key_value_heads"], 1, "num_key_value_heads"),
    (["text_config", "mla_use_nope"], False, "mla_use_nope"),
    (["text_config", "pad_token_id"], 300, "pad_token_id"),
    (["text_config", "num_experts"], 0, "num_experts"),
    (["vision_config", "qkv_hidden_size"], 47, "qkv_hidden_size"),
    (["vision_config", "text_hidden_size"], 81, "text_hidden_size"),
    (["vision_config", "pos_emb_interpolation_mode"], "bicubic", "pos_emb_interpolation_mode"),
])
def test_config_errors_name_the_field(path, value, field):
    with pytest.raises(ValueError, match=field):
        K3Config.from_hf(_mutate(path, value))


def test_config_file_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config"):
        K3Config.from_file(tmp_path / "missing.json")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        K3Config.from_file(tmp_path)


def test_config_is_frozen(tiny_config):
    with pytest.raises(Exception):
        tiny_config.text.hidden_size = 3
    assert K3Config.from_hf(copy.deepcopy(tiny_config.hf)) == tiny_config


def test_text_only_config():
    d = _hf("tiny")
    cfg = K3Config.from_hf(d["text_config"])
    assert cfg.vision is None and cfg.text.num_layers == 7
