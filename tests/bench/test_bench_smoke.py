"""The device benchmarks' scripts run end to end at toy sizes on the CPU (`--smoke`): a check of their logic
(shapes, caches, roofline arithmetic, JSON), so device time is not spent finding a typo. The numbers mean nothing."""

import json
import os
import subprocess
import sys

import pytest

from tests.helpers import REPO, free_port


def _run(module: str, out, *args: str) -> None:
    """`python -m bench.NAME ARGS` from the repository root, results to `out` (benchmarks are scripts: the tests
    run them as a user does and never import them)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OUT": str(out), "PYTHONPATH": str(REPO / "src")}
    proc = subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]


@pytest.mark.parametrize("name, keys", [
    ("bench_layer", {"KDA+MoE decode B=1", "KDA+MoE decode B=64", "KDA+MoE prefill T=128",
                                  "MLA+MoE decode B=8", "MLA+MoE prefill T=128"}),
    pytest.param("bench_slice", {"prefill T=128 ours", "prefill T=64 reference", "decode B=1", "decode B=64"},
                 marks=pytest.mark.slow),  # 14 s; bench_layer's smoke runs the same layers
    ("bench_mla", {"B=1 S=64", "B=4 S=64"}),
    ("bench_situ", {"routed rows", "shared expert"}),
    ("bench_router", {"4", "32"}),
    ("bench_grouped", {"fused", "unfused"}),  # the fused side under Triton's interpreter on the CPU
    ("bench_rmsnorm", {"hidden", "latent", "decode"}),
    ("bench_shortconv", {"one sequence", "8 packed documents"}),
    ("bench_optim", {"adamw torch fused", "adamw ours", "norm torch get_total_norm", "norm ours"}),
])
def test_smoke_run_writes_its_results(name, keys, tmp_path):
    _run(f"bench.{name}", tmp_path, "--smoke")
    data = json.loads((tmp_path / f"{name}.json").read_text())
    assert keys <= set(data["results"]) and data["env"]["gpu"].startswith("none")
    for value in data["results"].values():
        numbers = value.values() if isinstance(value, dict) else [value]
        assert all(v > 0 for v in numbers)
        if isinstance(value, dict) and "rel_err" in value:  # MLA: the absorbed form computes the expanded one
            assert value["rel_err"] < 2e-2


def _torchrun(script: list[str], out) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OUT": str(out)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           *script]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]


def test_ep_serving_smoke_on_two_gloo_ranks(tmp_path):
    """bench_ep_serve.py under torchrun (2 CPU ranks, each holding half of the experts) writes its table's JSON."""
    _torchrun(["bench/bench_ep_serve.py", "--smoke"], tmp_path)
    data = json.loads((tmp_path / "bench_ep_serve.json").read_text())
    assert data["env"]["ranks"] == 2
    assert {"prefill T=32 per rank", "decode B=1 per rank", "decode B=64 per rank"} <= set(data["results"])
    assert all(r["ms_per_step"] > 0 and r["weight_bytes"] > 0 for k, r in data["results"].items() if "decode" in k)


def test_parallel_checks_pass_on_two_gloo_ranks(tmp_path):
    """check_parallel.py, the multi-GPU session's equivalence run, passes on CPU ranks (it exits 1 on a miss)."""
    _torchrun(["tools/check_parallel.py"], tmp_path)
    data = json.loads((tmp_path / "check_parallel.json").read_text())
    assert data["ok"] and data["env"]["backend"] == "gloo" and len(data["results"]) == 4


@pytest.mark.slow  # 16 s: the default run's time budget (its peer test is slow too)
def test_training_step_bench_smoke(tmp_path):
    """bench_train.py --smoke: the tiny model through the same phases (fwd+bwd, fast-vs-reference check,
    optimizer), both precisions, on the CPU."""
    _run("bench.bench_train", tmp_path, "--smoke")
    data = json.loads((tmp_path / "bench_train_smoke.json").read_text())
    assert set(data["modes"]) == {"bf16", "fp32-master"} and all(m["check"]["ok"] for m in data["modes"].values())
    assert data["truth"]["experts"] == 3 and data["truth"]["ok"], data["truth"]
    h = data["headline"]
    assert h["ms"] > h["fwd_bwd_ms"] > 0 and h["tokens_per_s"] > 0 and h["adamw_ms"] > 0
    # the step adds the trainer's own optimizer phase (our AdamW, clip folded in), not a sum of stand-ins
    assert h["optimizer_phase_ms"] > 0 and h["ms"] == h["fwd_bwd_ms"] + h["optimizer_phase_ms"]
    assert all(m["optimizer"]["trainer"]["folds_clipping"] for m in data["modes"].values())


@pytest.mark.slow  # the peer's own run, ~20 s on a CPU: the smoke above runs the bench
def test_training_step_bench_runs_the_peer_first(tmp_path):
    """--peer: the peer's own script runs in the same call and its forward+backward line becomes the peer row; a
    peer that prints no such line leaves the recorded row, marked as such."""
    line = "AutoModel K3 slice train step fwd+bwd: 500.0 ms at T=128 -> 256 tok/s, 1 TFLOP/s (0% of 692)"
    fast = ("--precision=bf16", "--checkpointing=off", "--no-unpacked")
    _run("bench.bench_train", tmp_path, "--smoke", *fast, "--peer", f"{sys.executable} -c 'print(\"{line}\")'")
    peer = json.loads((tmp_path / "bench_train_smoke.json").read_text())["peer"]
    assert peer["source"] == "measured in this run" and peer["ms"] == 500.0 and peer["tokens_per_s"] == 256.0
    _run("bench.bench_train", tmp_path, "--smoke", *fast, "--peer", f"{sys.executable} -c 'print(1)'")
    peer = json.loads((tmp_path / "bench_train_smoke.json").read_text())["peer"]
    assert peer["source"] == "design.md 6" and peer["ms"] == 732.0 and peer["attempted"] == "exit 0"


