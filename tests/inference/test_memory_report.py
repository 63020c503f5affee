import json

from kimik3.cli import main
from kimik3.inference.memory import memory_report


def test_released_cache_sizes_match_spec_shapes(k3_config):
    r = memory_report(k3_config, context=1000, batch=3)
    kda_layers, mla_layers = 69, 24
    state = 96 * 128 * 128 * 4  # [H, K, V] fp32 per sequence
    conv = 3 * 3 * 12288 * 2  # q, k, v tails of W-1 = 3 bf16 pre-conv rows
    assert r.kda_state_per_sequence == kda_layers * (state + conv)
    assert r.mla_bytes_per_token == mla_layers * 576 * 2  # 512 latent + 64 shared key, bf16
    assert r.mla_cache == r.mla_bytes_per_token * 3 * 1000 and r.kda_state == 3 * r.kda_state_per_sequence
    # text weights as stored: MXFP4 experts (packed bytes + scales) + bf16/fp32 rest
    experts = 92 * 896 * (2 * 3072 * (1792 + 112) + 3584 * (1536 + 96))
    fp32 = 11_122_432  # spec 6 census: A_log, dt_bias, conv weights, o_norm, correction biases
    bf16 = 2_779_484_478_208 - 2_722_740_830_208 - fp32
    vision = 401_214_464 + 46_144_512  # tower + projector, bf16
    assert r.weights == experts + 2 * bf16 + 4 * fp32 + 2 * vision


def test_memory_cli(capsys):
    assert main(["memory", "tiny", "--context", "64", "--batch", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["total"] > out["weights"] > 0
    assert main(["memory", "--context", "0"]) == 2
