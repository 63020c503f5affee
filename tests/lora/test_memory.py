"""`kimik3.lora.memory`: adapter sizes and base bytes from an inventory equal those of the built model (tiny), and
the released K3's rows follow from its dimensions."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from kimik3 import lora
from kimik3.lora.memory import BENCH_TARGETS, lora_memory, markdown
from tests.helpers import REPO
from tests.lora.conftest import load_base

DTYPES = {"BF16": "bfloat16", "F32": "float32", "U8": "uint8"}


def inventory(folder: Path) -> dict:
    """A checkpoint folder's tensors as tensors.json writes them: name templates over {layer} and {expert}."""
    rows: dict[tuple, dict] = {}
    for shard in sorted(folder.glob("*.safetensors")):
        with safe_open(str(shard), "pt") as f:
            for key in f.keys():
                sl = f.get_slice(key)
                layer = re.search(r"\.layers\.(\d+)\.", key)
                expert = re.search(r"\.experts\.(\d+)\.", key)
                name = re.sub(r"\.layers\.\d+\.", ".layers.{layer}.", key)
                name = re.sub(r"\.experts\.\d+\.", ".experts.{expert}.", name)
                row = rows.setdefault((name, tuple(sl.get_shape())), {"name": name, "shape": list(sl.get_shape()),
                                                                      "dtype": DTYPES[sl.get_dtype()]})
                if layer:
                    row.setdefault("layers", set()).add(int(layer[1]))
                if expert:
                    row.setdefault("experts", set()).add(int(expert[1]))
    out = [{**r, **{k: sorted(r[k]) for k in ("layers", "experts") if k in r}} for r in rows.values()]
    return {"tensors": out}


@pytest.mark.parametrize("layout, scaling", [("per_expert", False), ("shared_outer", False), ("shared", False),
                                             ("per_expert", True)])
def test_tiny_inventory_gives_the_built_models_sizes(base_dir, layout, scaling):
    config = json.loads((base_dir / "config.json").read_text())
    report = lora_memory(config, inventory(base_dir), rank=4, experts=layout, rank_scaling=scaling)
    model = lora.apply(load_base(base_dir), lora.LoraConfig(rank=4, targets=BENCH_TARGETS, experts=layout,
                                                            rank_scaling=scaling))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert report["adapter_params"] == trainable > 0
    rows = {r.name.split(",")[0]: r.bytes for r in report["rows"]}
    packed = sum(b.numel() for n, b in model.named_buffers() if "experts.w" in n and b.dtype == torch.uint8)
    assert rows["routed experts"] == packed
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    frozen += sum(b.numel() for n, b in model.named_buffers() if b.dtype != torch.uint8)
    assert rows["non-expert weights"] // 2 + rows["fp32 tensors (as stored)"] // 4 == frozen
    assert rows["adapter gradients"] == 4 * trainable and rows["AdamW states (2 moments)"] == 8 * trainable


def test_released_k3_rows_follow_from_its_dimensions():
    config = json.loads((REPO / "configs" / "k3.json").read_text())
    tensors = json.loads((REPO / "tests" / "data" / "k3_tensors.json").read_text())
    E, layers, L, F, R = 896, 92, 3584, 3072, 16
    only = lora_memory(config, tensors, rank=R, targets=["*.block_sparse_moe.experts"])
    assert only["rows"][0].bytes == layers * E * (2 * F * (L // 2 + L // 32) + L * (F // 2 + F // 32))
    assert only["adapter_params"] == layers * E * R * 3 * (L + F)
    full = lora_memory(config, tensors, rank=R, tokens=8192)
    assert full["adapter_params"] > only["adapter_params"]
    assert full["host"] == full["fixed"] + 8192 * full["per_token_ac"] - full["node"] > 0  # it does not fit a node
    assert full["per_token_no_ac"] > 10 * full["per_token_ac"] > 0 and full["tokens_fit_ac"] == 0
    assert "must live in host memory" in markdown(full)