def test_lora_bench_smoke_times_both_steps(tmp_path):
    """bench_lora.py --smoke: the LoRA step (MXFP4 experts, adapter on every target) and the full step both ran."""
    _run("bench.bench_lora", tmp_path, "--smoke")
    data = json.loads((tmp_path / "bench_lora.json").read_text())
    lo, full = data["lora"], data["full"]
    assert lo["error"] is None and lo["finite_gradients"] and lo["ms"] > 0 and lo["adapter_params"] > 0
    assert full["ms"] > 0 and full["adamw_states_gib"] == 2 * full["weights_gib"] > 0
    assert data["time_ratio"] > 0 and lo["frozen_gib"] < full["weights_gib"]  # packed experts: a smaller base


@pytest.mark.slow  # the peer's own run: the smoke above runs the bench
def test_lora_bench_runs_the_peer_first(tmp_path):
    """--peer: the peer's LoRA step line becomes its row and our ratios to it; no such line is an error row."""
    line = "peer lora step: 400.0 ms at T=128, peak 2.0 GiB, 1234 adapter parameters, experts unquantized"
    _run("bench.bench_lora", tmp_path, "--smoke", "--skip-full", "--peer", f"{sys.executable} -c 'print(\"{line}\")'")
    data = json.loads((tmp_path / "bench_lora.json").read_text())
    assert data["peer"]["ms"] == 400.0 and data["peer"]["experts"] == "unquantized"
    assert data["peer"]["adapter_params"] == 1234 and data["peer_time_ratio"] == data["lora"]["ms"] / 400.0
    _run("bench.bench_lora", tmp_path, "--smoke", "--skip-full", "--peer", f"{sys.executable} -c 'print(1)'")
    data = json.loads((tmp_path / "bench_lora.json").read_text())
    assert data["peer"]["error"] == "no step line (exit 0)" and "peer_time_ratio" not in data


@pytest.mark.slow  # 11 s: the default run's time budget; tests/inference/engine covers the engine it drives
def test_speculative_bench_smoke(tmp_path):
    """bench_spec checks every speculative run against the run without, token for token, before timing it."""
    _run("bench.bench_spec", tmp_path, "--smoke")
    data = json.loads((tmp_path / "bench_spec.json").read_text())
    res = data["results"]
    assert {"oracle B=1 p=0.5", "oracle B=2 p=0.8", "copy suffix B=1", "oracle B=1 p=0.8, one expert set"} <= set(res)
    assert res["oracle B=1 p=0.8"]["accepted_length"] > res["oracle B=1 p=0.5"]["accepted_length"] > 1
    # the same expected length from 2 drafts as from 3 (p solved for it)
    short = next(v for name, v in res.items() if name.startswith("oracle B=1") and name.endswith("k=2"))
    assert abs(short["expected"] - res["oracle B=1 p=0.8"]["expected"]) < 1e-9
    # the copy row copies: the model with its attention outputs zeroed continues x + y + x with y
    copy = res["copy suffix B=1"]
    assert copy["vs_copied_text"] == "exact" and copy["accepted_length"] > 2
    # beside each fixed-k row, the engine choosing k up to the ceiling: exact, and it drafted
    chosen = res["oracle B=1 p=0.8 k<=3 chosen"]
    assert chosen["greedy_vs_off"] == "exact" and 0 < chosen["mean_draft"] <= 3
    # the oracle rows on the token map: the fixed point is the run itself
    assert res["token map: oracle B=1 p=0.8"]["vs_its_reference"] == "exact"


def test_engine_bench_compares_continuous_and_static_batching_pass_for_pass(tmp_path):
    """The mixed row's ratios are like with like: the engine's first pass after its warm-up against static
    batching's first, the engine's second against static's second (a second pass against a first flatters)."""
    _run("bench.bench_engine", tmp_path, "--smoke", "--rows", "mixed")
    mixed = json.loads((tmp_path / "bench_engine_smoke.json").read_text())["mixed"]
    assert mixed["fresh_ratio"] == mixed["fresh_tokens_per_s"] / mixed["static_fresh_tokens_per_s"]
    assert mixed["ratio"] == mixed["engine_tokens_per_s"] / mixed["static_tokens_per_s"]
    assert mixed["static_fresh_tokens_per_s"] != mixed["static_tokens_per_s"]  # two timed passes, not one reused


def test_matmul_bench_records_a_decode_steps_products(tmp_path):
    """bench_matmul times the products it recorded in one engine decode step (the toy model's linear layers and
    MLA's absorbed products), each against torch's, beside a bytes floor."""
    _run("bench.bench_matmul", tmp_path, "--smoke")
    data = json.loads((tmp_path / "bench_matmul_smoke.json").read_text())
    ops = {key[0] for key, _ in data["products"]}
    assert {"aten.mm.default", "aten.bmm.default"} <= ops and all(n >= 1 for _, n in data["products"])
    for M in (1, 64):
        row = data[f"M={M}"]
        assert row["cublas_ms"] > 0 and row["floor_ms"] > 0 and row["None"]["ms"] > 0
