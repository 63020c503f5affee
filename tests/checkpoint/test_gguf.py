"""GGUF both ways (llama.cpp's kimi-k3 layout): export -> import is the identity, MXFP4 blocks are the same numbers,
splits, atomic writes, foreign files refused in one line, other ggml types dequantized with a note, and a file as
llama.cpp's converter writes it (no kimik3 keys) loads with the same function. llama.cpp itself: test_gguf_llama_cpp.py.
"""

from __future__ import annotations

import json
import shutil

import gguf
import numpy as np
import pytest
import torch

import kimik3
from kimik3 import lora
from kimik3.checkpoint import gguf_write
from kimik3.checkpoint.gguf_mxfp4 import from_ggml, to_ggml
from kimik3.checkpoint.gguf_read import open_gguf
from kimik3.checkpoint.gguf_write import save_gguf
from kimik3.checkpoint.inventory import without_vision
from kimik3.cli import main
from kimik3.model import K3ForConditionalGeneration
from kimik3.ops.mxfp4 import decode
from kimik3.presets import DEMO_MODEL, PACKAGE_DIR
from kimik3.quant import pack_experts
from kimik3.tokenizer import CHAT_TEMPLATE, Tokenizer
from tests.helpers import randomize
from tests.lora.conftest import randomize_adapter

BYTES = PACKAGE_DIR / "configs" / "train" / "bytes.tiktoken"


def differing(a, b) -> list[str]:
    """State-dict entries of two models that are not equal in dtype and every bit."""
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    return [k for k in sa if sa[k].dtype != sb[k].dtype or not torch.equal(sa[k].view(-1).view(torch.uint8),
                                                                            sb[k].view(-1).view(torch.uint8))]


@pytest.fixture(scope="module")
def demo_gguf(tmp_path_factory):
    out = tmp_path_factory.mktemp("gguf") / "demo.gguf"
    save_gguf(kimik3.load(DEMO_MODEL, keep_experts_packed=True, quiet=True), out, quiet=True)
    return out


def test_mxfp4_blocks_are_the_same_numbers():
    """ggml's blocks hold compressed-tensors' codes and scales: the gguf package's own MXFP4 decoder gives
    kimik3's decode of the original bytes, and the repack is undone byte for byte."""
    packed = torch.randint(0, 256, (3, 5, 64), dtype=torch.uint8)
    scale = torch.randint(110, 135, (3, 5, 4), dtype=torch.uint8)
    blocks = to_ggml(packed, scale)
    assert blocks.shape == (3, 5, 4 * 17)
    theirs = gguf.quants.dequantize(blocks.numpy(), gguf.GGMLQuantizationType.MXFP4)
    np.testing.assert_array_equal(theirs, decode(packed, scale, torch.float32).numpy())
    back = from_ggml(blocks)
    assert torch.equal(back[0], packed) and torch.equal(back[1], scale)


def test_demo_export_import_is_the_identity(demo_gguf):
    """Every tensor, experts byte for byte (the dense-expert load is checked on the tiny preset below)."""
    original = kimik3.load(DEMO_MODEL, keep_experts_packed=True, quiet=True)
    assert differing(original, kimik3.load(demo_gguf, keep_experts_packed=True, quiet=True)) == []


def test_demo_gguf_metadata(demo_gguf):
    src = open_gguf(demo_gguf)
    assert src.kv["general.architecture"] == "kimi-k3"
    assert src.kv["general.file_type"] == gguf.LlamaFileType.MOSTLY_MXFP4_MOE
    assert src.kv["tokenizer.chat_template"] == CHAT_TEMPLATE
    assert src.tensors["blk.1.ffn_gate_exps.weight"].type == gguf.GGMLQuantizationType.MXFP4
    assert src.config() == kimik3.K3Config.from_file(DEMO_MODEL / "config.json") and src.config().vision is None
    demo_tok = Tokenizer.from_file(DEMO_MODEL)
    assert src.tokenizer()._enc._mergeable_ranks == demo_tok._enc._mergeable_ranks
    assert src.generation_config() == json.loads((DEMO_MODEL / "generation_config.json").read_text())
    assert src.kv["general.sampling.temp"] == pytest.approx(0.8)


