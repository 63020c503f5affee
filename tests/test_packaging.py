"""kimik3 as an installed package: presets and the demo model are package data, a built wheel and `pip install .`
each work in a fresh venv outside the repository, and a CUDA run without fla names the `gpu` extra.

The install test builds a wheel from a copy of the working tree (no stale `build/` can leak into it), makes a
fresh venv (no system site-packages), installs torch first from the local file the Makefile uses
(KIMIK3_TEST_TORCH, default `torch==2.13.0`, with --no-index so a machine without it fails here instead of
downloading a multi-GB CUDA build), then torch's and the package's small dependencies, and runs from a scratch
folder: `kimik3 params`, `kimik3.save(..., experts="mxfp4")` of the tiny preset, and the README's first command.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

import kimik3
import kimik3.ops.kda as kda
from kimik3.presets import CONFIG_DIR, DEMO_MODEL, PACKAGE_DIR, load_config, preset_names, resolve_config

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[1]
TORCH = os.environ.get("KIMIK3_TEST_TORCH", "torch==2.13.0")
NOT_COPIED = {".git", ".venv", "build", "dist", "out", "data", "__pycache__", ".pytest_cache", ".ruff_cache"}
SAVE_TINY = """
import json, sys, torch, kimik3
from kimik3.checkpoint import inspect_checkpoint
from kimik3.model import K3ForConditionalGeneration
from kimik3.presets import load_config
assert kimik3.__file__.startswith(sys.prefix), kimik3.__file__   # the installed copy, not the source tree
cfg = load_config("tiny")
model = K3ForConditionalGeneration(cfg, torch.float32, text_only=True)
model.language_model.init_weights(seed=0)
kimik3.save(model, "tiny-mxfp4", experts="mxfp4")
report = inspect_checkpoint("tiny-mxfp4")
assert report.ok, report.lines()
back = kimik3.load("tiny-mxfp4", dtype=torch.float32, quiet=True)
ids = torch.randint(0, cfg.text.vocab_size, (1, 8))
assert torch.isfinite(back(ids)).all()
print(json.dumps({"tensors": report.tensors, "quantization": "quantization_config" in
                  json.load(open("tiny-mxfp4/config.json"))["text_config"]}))
