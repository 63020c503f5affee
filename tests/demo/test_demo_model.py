"""The shipped demo model (package data: src/kimik3/demo/k3-shakespeare): released layout, exact match with its
config, every K3 feature on, deterministic greedy generation, and the README's first command with the model's
sampling defaults."""

import json
import re

import pytest
import torch

import kimik3
from kimik3.atlas import count_parameters
from kimik3.checkpoint import inspect_checkpoint
from kimik3.cli import main
from kimik3.inference import SamplingParams, generate
from kimik3.model import K3ForConditionalGeneration
from kimik3.presets import DEMO_MODEL, load_config
from kimik3.tokenizer import Tokenizer
from kimik3.tokenizer.hf_files import REMOTE_CODE, TOKENIZER_CONFIG, tokenizer_config

FILES = {"config.json", "generation_config.json", "model.safetensors.index.json", "tiktoken.model",
         "tokenizer_config.json", "tokenization_kimi.py", "MODEL_CARD.md", "model-00001-of-000002.safetensors",
         "model-00002-of-000002.safetensors"}


@pytest.fixture(scope="module")
def model():
    return kimik3.load(DEMO_MODEL, quiet=True).eval()


def tok_of_demo() -> Tokenizer:
    return Tokenizer.from_file(DEMO_MODEL)


@pytest.fixture(scope="module")
def tok():
    return tok_of_demo()


def test_layout_size_and_exact_match_with_config():
    assert {p.name for p in DEMO_MODEL.iterdir()} == FILES
    assert sum(p.stat().st_size for p in DEMO_MODEL.iterdir() if p.name != "MODEL_CARD.md") <= 25_000_000
    report = inspect_checkpoint(DEMO_MODEL)
    assert report.ok, report.lines()
    # written as this implementation writes (A_log padded to 128 entries): inspect has nothing to remark on
    assert report.notes == [], report.notes
    # the HF tokenizer files are what kimik3 writes today (the template or remote class changed: regenerate them
    # with kimik3.tokenizer.hf_files.write_hf_files(DEMO_MODEL, 4096))
    assert json.loads((DEMO_MODEL / TOKENIZER_CONFIG).read_text()) == tokenizer_config(tok_of_demo(), 4096)
    assert (DEMO_MODEL / REMOTE_CODE.name).read_bytes() == REMOTE_CODE.read_bytes()
    assert report.experts == "mxfp4" and report.by_dtype["U8"] > 0


def test_every_k3_feature_is_on(model):
    c = model.config.text
    assert c.layer_types == ("kda",) * 3 + ("mla",) + ("kda",) * 2 + ("mla",) * 2  # 3:1, the last two MLA
    assert c.moe_layers == (False,) + (True,) * 7  # dense layer 0, latent MoE after
    assert c.moe.num_experts >= 16 and c.moe.num_shared_experts == 1 and model.config.storage.experts == "mxfp4"
    assert len(range(0, c.num_layers, c.attn_res_block_size)) >= 2  # at least two AttnRes blocks


def test_greedy_generation_is_deterministic(model, tok):
    p = SamplingParams(temperature=0, max_new_tokens=24)
    a, b = (generate(model, [tok.encode("ROMEO:")], p, tokenizer=tok)[0] for _ in range(2))
    assert a.token_ids == b.token_ids and len(a.token_ids) == 24
    assert a.text.strip()  # real text, not an immediate end of sequence


def test_first_readme_command_uses_the_default_model(capsys):
    gen = json.loads((DEMO_MODEL / "generation_config.json").read_text())
    assert gen["temperature"] == 0.8 and gen["top_p"] == 0.95
    assert main(["generate", "--prompt", "ROMEO:", "--max-new-tokens", "20", "--seed", "0"]) == 0
    first = capsys.readouterr().out
    assert first.startswith("ROMEO:") and len(first) > len("ROMEO:") + 20
    assert main(["generate", "--prompt", "ROMEO:", "--max-new-tokens", "20", "--seed", "0"]) == 0
    assert capsys.readouterr().out == first  # seeded sampling repeats


def test_sampling_defaults_come_from_generation_config():
    import argparse

    from kimik3.cli.common import add_model_args, add_sampling_args, sampling_params

    p = argparse.ArgumentParser()
    add_model_args(p)
    add_sampling_args(p)
    params = sampling_params(p.parse_args([]))
    assert (params.temperature, params.top_p, params.max_new_tokens) == (0.8, 0.95, 256)
    params = sampling_params(p.parse_args(["--temperature", "0", "--top-p", "0.5"]))
    assert (params.temperature, params.top_p) == (0.0, 0.5)


def test_model_card_parameter_counts_are_the_live_models():
    """The card's counts are `kimik3 params demo`'s (the modules the checkpoint loads into, strictly)."""

    with torch.device("meta"):
        report = count_parameters(K3ForConditionalGeneration(load_config(DEMO_MODEL)))
    line = next(ln for ln in (DEMO_MODEL / "MODEL_CARD.md").read_text().splitlines() if ln.startswith("| parameters"))
    total, experts, active = (int(x.replace(",", "")) for x in re.findall(r"\d[\d,]+", line))
    by = {c.name: c.total for c in report.components}
    assert (total, experts, active) == (report.total, by["routed experts"], report.active)
