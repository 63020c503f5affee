import copy
import dataclasses
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
    (["text_config", "tie_word_embeddings"], True, "tie_word_embeddings"),  # read, never silently ignored
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
    with pytest.raises(dataclasses.FrozenInstanceError):
        tiny_config.text.hidden_size = 3
    assert K3Config.from_hf(copy.deepcopy(tiny_config.hf)) == tiny_config


def test_text_only_config():
    d = _hf("tiny")
    cfg = K3Config.from_hf(d["text_config"])
    assert cfg.vision is None and cfg.text.num_layers == 7


@pytest.mark.parametrize("path, value, field", [
    (["text_config", "num_hidden_layers"], "8", "text_config.num_hidden_layers' must be an integer, got '8'"),
    (["text_config", "num_hidden_layers"], 7.0, "text_config.num_hidden_layers' must be an integer, got 7.0"),
    (["text_config", "num_hidden_layers"], True, "text_config.num_hidden_layers' must be an integer, got True"),
    (["text_config", "num_hidden_layers"], [7], "text_config.num_hidden_layers' must be an integer, got \\[7\\]"),
    (["text_config", "hidden_size"], None, "text_config.hidden_size' must be an integer, got None"),
    (["text_config", "dtype"], "int8", "text_config.dtype' must be one of bfloat16, float32, float16, got 'int8'"),
    (["text_config", "rms_norm_eps"], "1e-5", "text_config.rms_norm_eps' must be a number"),
    (["text_config", "routed_scaling_factor"], False, "text_config.routed_scaling_factor' must be a number"),
    (["text_config", "moe_renormalize"], 1, "text_config.moe_renormalize' must be true or false, got 1"),
    (["text_config", "pad_token_id"], "5", "text_config.pad_token_id' must be an integer"),
    (["text_config", "hidden_act"], 3, "text_config.hidden_act' must be a string"),
    (["text_config", "linear_attn_config", "kda_layers"], ["1", 2], "linear_attn_config.kda_layers' must be a list"),
    (["text_config", "linear_attn_config", "num_heads"], 3.5, "linear_attn_config.num_heads' must be an integer"),
    (["text_config", "linear_attn_config"], [1, 2], "linear_attn_config' must be an object"),
    (["text_config", "quantization_config"], "mxfp4", "quantization_config' must be an object"),
    (["text_config"], [], "text_config' must be an object"),
    (["vision_config"], "yes", "vision_config' must be an object"),
    (["vision_config", "merge_kernel_size"], "2x2", "vision_config.merge_kernel_size' must be a list of integers"),
    (["vision_config", "patch_size"], "14", "vision_config.patch_size' must be an integer"),
    (["eos_token_id"], 1.5, "'eos_token_id' must be an integer"),
])
def test_wrong_types_are_value_errors_naming_the_field(path, value, field):
    with pytest.raises(ValueError, match=field):
        K3Config.from_hf(_mutate(path, value))


def test_wrong_type_on_the_command_line_names_the_field(tmp_path, capsys):
    from kimik3.cli import main

    (tmp_path / "config.json").write_text(json.dumps(_mutate(["text_config", "num_hidden_layers"], "8")))
    assert main(["params", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "text_config.num_hidden_layers' must be an integer, got '8'" in err and "Traceback" not in err


@pytest.mark.parametrize("path, key, near", [
    (["text_config"], "initializer_rnage", "text_config.initializer_range"),
    (["text_config", "linear_attn_config"], "gate_lower_bond", "text_config.linear_attn_config.gate_lower_bound"),
    ([], "media_placeholder_token", "media_placeholder_token_id"),
    (["vision_config"], "patch_sise", "vision_config.patch_size"),
])
def test_unknown_keys_warn_with_the_closest_known_one(path, key, near):
    d = _hf("tiny")
    node = d
    for k in path:
        node = node[k]
    node[key] = 1
    with pytest.warns(UserWarning, match=rf"unknown key '.*{key}' is ignored; did you mean '{near}'\?"):
        cfg = K3Config.from_hf(d)
    assert cfg.text == K3Config.from_hf(_hf("tiny")).text


def test_a_config_file_is_named_in_its_errors_and_warnings(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(_mutate(["text_config", "num_hidden_layers"], 7.5)))
    with pytest.raises(ValueError, match=rf"^{path}: config: 'text_config.num_hidden_layers' must be an integer"):
        K3Config.from_file(path)
    path.write_text(json.dumps(_mutate(["text_config", "rms_norm_epsilon"], 1e-5)))
    with pytest.warns(UserWarning, match=rf"^{path}: config: unknown key 'text_config.rms_norm_epsilon'"):
        K3Config.from_file(path)


def test_shipped_configs_have_no_unknown_keys(recwarn):
    from kimik3.presets import CONFIG_DIR, DEMO_MODEL

    for path in [*sorted(CONFIG_DIR.glob("*.json")), DEMO_MODEL / "config.json"]:
        K3Config.from_file(path)
    assert [str(w.message) for w in recwarn] == []


def test_storage_is_apart_from_the_model():
    """dtype and expert format describe the files: two configs that differ only there have equal TextConfigs."""
    d = _hf("tiny")
    stored = K3Config.from_hf(d)
    d["text_config"].pop("quantization_config")
    d["text_config"]["dtype"] = d["dtype"] = "float32"
    dense = K3Config.from_hf(d)
    assert (stored.storage.experts, stored.storage.dtype) == ("mxfp4", "bfloat16")
    assert (dense.storage.experts, dense.storage.dtype) == ("bf16", "float32")
    assert dense.text == stored.text and dense != stored


def test_a_log_is_padded_to_a_multiple_of_128():
    for heads, size in [(1, 128), (3, 128), (96, 128), (128, 128), (129, 256)]:
        d = _hf("tiny")
        d["text_config"]["linear_attn_config"]["num_heads"] = heads
        assert K3Config.from_hf(d).text.kda.a_log_size == size
