"""Hub ids resolve through huggingface_hub's cache: offline from a cache laid out as the hub lays it out."""

from __future__ import annotations

import shutil

import pytest
import torch

import kimik3
from kimik3.checkpoint.hub import is_hub_id, resolve
from kimik3.cli import main
from kimik3.presets import DEMO_MODEL

pytest.importorskip("huggingface_hub", reason="huggingface-hub (the hf extra) is not installed")

COMMITS = {"main": "a" * 40, "v1": "b" * 40}


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """HF_HUB_CACHE with models--demo-org--k3-shakespeare: two snapshots, refs/main and refs/v1; offline."""
    cache = tmp_path / "hub"
    repo = cache / "models--demo-org--k3-shakespeare"
    for ref, commit in COMMITS.items():
        shutil.copytree(DEMO_MODEL, repo / "snapshots" / commit)
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)
    return repo


def test_ids_and_paths():
    assert is_hub_id("moonshotai/Kimi-K3") and not is_hub_id(str(DEMO_MODEL)) and not is_hub_id("../x/y")
    assert resolve(DEMO_MODEL) == DEMO_MODEL
    with pytest.raises(ValueError, match="revision"):
        resolve(DEMO_MODEL, revision="main")


def test_offline_load_from_the_cache(hub_cache):
    assert resolve("demo-org/k3-shakespeare") == hub_cache / "snapshots" / COMMITS["main"]
    assert resolve("demo-org/k3-shakespeare", revision="v1") == hub_cache / "snapshots" / COMMITS["v1"]
    model = kimik3.load("demo-org/k3-shakespeare", dtype=torch.float32, quiet=True)
    ref = kimik3.load(DEMO_MODEL, dtype=torch.float32, quiet=True)
    ids = torch.randint(0, 8000, (1, 5))
    with torch.no_grad():
        assert torch.equal(model(ids), ref(ids))


def test_offline_miss_names_the_id(hub_cache):
    with pytest.raises(FileNotFoundError, match="demo-org/absent.*not in the local cache"):
        resolve("demo-org/absent")
    with pytest.raises(FileNotFoundError, match="revision 'v2'"):
        kimik3.load("demo-org/k3-shakespeare", revision="v2")


def test_cli_model_takes_a_hub_id(hub_cache, capsys):
    code = main(["generate", "--model", "demo-org/k3-shakespeare", "--prompt", "ROMEO:", "--max-new-tokens", "3",
                 "--temperature", "0", "--device", "cpu"])
    assert code == 0, capsys.readouterr().err
    code = main(["generate", "--model", "demo-org/absent", "--prompt", "x", "--device", "cpu"])
    assert code == 2 and "demo-org/absent" in capsys.readouterr().err


def test_transformers_from_pretrained_takes_a_hub_id(hub_cache):
    from transformers import AutoModelForCausalLM

    import kimik3.hf  # noqa: F401

    model = AutoModelForCausalLM.from_pretrained("demo-org/k3-shakespeare", revision="v1", dtype=torch.float32)
    assert model.loaded_from == hub_cache / "snapshots" / COMMITS["v1"]