"""


def test_presets_and_demo_model_are_package_data():
    assert CONFIG_DIR.parent == DEMO_MODEL.parent.parent == PACKAGE_DIR == Path(kimik3.__file__).resolve().parent
    assert {"k3", "tiny", "demo", "mid"} <= set(preset_names())
    for name in preset_names():  # the repository's configs/ links to the package's copies, byte for byte
        assert (REPO / "configs" / f"{name}.json").read_bytes() == (CONFIG_DIR / f"{name}.json").read_bytes()
    assert resolve_config("tiny") == CONFIG_DIR / "tiny.json"
    assert load_config("k3").text.num_layers == 93
    assert (DEMO_MODEL / "config.json").is_file() and (DEMO_MODEL / "tiktoken.model").is_file()
    with pytest.raises(FileNotFoundError, match="presets: .*tiny"):
        resolve_config("no-such-preset")


def test_pyproject_declares_package_data_extras_and_tomli():
    meta = tomllib.loads((REPO / "pyproject.toml").read_text())
    data = meta["tool"]["setuptools"]["package-data"]["kimik3"]
    assert {"py.typed", "configs/*.json", "configs/train/*", "demo/k3-shakespeare/*", "ops/moe/*.c",
            "tokenizer/*.jinja", "hf/tasks/*"} <= set(data)
    assert (PACKAGE_DIR / "py.typed").is_file()
    assert "fla-core==0.6.0" in meta["project"]["optional-dependencies"]["gpu"]
    assert any(d.startswith("tomli") and "python_version < '3.11'" in d for d in meta["project"]["dependencies"])


def test_cuda_kda_without_fla_names_the_gpu_extra(monkeypatch):
    # as on a CUDA tensor with fla-core absent: an error naming the extra, never a silent fall back to the reference
    monkeypatch.setattr(kda, "use_fast", lambda t, op: True)
    monkeypatch.setattr(kda, "has_fla", lambda: False)
    B, T, H, K = 1, 4, 2, 8
    q, k, v, g = (torch.randn(B, T, H, K) for _ in range(4))
    beta = torch.randn(B, T, H)
    with pytest.raises(ImportError, match=r"kimik3\[gpu\]"):
        kda.chunk_kda_with_gate(q, k, v, g, beta, torch.randn(H), torch.randn(H * K), lower_bound=-5.0)


def sh(cmd: list[str], cwd: Path, **kw) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    r = subprocess.run(cmd, cwd=cwd, env={**env, "OMP_NUM_THREADS": "1"}, stdin=subprocess.DEVNULL,
                       capture_output=True, text=True, timeout=600, **kw)
    assert r.returncode == 0, f"{' '.join(cmd)} exited {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r.stdout


@pytest.fixture(scope="module")
def fresh_venv(tmp_path_factory):
    """(python of a fresh venv with torch and the package's dependencies but not the package, source copy)."""
    tmp = tmp_path_factory.mktemp("install")
    src = tmp / "kimik3-src"
    shutil.copytree(REPO, src, symlinks=True, ignore=lambda d, names: [n for n in names if n in NOT_COPIED
                                                                      or n.endswith(".egg-info")])
    sh([sys.executable, "-m", "venv", str(tmp / "venv")], tmp)
    py = tmp / "venv" / "bin" / "python"
    sh([str(py), "-m", "pip", "install", "-q", "--no-index", "--no-deps", TORCH], tmp)  # the local file or nothing
    deps = tomllib.loads((src / "pyproject.toml").read_text())["project"]["dependencies"]
    sh([str(py), "-m", "pip", "install", "-q", TORCH, *[d for d in deps if not d.startswith("torch")]], tmp)
    return py, src


def build_wheel(src: Path, out: Path) -> Path:
    isolation = [] if importlib.util.find_spec("setuptools") is None else ["--no-build-isolation"]
    sh([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", *isolation, "-w", str(out), str(src)], src)
    (wheel,) = out.glob("kimik3-*.whl")
    return wheel


# CI installs the wheel; `pip install .` builds the same wheel the same way (run it by hand: -m slow)
@pytest.mark.slow  # a fresh venv with torch and a package build, ~45 s on a CPU: run by hand (-m slow)
@pytest.mark.parametrize("how", ["wheel", "pip install ."])
def test_installed_package_runs_outside_the_repository(fresh_venv, how, tmp_path):
    py, src = fresh_venv
    if how == "wheel":
        wheel = build_wheel(src, tmp_path / "dist")
        names = set(zipfile.ZipFile(wheel).namelist())
        shipped = {f"kimik3/{p.relative_to(src / 'src' / 'kimik3')}" for p in (src / "src" / "kimik3").rglob("*")
                   if p.is_file() and p.suffix != ".pyc" and "__pycache__" not in p.parts}
        assert not shipped - names, f"files of src/kimik3 missing from the wheel: {sorted(shipped - names)[:10]}"
        target = str(wheel)
    else:
        target = str(src)
    sh([str(py), "-m", "pip", "install", "-q", "--no-deps", "--force-reinstall", target], tmp_path)
    try:
        run_dir = tmp_path / "elsewhere"
        run_dir.mkdir()
        kimik3_bin = str(py.parent / "kimik3")
        assert "2,779,931,837,184" in sh([kimik3_bin, "params"], run_dir)
        assert '"quantization": true' in sh([str(py), "-c", SAVE_TINY], run_dir)
        text = sh([kimik3_bin, "generate", "--prompt", "ROMEO:"], run_dir)  # the README's first command
        assert text.startswith("ROMEO:") and len(text) > 40, text
        # expert tiering: the host kernel's C source ships and builds where the package is installed
        tiered = subprocess.run([kimik3_bin, "generate", "--prompt", "ROMEO:", "--max-new-tokens", "8", "-v",
                                 "--cpu-offload-gb", "0.003", "--expert-misses", "host"], cwd=run_dir,
                                capture_output=True, text=True, timeout=300,
                                env={**os.environ, "KIMIK3_CACHE": str(tmp_path / "cache")})
        assert tiered.returncode == 0 and "expert cache:" in tiered.stderr, tiered.stderr[-2000:]
        assert list((tmp_path / "cache" / "ext").glob("host_experts-*.so"))
        # the training presets ship too: the README's training run needs no clone (one step here)
        sh([kimik3_bin, "train", "tiny", "--stop-at", "1", "--no-progress"], run_dir)
        assert (run_dir / "out/tiny-train/checkpoints/step-00000001/model/tiktoken.model").is_file()
    finally:
        sh([str(py), "-m", "pip", "uninstall", "-q", "-y", "kimik3"], tmp_path)