def test_convert_both_ways_and_generate_from_gguf(demo_gguf, tmp_path, capsys):
    assert main(["convert", str(DEMO_MODEL), str(tmp_path / "demo.gguf"), "--quiet"]) == 0
    assert (tmp_path / "demo.gguf").read_bytes() == demo_gguf.read_bytes()  # the CLI writes what save_gguf writes
    assert main(["convert", str(demo_gguf), str(tmp_path / "back"), "--quiet"]) == 0
    back = tmp_path / "back"
    assert {"tiktoken.model", "tokenizer_config.json", "tokenization_kimi.py", "generation_config.json"} <= {
        p.name for p in back.iterdir()}
    assert (back / "tiktoken.model").read_bytes() == (DEMO_MODEL / "tiktoken.model").read_bytes()
    assert json.loads((back / "config.json").read_text()) == json.loads((DEMO_MODEL / "config.json").read_text())
    assert differing(kimik3.load(DEMO_MODEL, keep_experts_packed=True, quiet=True),
                     kimik3.load(back, keep_experts_packed=True, quiet=True)) == []
    assert main(["convert", str(DEMO_MODEL), str(tmp_path / "x.bin"), "--to", "gguf"]) == 2


def test_generate_from_gguf_writes_what_the_folder_writes(demo_gguf, capsys):
    args = ["--prompt", "ROMEO:", "--max-new-tokens", "8", "--temperature", "0", "--no-stream"]
    assert main(["generate", "--model", str(demo_gguf), *args]) == 0
    from_gguf = capsys.readouterr().out
    assert main(["generate", "--model", str(DEMO_MODEL), *args]) == 0
    assert from_gguf == capsys.readouterr().out and from_gguf.startswith("ROMEO:")


def test_lora_merged_demo_round_trips(tmp_path, capsys):
    model = lora.apply(kimik3.load(DEMO_MODEL, dtype=torch.float32, keep_experts_packed=True, quiet=True),
                       lora.LoraConfig(rank=4, targets=["*self_attn*", "*experts*"]))
    randomize_adapter(model, seed=3)
    adapter = lora.save(model, tmp_path / "adapter")
    assert main(["lora", "merge", str(DEMO_MODEL), str(adapter), str(tmp_path / "m.gguf"), "--quiet"]) == 0
    assert main(["lora", "merge", str(DEMO_MODEL), str(adapter), str(tmp_path / "m"), "--quiet"]) == 0
    assert differing(kimik3.load(tmp_path / "m", quiet=True), kimik3.load(tmp_path / "m.gguf", quiet=True)) == []
    assert open_gguf(tmp_path / "m.gguf").tensors["blk.1.ffn_up_exps.weight"].type == gguf.GGMLQuantizationType.BF16


def test_tiny_preset_round_trips_with_its_byte_vocabulary(tiny_config, tmp_path):
    """The tiny preset has 300 rows over a 512-id byte vocabulary: the GGUF lists one token per row."""
    model = pack_experts(randomize(K3ForConditionalGeneration(without_vision(tiny_config)), seed=5))
    folder = kimik3.save(model, tmp_path / "tiny", source=BYTES, quiet=True)
    save_gguf(kimik3.load(folder, keep_experts_packed=True, quiet=True), tmp_path / "tiny.gguf", quiet=True)
    src = open_gguf(tmp_path / "tiny.gguf")
    assert len(src.kv["tokenizer.ggml.tokens"]) == 300 and src.kv["tokenizer.ggml.tokens"][257] == "[EOS]"
    assert src.tokenizer()._enc._mergeable_ranks == Tokenizer.from_file(BYTES)._enc._mergeable_ranks
    for packed in (True, False):
        assert differing(kimik3.load(folder, keep_experts_packed=packed, quiet=True),
                         kimik3.load(tmp_path / "tiny.gguf", keep_experts_packed=packed, quiet=True)) == []


def test_split_files_are_named_as_gguf_split_and_load_from_any_part(demo_gguf, tmp_path):
    model = kimik3.load(demo_gguf, keep_experts_packed=True, quiet=True)
    files = save_gguf(model, tmp_path / "s.gguf", max_shard_size="8MB", source=demo_gguf, quiet=True)
    assert [f.name for f in files] == [f"s-{i:05d}-of-00004.gguf" for i in range(1, 5)]
    assert all(f.stat().st_size <= 8_000_000 + 5_000_000 for f in files[1:])  # one tensor may exceed the size
    for part in (files[0], files[2]):
        assert differing(model, kimik3.load(part, keep_experts_packed=True, quiet=True)) == []
    files[3].unlink()
    with pytest.raises(FileNotFoundError, match="missing s-00004-of-00004.gguf"):
        kimik3.load(files[0])


