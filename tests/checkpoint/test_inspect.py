"""The inspector reads headers only: the released inventory as 96 sparse shards reports the release's totals
and no differences; damage and config mismatches are all reported."""

import json
import math
import shutil
import time

import pytest

from kimik3.checkpoint import inspect_checkpoint
from kimik3.checkpoint.folder import gc_paused
from kimik3.checkpoint.keys import TensorSpec
from kimik3.checkpoint.safetensors_header import DTYPES, encode_header
from kimik3.cli import main
from tests.atlas.test_params import released_inventory
from tests.checkpoint.conftest import copy_of, edit_json
from tests.helpers import CONFIGS

SHARDS = 96


@pytest.fixture(scope="module")
def released(tmp_path_factory):
    """The released checkpoint's 497,220 headers in 96 shards whose data regions are sparse (no disk used)."""
    with gc_paused():
        return _write_released(tmp_path_factory.mktemp("released"))


def _write_released(root):
    names = {"bfloat16": "BF16", "float32": "F32", "uint8": "U8"}
    specs = [TensorSpec(n, shape, DTYPES[names[dt]]) for n, (shape, dt) in released_inventory("").items()]
    sizes = [s.dtype.itemsize * math.prod(s.shape) for s in specs]
    total, done = sum(sizes), 0
    shards: list[list[TensorSpec]] = [[] for _ in range(SHARDS)]
    for spec, size in zip(specs, sizes, strict=True):  # cut by bytes, as a size-capped writer would
        shards[min(SHARDS - 1, done * SHARDS // total)].append(spec)
        done += size
    weight_map = {}
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{SHARDS:06d}.safetensors"
        header, data = encode_header([(s.name, s.dtype, s.shape) for s in shard], {"format": "pt"})
        with open(root / name, "wb") as f:
            f.write(header)
            f.truncate(len(header) + sum(data))  # a sparse file: the size is real, the blocks are not
        weight_map |= {s.name: name for s in shard}
    (root / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, separators=(",", ":")))
    shutil.copy(CONFIGS / "k3.json", root / "config.json")
    return root


def test_released_inventory_has_no_differences(released):
    t0 = time.perf_counter()
    report = inspect_checkpoint(released)
    seconds = time.perf_counter() - t0
    assert report.ok, report.lines()[:12]
    assert report.shards == 96 and report.tensors == 497_220
    assert report.by_dtype == {"U8": 494_592, "BF16": 2_122, "F32": 506}
    assert report.parameters == 2_779_931_837_184
    # U8 1,446,456,066,048 + BF16 2 x 57,179,884,544 + F32 4 x 11,122,432; spec 6's 1,560,936,091,448 for the
    # release also counts its (roomier) JSON headers
    assert report.tensor_bytes == 1_560_860_324_864
    assert report.experts == "mxfp4" and report.dtype == "bfloat16"
    print(f"\n  inspect of the 96-shard sparse release fixture: {seconds:.2f} s")  # shown with -s


def test_inspect_cli(saved, capsys):
    assert main(["inspect", str(saved), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] and out["tensors"] == 466 and out["parameters"] == 1_491_992 and out["missing"] == []
    assert main(["inspect", str(saved)]) == 0
    assert "no differences from config.json" in capsys.readouterr().out


def test_every_difference_is_reported(saved, tmp_path, capsys):
    ck = copy_of(saved, tmp_path / "ck")
    shards = sorted(ck.glob("model-*.safetensors"))
    with open(shards[0], "r+b") as f:
        f.truncate(shards[0].stat().st_size - 10)  # truncated
    shards[1].write_bytes(b"PK\x03\x04 not a safetensors file")  # corrupt
    shards[2].unlink()  # missing
    edit_json(ck / "config.json", lambda c: c["text_config"].update(vocab_size=301))
    report = inspect_checkpoint(ck)
    text = "\n".join(report.problems)
    assert "truncated" in text and "torch.save zip/pickle" in text and "missing" in text
    m = report.mismatch
    assert [s.name for s, e in m.wrong] == ["language_model.model.embed_tokens.weight", "language_model.lm_head.weight"]
    assert m.missing and not m.unexpected  # the tensors of the unreadable shards
    assert main(["inspect", str(ck)]) == 1
    out = capsys.readouterr().out
    assert "expected [301, 80] bfloat16, found [300, 80] bfloat16" in out
    assert main(["inspect", str(tmp_path / "nope")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_tiny_counts(saved, packed_model):
    report = inspect_checkpoint(saved)
    assert report.ok and report.experts == "mxfp4"
    logical = sum(t.numel() * (2 if n.endswith("_packed") else 0 if n.endswith("_scale") else 1)
                  for n, t in packed_model.state_dict().items())
    assert report.parameters == logical == 1_491_992
