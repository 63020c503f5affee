"""The shipped autotuning choices (kimik3.ops.tuned): the table's form, a seeded key that is never timed while
another key is, the table placed in fla-core's own kernels, and the GPU / fla-core checks before it is used."""

import importlib.metadata
import json

import pytest
import torch

pytest.importorskip("triton")
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.runtime.autotuner import Autotuner  # noqa: E402

from kimik3.ops import tuned  # noqa: E402
from tests.helpers import needs_interpreter  # noqa: E402

H200 = tuned.table_path("NVIDIA H200")
CONFIGS = [triton.Config({"BLOCK": 16}, num_warps=1), triton.Config({"BLOCK": 32}, num_warps=2)]


@triton.heuristics({"EVEN": lambda args: args["N"] % 16 == 0})  # wrapped as fla wraps its autotuners
@triton.autotune(configs=CONFIGS, key=["N"])
@triton.jit
def double_kernel(x_ptr, y_ptr, N, BLOCK: tl.constexpr, EVEN: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, 2 * tl.load(x_ptr + offs, mask=offs < N), mask=offs < N)


def test_the_h200_table_holds_the_demo_and_slice_kernels_choices():
    table = json.loads(H200.read_text())
    assert table["gpu"] == "NVIDIA H200" and table["capability"] == [9, 0] and table["fla-core"] == "0.6.0"
    kernels = table["kernels"]
    assert len(kernels) == 8 and sum(len(v) for v in kernels.values()) >= 20
    for name, entries in kernels.items():
        assert name.startswith("fla.") and "_kernel" in name.rsplit(".", 1)[1], name
        for e in entries:
            assert set(e) == {"key", "config"} and e["key"] and "num_warps: " in e["config"], (name, e)
    # the slice's KDA (96 heads of 128) and the demo's (4 of 64) in the chunked solve's key
    keys = [e["key"][:2] for e in kernels["fla.ops.kda.chunk_intra.chunk_kda_fwd_kernel_inter_solve_fused"]]
    assert sorted(keys) == [[4, 4], [96, 96]]


def _tuner() -> Autotuner:
    t = double_kernel
    while not isinstance(t, Autotuner):
        t = t.fn
    return t


@needs_interpreter
def test_a_seeded_key_runs_its_choice_untimed_and_another_key_is_timed(monkeypatch):
    tuner = _tuner()
    tuner.cache.clear()
    timed = []
    monkeypatch.setattr(Autotuner, "_bench", lambda self, *a, config, **kw: timed.append(str(config)) or [1.0] * 3)
    name = f"{__name__}.double_kernel"
    table = {"kernels": {name: [{"key": [48, "torch.float32", "torch.float32"], "config": str(CONFIGS[1])}],
                         "no.such.module.kernel": [{"key": [1], "config": str(CONFIGS[0])}],
                         f"{__name__}.torch": [{"key": [1], "config": str(CONFIGS[0])}]}}
    assert tuned.apply(table) == 1  # the missing module and the object that is no kernel are passed over
    assert tuned.apply(table) == 0  # a choice already made is kept
    x = torch.arange(48, dtype=torch.float32)
    y = torch.empty_like(x)
    double_kernel[(3,)](x, y, 48)
    assert timed == [] and tuner.best_config is CONFIGS[1] and torch.equal(y, 2 * x)
    x = torch.arange(40, dtype=torch.float32)  # another key: tuned as before
    y = torch.empty_like(x)
    double_kernel[(3,)](x, y, 40)
    assert sorted(timed) == sorted(map(str, CONFIGS)) and torch.equal(y, 2 * x)


def test_a_config_the_kernel_does_not_have_is_passed_over():
    tuner = _tuner()
    tuner.cache.clear()
    other = str(triton.Config({"BLOCK": 64}, num_warps=4))
    assert tuned.apply({"kernels": {f"{__name__}.double_kernel": [{"key": [8, "torch.float32"], "config": other}]}}
                       ) == 0
    assert tuner.cache == {}