def test_export_is_atomic(demo_gguf, tmp_path, monkeypatch):
    """A failure (here a KeyboardInterrupt) after some tensors were written leaves the destination as it was and
    no partial files behind."""
    out = tmp_path / "out.gguf"
    out.write_bytes(b"previous")
    model = kimik3.load(demo_gguf, keep_experts_packed=True, quiet=True)
    real, calls = gguf_write._produce, []

    def interrupted(*args):
        calls.append(1)
        if len(calls) == 20:
            raise KeyboardInterrupt
        return real(*args)

    monkeypatch.setattr(gguf_write, "_produce", interrupted)
    with pytest.raises(KeyboardInterrupt):
        save_gguf(model, out, source=demo_gguf, quiet=True)
    assert out.read_bytes() == b"previous" and [p.name for p in tmp_path.iterdir()] == ["out.gguf"]


def test_foreign_and_broken_files_are_refused_in_one_line(demo_gguf, tmp_path):
    w = gguf.GGUFWriter(tmp_path / "llama.gguf", "llama")
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(demo_gguf.read_bytes()[:20_000_000])
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf at all" * 10)
    for name, match in (("llama.gguf", "architecture 'llama'; kimik3 reads Kimi K3"),
                        ("cut.gguf", "not a readable GGUF file"), ("junk.gguf", "not a readable GGUF file")):
        with pytest.raises(ValueError, match=match) as e:
            kimik3.load(tmp_path / name)
        assert "\n" not in str(e.value)
        assert main(["convert", str(tmp_path / name), str(tmp_path / "o")]) == 2


def rewrite(src_path, dst_path, *, drop_prefix: str | None = None, quantize: frozenset = frozenset()):
    """A copy of a GGUF, without the metadata keys under `drop_prefix` and with the tensors named in `quantize`
    requantized to Q8_0 (what llama.cpp's quantize tool makes of a file)."""
    r = gguf.GGUFReader(src_path)
    w = gguf.GGUFWriter(dst_path, r.fields["general.architecture"].contents())
    for key, field in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or (drop_prefix and key.startswith(drop_prefix)):
            continue
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, field.contents(), field.types[0], sub_type=sub)
    for t in r.tensors:
        if t.name in quantize:
            values = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)
            w.add_tensor(t.name, gguf.quants.quantize(values, gguf.GGMLQuantizationType.Q8_0),
                         raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            data = np.asarray(t.data)  # bytes for block types and BF16: the writer derives the element shape
            w.add_tensor(t.name, data, raw_dtype=t.tensor_type if data.dtype == np.uint8 else None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst_path


def test_other_ggml_types_are_dequantized_with_a_note(demo_gguf, tmp_path, capsys):
    q8 = rewrite(demo_gguf, tmp_path / "q8.gguf", quantize=frozenset({"blk.0.attn_q.weight", "output.weight"}))
    model = kimik3.load(q8, dtype=torch.float32)
    note = capsys.readouterr().err
    assert note.count("\n") == 1 and "dequantized" in note and "Q8_0" in note and "GiB" in note
    exact = kimik3.load(demo_gguf, dtype=torch.float32, quiet=True)
    name = "language_model.model.layers.0.self_attn.q_proj.weight"
    got, want = model.state_dict()[name], exact.state_dict()[name]
    assert 0 < (got - want).norm() / want.norm() < 1e-2  # Q8_0: close, not exact
    assert differing(kimik3.load(q8, quiet=True, keep_experts_packed=True),
                     kimik3.load(demo_gguf, quiet=True, keep_experts_packed=True)) == [
        name, "language_model.lm_head.weight"]


def test_a_file_without_kimik3_keys_loads_with_the_same_function(demo_gguf, tmp_path):
    """As llama.cpp's converter writes it: the config comes from llama.cpp's keys, A_log from -exp(A_log), and the
    AttnRes weights from their fused product (norm = product, projection = ones): equal where it matters."""
    plain = rewrite(demo_gguf, tmp_path / "plain.gguf", drop_prefix="kimik3.")
    src = open_gguf(plain)
    assert not any(k.startswith("kimik3.") for k in src.kv)
    assert src.config() == open_gguf(demo_gguf).config()
    original = kimik3.load(DEMO_MODEL, dtype=torch.float32, keep_experts_packed=True, quiet=True)
    loaded = kimik3.load(plain, dtype=torch.float32, keep_experts_packed=True, quiet=True)
    folded = {n for n in differing(original, loaded)}
    assert folded and all(n.endswith(("A_log", "_res_norm.weight", "_res_proj.weight")) for n in folded)
    so, sl = original.state_dict(), loaded.state_dict()
    for n in folded:
        if n.endswith("A_log"):
            heads = original.config.text.kda.num_heads
            torch.testing.assert_close(sl[n][:heads].exp(), so[n][:heads].exp(), rtol=1e-6, atol=0)
        elif n.endswith("_res_norm.weight"):
            proj = n.replace("_res_norm", "_res_proj")
            assert torch.equal(sl[n] * sl[proj].reshape(-1), so[n] * so[proj].reshape(-1))
    ids = torch.tensor([Tokenizer.from_file(DEMO_MODEL).encode("ROMEO: But soft, what light")])
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids), original(ids), rtol=1e-5, atol=1e-5)


