"""Bad input: one clear FileNotFoundError/ValueError naming the file, the first offending tensors and what
was expected; never a half-loaded model, never an unpickled file."""

import json
import pickle
import struct

import pytest
import torch

from kimik3.checkpoint import load
from tests.checkpoint.conftest import copy_of, edit_json, rewrite_single

NORM = "language_model.model.norm.weight"


@pytest.fixture
def ck(saved, tmp_path):
    """A private copy of the saved tiny checkpoint, free to break."""
    return copy_of(saved, tmp_path / "ck")


def _shard(ck, i=0):
    return sorted(ck.glob("model-*.safetensors"))[i]


def test_path_does_not_exist(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load(tmp_path / "nope")


def test_missing_config(ck):
    (ck / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"no config\.json"):
        load(ck)


def test_no_weights(ck):
    for f in ck.glob("*.safetensors*"):
        f.unlink()
    with pytest.raises(FileNotFoundError, match=r"model\.safetensors\.index\.json.*or model\.safetensors"):
        load(ck)


def test_bad_arguments(ck):
    with pytest.raises(ValueError, match="experts"):
        load(ck, experts="fp8")
    with pytest.raises(ValueError, match="dtype"):
        load(ck, dtype=torch.int8)
    with pytest.raises(ValueError, match="dtype"):
        load(ck, dtype="float8")
    with pytest.raises(ValueError, match="device"):
        load(ck, device="tpu")
    with pytest.raises(ValueError, match="text_only"):
        load(ck, text_only="yes")


def test_config_dtype_is_not_a_float(ck):
    edit_json(ck / "config.json", lambda c: c["text_config"].update(dtype="int8"))
    with pytest.raises(ValueError, match=r"config\.json: config: 'text_config\.dtype' must be one of bfloat16, "
                                         r"float32, float16, got 'int8'"):
        load(ck)


def test_missing_tensor(ck):
    rewrite_single(ck, lambda d: d.pop(NORM))
    with pytest.raises(ValueError, match=rf"1 missing, 0 unexpected.*\n  missing     {NORM}: expected \[80\] bfloat16"):
        load(ck)


def test_unexpected_tensor(ck):
    rewrite_single(ck, lambda d: d.update({"language_model.model.extra.weight": torch.zeros(3)}))
    with pytest.raises(ValueError, match=r"1 unexpected.*model\.safetensors.*\n  unexpected  language_model"
                                         r"\.model\.extra\.weight in model\.safetensors: \[3\] float32"):
        load(ck)


def test_wrong_shape(ck):
    rewrite_single(ck, lambda d: d.update({NORM: torch.ones(81, dtype=torch.bfloat16)}))
    with pytest.raises(ValueError, match=rf"{NORM} in model\.safetensors: expected \[80\] bfloat16, "
                                         r"found \[81\] bfloat16"):
        load(ck)


def test_wrong_dtype(ck):
    rewrite_single(ck, lambda d: d.update({NORM: d[NORM].float()}))
    with pytest.raises(ValueError, match=r"expected \[80\] bfloat16, found \[80\] float32"):
        load(ck)


def test_config_does_not_match_weights(ck):
    edit_json(ck / "config.json", lambda c: c["text_config"].update(hidden_size=96))
    with pytest.raises(ValueError, match=r"do not match config\.json.*with the wrong shape.*offending shards: "
                                         r"model-0000.*\n  wrong .*expected \[\d+, 96\] bfloat16, found \[\d+, 80\]"):
        load(ck)


def test_dense_experts_under_an_mxfp4_config(dense_model, tmp_path):
    from kimik3.checkpoint import save

    ck = save(dense_model, tmp_path / "ck", experts="bf16")
    released = json.loads((tmp_path / "ck" / "config.json").read_text())
    edit_json(ck / "config.json", lambda c: c["text_config"].update(
        quantization_config={"format": "mxfp4-pack-quantized"}))
    with pytest.raises(ValueError, match="drop quantization_config"):
        load(ck)
    assert "quantization_config" not in released["text_config"]


def test_index_names_a_missing_shard(ck):
    _shard(ck, 1).unlink()
    with pytest.raises(FileNotFoundError, match=r"(?s)index\.json: names 1 shard.*model-00002-of-0000\d\d\.safetensors "
                                                r"\(should hold \d+ tensors, e\.g\. 'language_model"):
        load(ck)


def test_index_disagrees_with_the_shards(ck):
    def move(c):  # place the first tensor in a shard that does not hold it
        name = next(iter(c["weight_map"]))
        c["weight_map"][name] = _shard(ck, 1).name if c["weight_map"][name] == _shard(ck, 0).name \
            else _shard(ck, 0).name

    edit_json(ck / "model.safetensors.index.json", move)
    with pytest.raises(ValueError, match="not in the shard the index names"):
        load(ck)


def test_index_not_json(ck):
    (ck / "model.safetensors.index.json").write_text("{nope")
    with pytest.raises(ValueError, match=r"index\.json: not valid JSON"):
        load(ck)


def test_truncated_shard(ck):
    shard = _shard(ck, 0)
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 1000)
    with pytest.raises(ValueError, match=rf"past the end of their shard.*\n  .* in {shard.name}: needs bytes up to"):
        load(ck)