def test_the_h200_table_goes_into_fla_cores_kernels():
    pytest.importorskip("fla")
    table = json.loads(H200.read_text())
    tuners = {}
    for name in table["kernels"]:
        module, _, attr = name.rpartition(".")
        t = getattr(importlib.import_module(module), attr)
        while not isinstance(t, Autotuner):
            t = t.fn
        t.cache.clear()
        tuners[name] = t
    placed = tuned.apply(table)
    # fla builds some config lists from the device it finds: here (no GPU) one demo choice is not among them
    own = [(name, e) for name, v in table["kernels"].items() for e in v
           if e["config"] in {str(c) for c in tuners[name].configs}]
    assert placed == len(own) >= 20
    for name, e in own:
        assert str(tuners[name].cache[tuple(e["key"])]) == e["config"]


@pytest.mark.parametrize("gpu, capability, fla, placed", [
    ("NVIDIA H200", (9, 0), "0.6.0", True),
    ("NVIDIA H100 80GB HBM3", (9, 0), "0.6.0", True),  # no table of its own: the H200's, of its compute capability
    ("NVIDIA A100-SXM4-80GB", (8, 0), "0.6.0", False),
    ("NVIDIA H200", (9, 0), "0.7.0", False)])
def test_seed_fla_uses_a_table_of_its_gpu_or_capability_and_fla_version(monkeypatch, gpu, capability, fla, placed):
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: gpu)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: capability)
    monkeypatch.setattr(importlib.metadata, "version", lambda name: fla if name == "fla-core" else "0")
    monkeypatch.setattr(tuned, "apply", lambda table: calls.append(table["gpu"]) or 7)
    assert tuned.seed_fla.__wrapped__() == (7 if placed else 0)
    assert calls == (["NVIDIA H200"] if placed else [])


def test_seed_fla_without_cuda_places_nothing(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert tuned.seed_fla.__wrapped__() == 0


def test_the_refresh_tool_merges_a_runs_choices(tmp_path):
    """tools/tuned_configs.py: Triton's results in a cache folder (as a device run's tune.tgz unpacks) merge into
    the GPU's table beside what it held, the best timings' config as Triton prints it; --check says whether the
    table is up to date; a new table needs the GPU's compute capability."""
    pytest.importorskip("fla")
    import subprocess
    import sys

    from tests.helpers import REPO

    def tool(*args: str) -> int:
        return subprocess.run([sys.executable, "-W", "ignore", str(REPO / "tools" / "tuned_configs.py"),
                               str(tmp_path / "cache"), "--gpu", "Test GPU", "--table", str(table), *args],
                              capture_output=True, text=True, timeout=300).returncode

    table = tmp_path / "Test_GPU.json"
    held = json.loads(H200.read_text())
    table.write_text(H200.read_text())
    cache = tmp_path / "cache" / "HASH"
    cache.mkdir(parents=True)
    slow, fast = ({"kwargs": {"BT": bt}, "num_warps": w, "num_ctas": 1, "num_stages": 3, "maxnreg": None,
                   "pre_hook": None, "ir_override": None} for bt, w in ((16, 4), (32, 2)))
    new_key = [64, 7, "torch.bfloat16", "torch.bfloat16", "torch.float32"]
    (cache / "l2norm_fwd_kernel.autotune.json").write_text(json.dumps(
        {"key": new_key, "configs_timings": [[slow, [0.02, 0.01, 0.03]], [fast, [0.01, 0.01, 0.02]]]}))
    (cache / "not_an_fla_kernel.autotune.json").write_text(json.dumps({"key": [1], "configs_timings": [[slow, [1]]]}))
    assert tool("--check") == 1
    assert tool() == 0
    new = json.loads(table.read_text())
    l2 = new["kernels"]["fla.modules.norm.l2norm.l2norm_fwd_kernel"]
    assert {"key": new_key, "config": "BT: 32, num_warps: 2, num_ctas: 1, num_stages: 3, maxnreg: None"} in l2
    assert sum(map(len, new["kernels"].values())) == sum(map(len, held["kernels"].values())) + 1  # nothing dropped
    assert new["gpu"] == "Test GPU" and new["capability"] == [9, 0] and tool("--check") == 0
    table.unlink()  # a new table needs the GPU's compute capability
    assert tool() == 2
    assert tool("--capability", "8.9") == 0 and json.loads(table.read_text())["capability"] == [8, 9]