def test_gguf_destination_must_be_a_gguf_file(tmp_path):
    model = kimik3.load(DEMO_MODEL, keep_experts_packed=True, quiet=True)
    with pytest.raises(ValueError, match="ending in .gguf"):
        save_gguf(model, tmp_path / "out")
    shutil.copy(BYTES, tmp_path / "bytes.tiktoken")
    with pytest.raises(ValueError, match="tokenizer"):
        save_gguf(model, tmp_path / "o.gguf", source=tmp_path / "nothing-here")


def test_every_model_flag_reads_gguf(demo_gguf, tmp_path, capsys, monkeypatch):
    """chat, generate --input, serve's checks and defaults, and eval's harness take a .gguf as they take a folder."""
    import builtins

    from kimik3.hf.harness import KimiK3LM
    from kimik3.inference import SamplingParams
    from kimik3.inference.sampling import generation_defaults

    lines = iter(["hello", "/quit"])
    monkeypatch.setattr(builtins, "input", lambda prompt="": next(lines))
    assert main(["chat", "--model", str(demo_gguf), "--max-new-tokens", "3", "--temperature", "0"]) == 0
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text(json.dumps({"prompt": "ROMEO:"}) + "\n")
    assert main(["generate", "--model", str(demo_gguf), "--input", str(src), "--output", str(dst),
                 "--max-new-tokens", "4", "--temperature", "0"]) == 0
    assert len(json.loads(dst.read_text())["choices"][0]["token_ids"]) == 4
    assert generation_defaults(demo_gguf) == SamplingParams(temperature=0.8, top_p=0.95)
    harness = KimiK3LM(pretrained=str(demo_gguf), dtype="float32")
    assert harness.tok.encode("ROMEO:") == Tokenizer.from_file(DEMO_MODEL).encode("ROMEO:")


def test_gguf_commands_never_write_over_or_into_their_inputs(demo_gguf, tmp_path, capsys):
    folder = tmp_path / "ckpt"
    shutil.copytree(DEMO_MODEL, folder)
    parts = save_gguf(kimik3.load(demo_gguf, keep_experts_packed=True, quiet=True), tmp_path / "s.gguf",
                      max_shard_size="8MB", source=demo_gguf, quiet=True)
    before = {p: p.stat().st_mtime_ns for p in parts}
    for args in (["convert", str(folder), str(folder / "model.gguf")], ["convert", str(parts[0]), str(parts[2])],
                 ["lora", "merge", str(folder), str(tmp_path / "adapter"), str(folder / "m.gguf")]):
        assert main(args) == 2
        err = capsys.readouterr().err
        assert "writing there would overwrite what this command reads" in err and err.count("\n") == 1, err
    assert not list(folder.glob("*.gguf")) and before == {p: p.stat().st_mtime_ns for p in parts}
