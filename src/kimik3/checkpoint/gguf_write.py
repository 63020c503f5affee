"""Write a model's text part as a GGUF file in llama.cpp's `kimi-k3` layout, with the `gguf` package.

    OUT.gguf                         one file, or with max_shard_size the splits llama.cpp's gguf-split names:
    OUT-00001-of-00003.gguf ...      OUT-0000i-of-0000n.gguf (split.* keys in each; metadata in the first)

Tensors follow `gguf_keys.plan` (names, folds and dtypes of llama.cpp's converter); MXFP4 routed experts are
repacked byte for byte (`gguf_mxfp4`), never decoded. Metadata: llama.cpp's hyperparameters, the vocabulary
(`gguf_vocab`), the Jinja chat template, sampling defaults from generation_config.json, and kimik3's own keys
(`kimik3.config_json`, `kimik3.unfolded.*`) that make import exact. One tensor is built at a time, just before
it is written; the files are written in a hidden sibling folder and renamed into place when complete, so a
failure or Ctrl-C leaves no half-written GGUF at the destination.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

from kimik3.checkpoint.folder import LOADED_FROM, fsync_dir
from kimik3.checkpoint.gguf_keys import (
    ARCH,
    CONFIG_KEY,
    F32_NAMES,
    GENERATION_KEY,
    UNFOLDED,
    Entry,
    gguf,
    metadata,
    plan,
)
from kimik3.checkpoint.gguf_mxfp4 import BLOCK_BYTES, to_ggml
from kimik3.checkpoint.gguf_vocab import PRE, vocab_metadata
from kimik3.checkpoint.inventory import parse_dtype, stored_dtype, without_vision
from kimik3.checkpoint.keys import checkpoint_prefix, checkpoint_specs, is_vision_key
from kimik3.checkpoint.progress import progress_bar, wanted
from kimik3.checkpoint.source import is_gguf, read_generation_config, read_tokenizer
from kimik3.checkpoint.writer import TOKENIZER, config_json, config_of, parse_size
from kimik3.model import K3ForConditionalGeneration
from kimik3.ops.mxfp4 import encode
from kimik3.tokenizer import CHAT_TEMPLATE, SPECIAL_OFFSETS, Tokenizer

_GGML = {torch.float32: gguf.GGMLQuantizationType.F32, torch.float16: gguf.GGMLQuantizationType.F16,
         torch.bfloat16: gguf.GGMLQuantizationType.BF16}
_FILE_TYPE = {torch.float32: gguf.LlamaFileType.ALL_F32, torch.float16: gguf.LlamaFileType.MOSTLY_F16,
              torch.bfloat16: gguf.LlamaFileType.MOSTLY_BF16}
_SAMPLING = {"temperature": "general.sampling.temp", "top_p": "general.sampling.top_p",
             "top_k": "general.sampling.top_k"}


def save_gguf(model: nn.Module, path: str | Path, *, experts: str | None = None, dtype: torch.dtype | str | None = None,
              max_shard_size: int | str | None = None, config=None, source: str | Path | None = None,
              quiet: bool = False) -> list[Path]:
    """Write `model`'s text model as GGUF at `path` (a `.gguf` file name); returns the files written.

    Args:
        experts: "mxfp4" (packed experts copied, dense ones encoded: lossy), "bf16" (dense in `dtype`), or None:
            as the model holds them (packed -> MXFP4 blocks, dense -> dense).
        dtype: stored dtype outside the F32 tensors; None = the config's.
        max_shard_size: split into gguf-split files of at most this many bytes (one tensor may exceed it).
        config, source, quiet: as `kimik3.save`; the tokenizer and sampling defaults come from `source` (a
            checkpoint folder, a GGUF, or a rank file; default: where the model was loaded from).

    Raises:
        ValueError: no tokenizer to embed, a LoRA adapter on the model, a bad size, or a destination that is a
            folder.
    """
    path = Path(path)
    if path.suffix != ".gguf" or path.is_dir():
        raise ValueError(f"{path}: a GGUF destination is a file name ending in .gguf")
    if experts not in (None, "mxfp4", "bf16"):
        raise ValueError(f"experts must be 'mxfp4', 'bf16' or None (as the model holds them), got {experts!r}")
    adapter = next((n for n, _ in model.named_parameters() if ".lora_" in n or "_lora_" in n), None)
    if adapter is not None:
        raise ValueError(f"the model carries a LoRA adapter ({adapter}): merge it first (kimik3 lora merge ... "
                         "OUT.gguf writes the merged model as GGUF)")
    limit = parse_size(max_shard_size) if max_shard_size is not None else 0
    cfg = config_of(model, config)
    dtype = parse_dtype(dtype) or stored_dtype(cfg)
    tok, gen = _tokenizer_and_sampling(source if source is not None else getattr(model, LOADED_FROM, None))
    prefix = checkpoint_prefix(model)
    state = {prefix + n: t for n, t in model.state_dict().items() if not is_vision_key(prefix + n)}
    entries = plan(list(state), cfg)
    packed = any(e.kind == "experts" and len(e.sources) == 2 for e in entries)
    as_mxfp4 = experts == "mxfp4" or (experts is None and packed)
    stored = _stored_dtypes(cfg, dtype)

    w = gguf.GGUFWriter(None, ARCH, split_max_size=limit)
    _add_metadata(w, cfg, dtype, as_mxfp4, tok, gen, path.stem)
    w.add_string(CONFIG_KEY, json.dumps(config_json(cfg, "mxfp4" if as_mxfp4 else "bf16", dtype, False)))
    for e in entries:
        if e.kind in ("a", "res"):
            for name in e.sources:
                w.add_array(UNFOLDED + name, state[name].detach().float().cpu().reshape(-1).tolist())
    for e in entries:
        shape, ggml_type = _shape_and_type(e, state, stored, dtype, as_mxfp4, cfg)
        nbytes = _nbytes(shape, ggml_type)
        if ggml_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            w.add_tensor_info(e.gguf, shape, np.dtype(np.float32 if ggml_type == 0 else np.float16), nbytes)
        else:  # BF16 and MXFP4 travel as bytes: the writer derives the element shape
            w.add_tensor_info(e.gguf, _byte_shape(shape, ggml_type), np.dtype(np.uint8), nbytes, raw_dtype=ggml_type)

    def write(tmp: Path) -> None:
        w.write_header_to_file(tmp / path.name)
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        total = sum(_nbytes(*_shape_and_type(e, state, stored, dtype, as_mxfp4, cfg)) for e in entries)
        with progress_bar("saving gguf", total, len(entries), wanted(quiet)) as advance:
            for e in entries:
                data = _produce(e, state, stored, dtype, as_mxfp4, cfg)
                w.write_tensor_data(data)
                advance(data.nbytes)
        w.close()

    return publish_files(path, write)


def _tokenizer_and_sampling(source) -> tuple[Tokenizer, dict]:
    """The tokenizer and generation_config of `source`: a checkpoint folder, a GGUF, or a tokenizer rank file."""
    missing = ValueError(f"GGUF export needs the model's tokenizer: {source} has no {TOKENIZER} (pass source= a "
                         "checkpoint folder, GGUF or rank file; a model from kimik3.load uses where it came from)")
    if source is None:
        raise missing
    if Path(source).is_file() and not is_gguf(source):
        return Tokenizer.from_file(source), {}
    try:
        return read_tokenizer(source), read_generation_config(source)[1]
    except FileNotFoundError:
        raise missing from None


def _stored_dtypes(cfg, dtype: torch.dtype) -> dict[str, torch.dtype]:
    """The dtype each tensor is stored in at `dtype` (the fp32 islands stay fp32), from a meta build."""
    with torch.device("meta"):
        twin = K3ForConditionalGeneration(without_vision(cfg), dtype)
    return {s.name: s.dtype for s in checkpoint_specs(twin, "bf16")}


def _shape_and_type(e: Entry, state: dict[str, Tensor], stored: dict[str, torch.dtype], dtype: torch.dtype,
                    as_mxfp4: bool, cfg) -> tuple[tuple[int, ...], gguf.GGMLQuantizationType]:
    """The GGUF tensor's element shape (numpy order) and ggml type."""
    src = state[e.sources[0]]
    if e.kind == "experts":
        n_in = src.shape[2] * (2 if len(e.sources) == 2 else 1)
        return (src.shape[0], src.shape[1], n_in), gguf.GGMLQuantizationType.MXFP4 if as_mxfp4 else _GGML[dtype]
    if e.kind == "conv":
        D, _, K = src.shape
        return (1, D, 1, K), gguf.GGMLQuantizationType.F32
    if e.kind == "a":
        return (cfg.text.kda.num_heads,), gguf.GGMLQuantizationType.F32
    if e.kind == "res":
        return (src.shape[0],), gguf.GGMLQuantizationType.F32
    ggml_type = gguf.GGMLQuantizationType.F32 if F32_NAMES.search(e.gguf) else _GGML[stored[e.sources[0]]]
    if e.kind in ("k_b", "v_b"):
        m = cfg.text.mla
        H, C = m.num_heads, m.kv_lora_rank
        return ((H, C, m.qk_nope_head_dim) if e.kind == "k_b" else (H, m.v_head_dim, C)), ggml_type
    return tuple(src.shape), ggml_type