def test_header_length_beyond_file(ck):
    shard = _shard(ck, 0)
    with open(shard, "r+b") as f:
        f.write(struct.pack("<Q", 10**12))
    with pytest.raises(ValueError, match=rf"{shard.name}: not a safetensors file: header length 1,000,000,000,000 "
                                         "exceeds the file"):
        load(ck)


def test_garbage_header(ck):
    shard = _shard(ck, 0)
    with open(shard, "r+b") as f:
        f.seek(8)
        f.write(b"\xff\xfe garbage")
    with pytest.raises(ValueError, match=rf"{shard.name}: not a safetensors file: the header is not valid JSON"):
        load(ck)


def test_bad_json_header(ck):
    shard = _shard(ck, 0)
    with open(shard, "r+b") as f:
        f.seek(8)
        f.write(b'{"a":')
    with pytest.raises(ValueError, match=r"not valid JSON"):
        load(ck)


def test_corrupt_header_entry(ck):
    shard = _shard(ck, 0)
    raw = shard.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = raw[8:8 + n].replace(b'"BF16"', b'"XX16"', 1)
    shard.write_bytes(raw[:8] + header + raw[8 + n:])
    with pytest.raises(ValueError, match=r"corrupt header entry for tensor '.*': expected \{\"dtype\": one of BOOL"):
        load(ck)


def test_too_short_file(ck):
    _shard(ck, 0).write_bytes(b"abc")
    with pytest.raises(ValueError, match=r"not a safetensors file: only 3 bytes"):
        load(ck)


def test_pickle_is_never_unpickled(ck, monkeypatch, dense_model):
    for f in ck.glob("*.safetensors*"):
        f.unlink()
    torch.save(dense_model.state_dict(), ck / "model.safetensors")

    def forbidden(*args, **kwargs):
        raise AssertionError("something tried to unpickle")

    monkeypatch.setattr(torch, "load", forbidden)
    monkeypatch.setattr(pickle, "load", forbidden)
    monkeypatch.setattr(pickle, "loads", forbidden)
    monkeypatch.setattr(pickle, "Unpickler", forbidden)
    with pytest.raises(ValueError, match=r"model\.safetensors: not a safetensors file: .*torch\.save zip/pickle"):
        load(ck)


def test_tensor_in_two_shards(ck):
    from safetensors.torch import load_file, save_file

    first, second = _shard(ck, 0), _shard(ck, 1)
    extra = load_file(second)
    name = next(iter(load_file(first)))
    extra[name] = load_file(first)[name]
    save_file(extra, second)
    with pytest.raises(ValueError, match=rf"tensor '{name}' is in both"):
        load(ck)
