"""Expert tiering end to end (`kimik3.placement`, `kimik3.load(cpu_offload_gb=...)`): the plan's arithmetic, bad
budgets, and the definition of done: greedy fp32 tokens equal to the all-resident run's for every budget, through
generate, the engine with several sequences, speculation, and a warm restart from a routing trace."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import kimik3
from kimik3.inference import SamplingParams
from kimik3.inference.engine import Engine, EngineConfig, SpeculativeConfig
from kimik3.inference.generate import generate
from kimik3.placement import (
    GIB,
    expert_bytes,
    fill_slots,
    load_trace,
    plan_experts,
    save_trace,
    tier_experts,
    tier_stats,
    tiered_layers,
)
from kimik3.presets import DEMO_MODEL, load_config

PROMPTS = [[5, 17, 99, 300], [1, 2, 3], [40, 41, 42, 43, 44, 45, 46]]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=20)
DEMO_EXPERT = 52224  # bytes of one demo expert: 2 x (256 x 64 + 256 x 4) + 128 x 128 + 128 x 8


def _demo(**kw):
    return kimik3.load(DEMO_MODEL, dtype="float32", quiet=True, **kw).eval()


@pytest.fixture(scope="module")
def resident():
    model = _demo(keep_experts_packed=True)
    with torch.no_grad():
        return [c.token_ids for c in generate(model, PROMPTS, GREEDY)]


def _tokens(model, config: EngineConfig | None = None):
    with torch.no_grad():
        return [c.token_ids for c in generate(model, PROMPTS, GREEDY, config=config)]


def test_k3_plan_by_hand():
    """Full K3 on one 8-GPU node (expert parallelism: 112 experts per GPU): 92 MoE layers x 112 experts x
    17,547,264 bytes = 180.8e9 bytes (168.4 GiB) per GPU; offloading 100 GiB and 64 staging experts (1.12e9 bytes)
    leave 72.3e9 bytes: floor(72.3e9 / (92 x 17,547,264)) = 44 slots a layer."""
    cfg = load_config("k3").text
    assert expert_bytes(cfg) == 17_547_264 and sum(cfg.moe_layers) == 92
    plan = plan_experts(cfg, 100, num_experts=112, host_bytes=2 ** 41)
    assert plan.expert_total == 92 * 112 * 17_547_264 == 180_807_008_256
    left = 180_807_008_256 - 100 * GIB - 2 * 32 * 17_547_264
    assert plan.slots == left // (92 * 17_547_264) == 44 and plan.staging == 32
    assert plan.uniform_hit_rate == 44 / 112 and plan.host_bytes == plan.expert_total
    assert plan.device_bytes == (92 * 44 + 64) * 17_547_264
    # auto: a card with 140 GiB free, 14 GiB of other weights, 20 GiB kept for state and workspace
    auto = plan_experts(cfg, "auto", num_experts=112, free_bytes=140 * GIB, other_bytes=14 * GIB,
                        reserve_bytes=20 * GIB, host_bytes=2 ** 41)
    assert auto.slots == (106 * GIB - 64 * 17_547_264) // (92 * 17_547_264) == 69
    assert not plan_experts(cfg, 0).tiered and not plan_experts(cfg, None).tiered


def test_k3_tier_plan_on_eight_h200_by_hand():
    """`kimik3 memory k3 --gpus 8`: 112 experts a device; the trunk's 114.4 GB over 8; at batch 1 a layer touches
    112 x 16 / 896 = 2 of a device's experts, 31 of whose 112 miss: 92 x 2 x 31/112 x 17,547,264 bytes = 0.8936 GB
    a step, copied at 96 / 8 GB/s a device (eight links share the host memory's 96 GB/s; the host kernel's 15.8
    GB/s over eight is slower still)."""
    from kimik3.inference.memory import tier_plan

    t = tier_plan(load_config("k3"), 8, 141 * GIB, 2048 * GIB, 32768, 1, 55.4e9, 96e9, 15.8e9, 4250e9)
    assert t.plan.num_experts == 112 and t.plan.slots == 81
    assert t.host_needed == 92 * 896 * 17_547_264
    assert t.missed_bytes == pytest.approx(92 * 2 * 31 / 112 * 17_547_264)
    assert t.miss_seconds == pytest.approx(t.missed_bytes / 12e9)
    assert t.trunk * 8 + 92 * 896 * 17_547_264 <= 1_560_860_324_864 < (t.trunk + 1) * 8 + 92 * 896 * 17_547_264


def test_the_planner_prints_the_plan():
    out = subprocess.run([sys.executable, "-m", "kimik3", "memory", "k3", "--gpus", "8", "--json"],
                         capture_output=True, text=True)
    data = json.loads(out.stdout)
    assert out.returncode == 0 and data["experts_per_layer_on_device"] == 81 and data["tiered"]
    assert 10 < data["decode_tokens_per_s"] < 15


@pytest.mark.parametrize("value, message", [
    (-1, "cpu_offload_gb must be a number of GiB >= 0 or 'auto', got -1"),
    ("lots", "cpu_offload_gb must be a number of GiB >= 0 or 'auto', got 'lots'"),
    (float("nan"), "cpu_offload_gb must be a number"),
    (1.0, "cpu_offload_gb 1 is more than the routed experts"),
])
def test_bad_budgets_are_refused(value, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        plan_experts(load_config("demo").text, value, host_bytes=2 ** 40)


def test_a_host_without_the_memory_is_refused():
    with pytest.raises(ValueError, match="the host tier needs 1347.1 GiB of host memory .* 64.0 GiB is available"):
        plan_experts(load_config("k3").text, 200, host_bytes=64 * GIB)


def test_auto_needs_a_device():
    with pytest.raises(ValueError, match="'auto' needs the device's free memory"):
        plan_experts(load_config("demo").text, "auto")


def test_the_cli_refuses_a_bad_budget_in_one_line():
    out = subprocess.run([sys.executable, "-m", "kimik3", "generate", "--prompt", "ROMEO:", "--cpu-offload-gb", "-1"],
                         capture_output=True, text=True)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "--cpu-offload-gb" in out.stderr and len(out.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("slots", [0, 1, 2, 8, 15])
@pytest.mark.parametrize("misses", ["copy", "host"])
def test_greedy_tokens_do_not_depend_on_the_budget(resident, slots, misses):
    model = _demo(keep_experts_packed=True)
    tier_experts(model, slots, "cpu", misses=misses)
    fill_slots(model)
    assert _tokens(model) == resident
    stats = tier_stats(model)
    assert stats["hits"] + stats["misses"] > 0 and (stats["host_rows"] > 0) == (misses == "host")


def test_load_with_an_offload_budget(resident):
    """`kimik3.load(cpu_offload_gb=...)`: 3 MB of the demo's 5.85 MB of experts offloaded leaves 2 slots of 16 a
    layer beside the two 16-expert staging buffers; the experts sit in host memory under their checkpoint names."""
    model = _demo(cpu_offload_gb=0.003)
    layers = tiered_layers(model)
    assert len(layers) == 7 and {m.cache.num_slots for _, m in layers} == {2}
    name, m = layers[0]
    assert set(model.state_dict()) >= {f"{name}.w1_packed", f"{name}.w2_scale"}
    assert _tokens(model) == resident


def test_engine_with_several_sequences_speculation_and_cpu_static_steps(resident):
    model = _demo(cpu_offload_gb=0.0035)  # one slot a layer
    assert _tokens(model, EngineConfig(max_num_seqs=2, max_num_batched_tokens=64)) == resident
    spec = SpeculativeConfig("suffix", None, 3)
    assert _tokens(model, EngineConfig(max_num_seqs=3, speculative=spec)) == resident
    # no timed steps on a tiered model (their random tokens would evict hot experts): k stays the ceiling
    assert Engine(model, EngineConfig(max_num_seqs=3, speculative=spec)).speculator.lengths.costs is None
    assert _tokens(model, EngineConfig(max_num_seqs=4, use_cuda_graphs=True)) == resident
    engine = Engine(model, EngineConfig(max_num_seqs=2))
    engine.generate(PROMPTS[:2], GREEDY)
    stats = engine.stats
    assert stats["expert_cache_hits"] + stats["expert_cache_misses"] > 0 and "expert_cache_bytes_copied" in stats


def test_a_trace_makes_the_restart_warm(resident, tmp_path):
    model = _demo(cpu_offload_gb=0.003)
    _tokens(model)
    trace = tmp_path / "trace.json"
    save_trace(model, trace)
    hottest = [m.cache.hottest().tolist() for _, m in tiered_layers(model)]
    again = _demo(cpu_offload_gb=0.003, expert_trace=trace)
    assert [sorted(m.cache.expert_in.tolist()) for _, m in tiered_layers(again)] == [sorted(h) for h in hottest]
    assert _tokens(again) == resident
    cold = _demo(cpu_offload_gb=0.003)
    _tokens(cold)
    assert tier_stats(again)["hits"] > tier_stats(cold)["hits"]
    (tmp_path / "bad.json").write_text(json.dumps({"kimik3": "expert-trace", "layers": {"x": {}}}))
    with pytest.raises(ValueError, match="not an expert trace of this model's 7 tiered layers"):
        load_trace(again, tmp_path / "bad.json")


def test_dense_checkpoints_are_refused(tmp_path):
    model = _demo()  # experts decoded to dense fp32
    kimik3.save(model, tmp_path / "dense", experts="bf16")
    with pytest.raises(ValueError, match="stores them dense; convert it first"):
        kimik3.load(tmp_path / "dense", cpu_offload_gb=0.001, quiet=True)


@pytest.mark.slow
def test_a_larger_checkpoint_with_most_experts_in_host_memory_generates(tmp_path):
    """A random K3-shaped checkpoint of the tiny preset with wider experts written to disk, loaded with all but one
    expert a layer in host memory: the same greedy tokens as loaded whole."""
    from kimik3.model import K3ForConditionalGeneration
    from kimik3.quant import pack_experts

    cfg = load_config("tiny")
    torch.manual_seed(0)
    model = pack_experts(K3ForConditionalGeneration(cfg, torch.float32))
    kimik3.save(model, tmp_path / "ckpt")
    whole = kimik3.load(tmp_path / "ckpt", dtype="float32", keep_experts_packed=True, quiet=True).eval()
    total = sum(cfg.text.moe_layers) * cfg.text.moe.num_experts * expert_bytes(cfg.text)
    tiered = kimik3.load(tmp_path / "ckpt", dtype="float32", quiet=True, cpu_offload_gb=0.9 * total / GIB).eval()
    assert {m.cache.num_slots for _, m in tiered_layers(tiered)} == {0}
    prompts = [[3, 5, 7, 11], [13, 17]]
    with torch.no_grad():
        want = [c.token_ids for c in generate(whole, prompts, GREEDY)]
        assert [c.token_ids for c in generate(tiered, prompts, GREEDY)] == want


def test_generate_says_the_hit_rate_when_verbose(tmp_path):
    out = subprocess.run([sys.executable, "-m", "kimik3", "generate", "--prompt", "ROMEO:", "--max-new-tokens", "8",
                          "--cpu-offload-gb", "0.003", "--expert-trace", str(tmp_path / "t.json"), "-v"],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "expert cache:" in out.stderr and "% hits of" in out.stderr
    assert json.loads((tmp_path / "t.json").read_text())["kimik3"] == "expert-trace"  # written at exit


def test_a_gguf_loads_tiered_too(resident, tmp_path):
    pytest.importorskip("gguf")
    out = subprocess.run([sys.executable, "-m", "kimik3", "convert", str(DEMO_MODEL), str(tmp_path / "demo.gguf")],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    model = kimik3.load(tmp_path / "demo.gguf", dtype="float32", cpu_offload_gb=0.003, quiet=True).eval()
    assert {m.cache.num_slots for _, m in tiered_layers(model)} == {2}
    assert _tokens(model) == resident