def _nbytes(shape: tuple[int, ...], ggml_type) -> int:
    block, size = gguf.GGML_QUANT_SIZES[ggml_type]
    return int(np.prod(shape)) // block * size


def _byte_shape(shape: tuple[int, ...], ggml_type) -> tuple[int, ...]:
    block, size = gguf.GGML_QUANT_SIZES[ggml_type]
    return (*shape[:-1], shape[-1] // block * size)


@torch.no_grad()
def _produce(e: Entry, state: dict[str, Tensor], stored: dict[str, torch.dtype], dtype: torch.dtype,
             as_mxfp4: bool, cfg) -> np.ndarray:
    """The GGUF tensor's data: a numpy array of its ggml type (bytes for BF16 and MXFP4)."""
    shape, ggml_type = _shape_and_type(e, state, stored, dtype, as_mxfp4, cfg)
    src = state[e.sources[0]].detach().cpu()
    if e.kind == "experts":
        if len(e.sources) == 2 and as_mxfp4:
            t = _blocks(src, state[e.sources[1]].detach().cpu())
        elif as_mxfp4:  # dense experts encoded on the way out (lossy, as `save(experts="mxfp4")`)
            t = to_ggml(*encode(src))
        else:
            from kimik3.ops.mxfp4 import decode

            t = decode(src, state[e.sources[1]].cpu(), dtype) if len(e.sources) == 2 else src
        return _as_numpy(t, ggml_type)
    if e.kind == "a":
        t = -torch.exp(src.float()[: cfg.text.kda.num_heads])
    elif e.kind == "res":
        t = src.float() * state[e.sources[1]].detach().cpu().float().reshape(-1)
    elif e.kind in ("k_b", "v_b"):
        m = cfg.text.mla
        kv_b = src.reshape(m.num_heads, m.qk_nope_head_dim + m.v_head_dim, -1)
        t = kv_b[:, : m.qk_nope_head_dim].transpose(1, 2) if e.kind == "k_b" else kv_b[:, m.qk_nope_head_dim:]
    else:
        t = src
    return _as_numpy(t.reshape(shape), ggml_type)


def _blocks(packed: Tensor, scale: Tensor, chunk: int = 32) -> Tensor:
    """`to_ggml` over the stacked experts a few at a time: K3's w1 of one layer is 4.9 GB packed, and the repack's
    intermediates would hold several times that at once."""
    out = torch.empty((*packed.shape[:-1], scale.shape[-1] * BLOCK_BYTES), dtype=torch.uint8)
    for e in range(0, packed.shape[0], chunk):
        out[e:e + chunk] = to_ggml(packed[e:e + chunk], scale[e:e + chunk])
    return out


def _as_numpy(t: Tensor, ggml_type) -> np.ndarray:
    if ggml_type == gguf.GGMLQuantizationType.MXFP4:
        return t.contiguous().numpy()
    if ggml_type == gguf.GGMLQuantizationType.BF16:
        return t.to(torch.bfloat16).contiguous().view(torch.uint8).numpy()
    return t.to(torch.float32 if ggml_type == gguf.GGMLQuantizationType.F32 else torch.float16).contiguous().numpy()


def _add_metadata(w: gguf.GGUFWriter, cfg, dtype: torch.dtype, as_mxfp4: bool, tok: Tokenizer, gen: dict,
                  name: str) -> None:
    w.add_type(gguf.GGUFType.MODEL)
    w.add_name(name)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_MXFP4_MOE if as_mxfp4 else _FILE_TYPE[dtype])
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for key, value in metadata(cfg).items():
        if isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        else:
            w.add_key_value(key, value, gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.INT32)
    vocab = vocab_metadata(tok, cfg.text.vocab_size)
    size = cfg.text.vocab_size
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(PRE)
    w.add_token_list(vocab["tokens"])
    w.add_token_types(vocab["token_type"])
    w.add_token_merges(vocab["merges"])
    # the model's end of text (the release: <|end_of_msg|>; the demo, trained on documents: [EOS]), and the
    # end of a chat turn, which llama.cpp also stops on; ids past a small model's rows are left out
    ids = {w.add_bos_token_id: tok.bos_id,
           w.add_eos_token_id: cfg.eos_token_id if cfg.eos_token_id is not None else tok.eos_id,
           w.add_eot_token_id: tok.eos_id,
           w.add_pad_token_id: cfg.pad_token_id if cfg.pad_token_id is not None else tok.pad_id,
           w.add_unk_token_id: tok.num_ranks + SPECIAL_OFFSETS["[UNK]"]}
    for add, token_id in ids.items():
        if token_id < size:
            add(token_id)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)
    if gen:
        w.add_string(GENERATION_KEY, json.dumps(gen))
        for key, gguf_key in _SAMPLING.items():
            if isinstance(gen.get(key), (int, float)) and not isinstance(gen.get(key), bool):
                (w.add_int32 if key == "top_k" else w.add_float32)(gguf_key, gen[key])


def publish_files(path: Path, write) -> list[Path]:
    """`write(tmp)` fills a hidden sibling folder with the GGUF file(s); they are fsynced and renamed next to `path`
    when all are complete. On any error (Ctrl-C included) the folder is removed and nothing at `path` changes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.partial-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        write(tmp)
        files = sorted(tmp.iterdir())
        for f in files:
            with open(f, "rb+") as fh:
                os.fsync(fh.fileno())
        for f in files:
            os.replace(f, path.parent / f.name)
        fsync_dir(path.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    tmp.rmdir()
    return [path.parent / f.name for f in files]
