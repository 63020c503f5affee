"""The run config: the shipped example parses; every mistake names its key."""

from __future__ import annotations

import pytest

from kimik3.train.config import TrainConfig, from_dict, load_train_config
from tests.helpers import REPO

BASE = {"out_dir": "runs/x", "model": {"config": "tiny"}, "data": {"train": ["a.txt"]}, "train": {"steps": 3}}


def _with(section: str, key: str, value) -> dict:
    raw = {k: dict(v) if isinstance(v, dict) else v for k, v in BASE.items()}
    raw.setdefault(section, {})[key] = value
    return raw


def test_example_file_parses_with_every_key():
    cfg = load_train_config(REPO / "configs/train/tiny.toml")
    assert isinstance(cfg, TrainConfig) and cfg.model.config == "tiny" and cfg.optim.betas == [0.9, 0.95]
    text = (REPO / "configs/train/tiny.toml").read_text()
    for section, values in cfg.to_dict().items():
        if isinstance(values, dict):
            for key in values:  # every key is documented in the example (active or commented out)
                assert f"\n{key} =" in text or f"# {key} =" in text, f"{section}.{key} missing from tiny.toml"


def test_overrides_take_toml_values(tmp_path):
    cfg = load_train_config(REPO / "configs/train/tiny.toml",
                            ["train.steps=7", "optim.lr=1e-2", "out_dir=/tmp/y", "data.valid=[]", "log.progress=false"])
    assert (cfg.train.steps, cfg.optim.lr, cfg.out_dir, cfg.data.valid, cfg.log.progress) == (7, 1e-2, "/tmp/y", [],
                                                                                               False)


@pytest.mark.parametrize("raw, match", [
    (_with("train", "setps", 3), r"unknown key 'train.setps'; did you mean 'train.steps'"),
    (_with("trian", "steps", 3), r"unknown key 'trian'; did you mean 'train'"),
    (_with("train", "steps", "3"), r"'train.steps' must be an integer, got str '3'"),
    (_with("optim", "lr", "fast"), r"'optim.lr' must be a number, got str 'fast'"),
    (_with("train", "activation_checkpointing", 1), r"'train.activation_checkpointing' must be true or false"),
    (_with("optim", "name", "sgd"), r"'optim.name' must be one of 'adamw', 'muon', got 'sgd'"),
    (_with("balancing", "method", "aux"), r"'balancing.method' must be one of"),
    (_with("train", "micro_batch_rows", 0), r"'train.micro_batch_rows' must be >= 1"),
    (_with("optim", "betas", [0.9]), r"'optim.betas' must be two numbers"),
    (_with("data", "train", [1, 2]), r"'data.train' must be a string"),
    (_with("model", "checkpoint", "x"), r"exactly one of 'model.config'"),
    (_with("model", "config", 5), r"'model.config' must be a string"),
    ({k: v for k, v in BASE.items() if k != "out_dir"}, r"'out_dir' is required"),
    (_with("eval", "rows", -1), r"'eval.rows' must be >= 1"),
])
def test_bad_config_names_the_key(raw, match):
    with pytest.raises(ValueError, match=match):
        from_dict(raw, "run.toml")


def test_file_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no training config"):
        load_train_config(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("out_dir = \n")
    with pytest.raises(ValueError, match="bad.toml: not valid TOML"):
        load_train_config(bad)
    good = tmp_path / "ok.toml"
    good.write_text('out_dir = "x"\n[model]\nconfig = "tiny"\n[data]\ntrain = "a"\n[train]\nsteps = 2\nbogus = 1\n')
    with pytest.raises(ValueError, match=r"ok.toml: unknown key 'train.bogus'"):
        load_train_config(good)


def test_presets_load_by_name_and_find_their_files_in_the_package(tmp_path, monkeypatch):
    """`kimik3 train tiny` works from any folder (an installed wheel has no configs/ beside it): the preset's
    `{kimik3}/` paths are the package's own files."""
    from kimik3.presets import PACKAGE_DIR, TRAIN_CONFIG_DIR, train_preset_names
    from kimik3.train.data import _expand

    assert {"tiny", "demo", "mid", "demo-draft"} <= set(train_preset_names())
    assert (REPO / "configs/train/tiny.toml").read_bytes() == (TRAIN_CONFIG_DIR / "tiny.toml").read_bytes()
    monkeypatch.chdir(tmp_path)
    cfg = load_train_config("tiny")
    assert cfg.data.tokenizer == str(PACKAGE_DIR / "configs/train/bytes.tiktoken")
    train, valid = _expand(cfg.data.train, "data.train"), _expand(cfg.data.valid, "data.valid")
    assert valid and all(p.parent == PACKAGE_DIR / "model" for p in valid)
    assert len(train) > 50 and not set(train) & set(valid)  # the held-out model/ files are not trained on
    assert load_train_config("demo-draft").draft.target == str(PACKAGE_DIR / "demo/k3-shakespeare")
    with pytest.raises(FileNotFoundError, match=r"no training preset of that name \(presets: demo, demo-draft"):
        load_train_config("tiniest")


def test_package_prefix_only_in_path_keys():
    raw = _with("data", "tokenizer", "{kimik3}/configs/train/bytes.tiktoken")
    raw["data"]["train"] = ["{kimik3}/model/*.py", "local/{kimik3}/x.txt"]
    raw["model"] = {"config": "{kimik3}/configs/tiny.json"}
    cfg = from_dict(raw)
    from kimik3.presets import PACKAGE_DIR

    assert cfg.data.train == [str(PACKAGE_DIR / "model/*.py"), "local/{kimik3}/x.txt"]
    assert cfg.model.config == str(PACKAGE_DIR / "configs/tiny.json") and raw["model"]["config"].startswith("{")
    assert from_dict(_with("train", "steps", 3)).out_dir == "runs/x"


def test_lora_and_draft_tables_are_the_adapter_and_drafter_configs():
    """[lora] is a LoraConfig (one set of fields, defaults and checks); [draft]'s shape keys are DraftConfig's
    field names with its defaults, checked by DraftConfig against the target."""
    from dataclasses import fields

    from kimik3.inference.spec.drafter import DraftConfig
    from kimik3.lora import LoraConfig
    from kimik3.train.config import DRAFT_SHAPE_KEYS, DraftSection

    raw = {**BASE, "model": {"checkpoint": "some/base"}, "lora": {"rank": 4, "targets": ["*.q_proj"]}}
    cfg = from_dict(raw)
    assert cfg.lora == LoraConfig(rank=4, targets=["*.q_proj"]) and type(cfg.lora) is LoraConfig
    with pytest.raises(ValueError, match="<dict>: lora.rank must be an integer >= 1"):
        from_dict({**raw, "lora": {"rank": 0}})
    defaults = {f.name: f.default for f in fields(DraftConfig)}
    assert all(getattr(DraftSection(), k) == defaults[k] for k in DRAFT_SHAPE_KEYS)
    assert load_train_config("demo-draft").draft.num_hidden_layers == 2
