"""Read a `kimi-k3` GGUF (one file or gguf-split parts) into a kimik3 model, its config and its tokenizer.

    open_gguf(path)      -> GGUFModel: the parts, metadata and tensors (memory-mapped by the `gguf` package)
    .config()            kimik3's own `kimik3.config_json` when present, else rebuilt from llama.cpp's keys
    .tokenizer()         K3's Tokenizer from tokenizer.ggml.tokens (ranks, then 256 specials by name)
    .generation_config() kimik3's saved generation_config.json, else llama.cpp's general.sampling.* keys
    load_gguf(path, ...) the model, filled tensor by tensor through `gguf_keys.plan` in reverse

MXFP4 routed experts come back to compressed-tensors bytes exactly (`gguf_mxfp4`). Other ggml types (Q8_0, Q4_K,
IQ* ...) are dequantized by the `gguf` package on load, with one line on stderr naming them and the memory the
model then takes. Folds llama.cpp's layout makes (`gguf_keys`) are undone exactly from `kimik3.unfolded.*`
when the file has them; otherwise A_log = log(-ssm_a) and the AttnRes norm weight takes the fused score vector
with a projection of ones (the same function: the score only uses their product).
"""

from __future__ import annotations

import json
import os
import re
import sys
from dataclasses import dataclass
from functools import cached_property, lru_cache
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from kimik3.checkpoint.folder import GENERATION_CONFIG, LOADED_FROM
from kimik3.checkpoint.gguf_keys import ARCH, CONFIG_KEY, GENERATION_KEY, UNFOLDED, Entry, gguf, hf_config, plan
from kimik3.checkpoint.gguf_mxfp4 import from_ggml
from kimik3.checkpoint.gguf_vocab import ranks_from_tokens, write_ranks
from kimik3.checkpoint.inventory import parse_dtype, stored_dtype
from kimik3.checkpoint.keys import RELEASED_QUANTIZATION, checkpoint_prefix
from kimik3.config import K3Config
from kimik3.model import K3ForConditionalGeneration
from kimik3.model.init import allocate
from kimik3.ops.mxfp4 import decode, encode
from kimik3.placement import fill_slots, tier_by_budget
from kimik3.quant import pack_experts
from kimik3.tokenizer import Tokenizer

_SPLIT = re.compile(r"^(?P<stem>.+)-(?P<i>\d{5})-of-(?P<n>\d{5})\.gguf$")
_T = gguf.GGMLQuantizationType
_EXACT = {_T.F32: torch.float32, _T.F16: torch.float16, _T.BF16: torch.bfloat16}
_SAMPLING = {"general.sampling.temp": "temperature", "general.sampling.top_p": "top_p",
             "general.sampling.top_k": "top_k"}


def gguf_parts(path: str | Path) -> list[Path]:
    """The files of a GGUF: `path` itself, or every gguf-split part when `path` names one of them."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {path} does not exist")
    m = _SPLIT.match(path.name)
    if m is None:
        return [path]
    n = int(m["n"])
    parts = [path.with_name(f"{m['stem']}-{i:05d}-of-{n:05d}.gguf") for i in range(1, n + 1)]
    missing = [p.name for p in parts if not p.is_file()]
    if missing:
        raise FileNotFoundError(f"{path}: split GGUF of {n} parts, missing {', '.join(missing[:3])}")
    return parts


@dataclass
class _Tensor:
    name: str
    type: gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # numpy order (ggml's reversed)
    data: np.ndarray  # as the gguf reader maps it (bytes for block types and BF16)


class GGUFModel:
    """A K3 GGUF on disk: its metadata (`kv`) and tensors (`tensors`), read once, data memory-mapped."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.parts = gguf_parts(path)
        self.kv: dict[str, object] = {}
        self.tensors: dict[str, _Tensor] = {}
        for part in self.parts:
            try:
                reader = gguf.GGUFReader(part)
            except Exception as e:  # the reader raises ValueError, struct.error, IndexError ... on broken bytes
                raise ValueError(f"{part}: not a readable GGUF file ({type(e).__name__}: {e})") from None
            for key, field in reader.fields.items():
                if not key.startswith("GGUF.") and key not in self.kv:
                    self.kv[key] = field.contents()
            for t in reader.tensors:
                self.tensors[t.name] = _Tensor(t.name, _T(t.tensor_type), tuple(int(d) for d in reversed(t.shape)),
                                               t.data)
        arch = self.kv.get("general.architecture")
        if arch != ARCH:
            raise ValueError(f"{self.path}: a GGUF of architecture {arch!r}; kimik3 reads Kimi K3 ({ARCH!r}) only")

    @cached_property
    def hf(self) -> dict:
        """config.json (text only)."""
        if CONFIG_KEY in self.kv:
            return json.loads(self.kv[CONFIG_KEY])
        tok = self.tokenizer()
        try:
            hf = hf_config(self.kv, tok.bos_id, self.kv.get("tokenizer.ggml.eos_token_id", tok.eos_id),
                           self.kv.get("tokenizer.ggml.padding_token_id", tok.pad_id),
                           tok.encode_special("<|media_pad|>"))
        except KeyError as e:
            raise ValueError(f"{self.path}: metadata key {e} is missing (a kimi-k3 GGUF carries llama.cpp's "
                             "hyperparameters)") from None
        embd = self.tensors.get("token_embd.weight")
        dtype = {_T.F32: "float32", _T.F16: "float16"}.get(embd.type, "bfloat16") if embd else "bfloat16"
        hf["dtype"] = hf["text_config"]["dtype"] = dtype
        if any(t.type == _T.MXFP4 for n, t in self.tensors.items() if n.endswith("_exps.weight")):
            hf["text_config"]["quantization_config"] = json.loads(json.dumps(RELEASED_QUANTIZATION))
        return hf

    def config(self) -> K3Config:
        try:
            return K3Config.from_hf(self.hf)
        except ValueError as e:
            raise ValueError(f"{self.path}: {e}") from None

    def tokenizer(self) -> Tokenizer:
        if self.kv.get("tokenizer.ggml.model") != "gpt2" or "tokenizer.ggml.tokens" not in self.kv:
            raise ValueError(f"{self.path}: no BPE vocabulary (tokenizer.ggml.model 'gpt2' with tokens)")
        return Tokenizer(ranks_from_tokens(list(self.kv["tokenizer.ggml.tokens"]),
                                           list(self.kv["tokenizer.ggml.token_type"]), str(self.path)))

    def generation_config(self) -> dict:
        if GENERATION_KEY in self.kv:
            return json.loads(self.kv[GENERATION_KEY])
        gen = {ours: self.kv[key] for key, ours in _SAMPLING.items() if key in self.kv}
        cfg = self.config()
        if cfg.eos_token_id is not None:
            gen["eos_token_id"] = cfg.eos_token_id
        return gen

    def tensor(self, name: str, lossy: dict[str, int]) -> Tensor:
        """A tensor's values: F32/F16/BF16 exactly, MXFP4 as its bytes, anything else dequantized to float32
        (counted in `lossy`: what was not exact -> elements)."""
        t = self.tensors[name]
        if t.type == _T.MXFP4:
            return torch.from_numpy(np.array(t.data).reshape(*t.shape[:-1], -1))
        if t.type in _EXACT:
            raw = torch.from_numpy(np.array(t.data)).reshape(-1)  # a copy: the map is read-only
            return raw.view(torch.uint8).view(_EXACT[t.type]).reshape(t.shape)
        what = f"{t.type.name} weights dequantized"
        lossy[what] = lossy.get(what, 0) + int(np.prod(t.shape))
        return torch.from_numpy(gguf.quants.dequantize(np.asarray(t.data), t.type).reshape(t.shape))


def open_gguf(path: str | Path) -> GGUFModel:
    """The GGUF at `path`, read once per file version: a command asks for its config, tokenizer, sampling
    defaults and tensors in turn, and parsing the metadata of a 163k-token vocabulary takes seconds."""
    parts = gguf_parts(path)
    return _open(Path(path), tuple((p.resolve(), p.stat().st_mtime_ns, p.stat().st_size) for p in parts))


@lru_cache(maxsize=2)
def _open(path: Path, versions: tuple) -> GGUFModel:
    return GGUFModel(path)


def write_companions(path: str | Path, folder: Path) -> None:
    """A GGUF's tokenizer and sampling defaults as a checkpoint folder keeps them: tiktoken.model and
    generation_config.json (fsynced)."""
    src = open_gguf(path)
    write_ranks(src.tokenizer()._enc._mergeable_ranks, folder / "tiktoken.model")
    (folder / GENERATION_CONFIG).write_text(json.dumps(src.generation_config(), indent=2) + "\n")
    for name in ("tiktoken.model", GENERATION_CONFIG):
        with open(folder / name, "rb+") as f:
            os.fsync(f.fileno())


def load_gguf(path: str | Path, *, dtype: torch.dtype | str | None = None, device: str | torch.device = "cpu",
              keep_experts_packed: bool = False, quiet: bool = False, cpu_offload_gb: float | str | None = None,
              expert_misses: str = "auto", expert_trace: str | Path | None = None,
              offload_reserve_bytes: int | None = None) -> K3ForConditionalGeneration:
    """The text model of a kimi-k3 GGUF (see `kimik3.load`, which calls this for a `.gguf` path, and its expert
    tiering arguments).

    Raises:
        FileNotFoundError: a missing file or split part.
        ValueError: not a GGUF, another architecture, or tensors missing / unexpected / of the wrong shape.
    """
    src = open_gguf(path)
    cfg = src.config()
    dtype = parse_dtype(dtype) or stored_dtype(cfg)
    offload = cpu_offload_gb not in (None, 0)
    with torch.device("meta"):
        model = K3ForConditionalGeneration(cfg, dtype)
        if keep_experts_packed or offload:
            pack_experts(model)
    prefix = checkpoint_prefix(model)
    state_names = [prefix + n for n in model.state_dict(keep_vars=True)]
    entries = plan(state_names, cfg)
    _check_names(src, entries)
    device = torch.device(device)
    tiered = offload and tier_by_budget(model, cfg.text, device, cpu_offload_gb, expert_misses, offload_reserve_bytes)
    allocate(model, device)
    state = {prefix + n: t for n, t in model.state_dict().items()}
    lossy: dict[str, int] = {}
    with torch.no_grad():
        for e in entries:
            for name, value in _ours(src, e, state, cfg, lossy).items():
                if state[name].shape != value.shape:
                    raise ValueError(f"{src.path}: {e.gguf} gives {name} of shape {list(value.shape)}, the config "
                                     f"expects {list(state[name].shape)}")
                state[name].copy_(value)
    if lossy and not quiet:
        what = ", ".join(f"{n:,} {k}" for k, n in sorted(lossy.items()))
        size = sum(t.numel() * t.element_size() for t in model.state_dict().values())
        print(f"kimik3: {src.path.name}: {what} (not exact; the model takes {size / 2**30:.2f} GiB in "
              f"{str(dtype).removeprefix('torch.')})", file=sys.stderr)
    if tiered:
        fill_slots(model, expert_trace)
    setattr(model, LOADED_FROM, src.path)
    return model


def _check_names(src: GGUFModel, entries: list[Entry]) -> None:
    want = {e.gguf for e in entries}
    missing, extra = sorted(want - set(src.tensors)), sorted(set(src.tensors) - want)
    if missing or extra:
        raise ValueError(f"{src.path}: tensors do not match the config: {len(missing)} missing (e.g. "
                         f"{missing[:3]}), {len(extra)} unexpected (e.g. {extra[:3]})")


def _ours(src: GGUFModel, e: Entry, state: dict[str, Tensor], cfg: K3Config, lossy: dict[str, int]
          ) -> dict[str, Tensor]:
    """Our state-dict tensors (by name) made from GGUF entry `e` (a `v_b` entry comes with its `k_b`)."""
    name = e.sources[0]
    if e.kind in ("a", "res") and all(UNFOLDED + n in src.kv for n in e.sources):
        return {n: torch.tensor(list(src.kv[UNFOLDED + n]), dtype=torch.float32).reshape(state[n].shape)
                for n in e.sources}
    if e.kind == "v_b":
        return {}
    t = src.tensor(e.gguf, lossy)
    if e.kind == "experts":
        return _experts(src, e, t, state, lossy)
    if e.kind == "conv":
        return {name: t.reshape(state[name].shape)}
    if e.kind == "a":
        a_log = torch.zeros(state[name].shape, dtype=torch.float32)
        a_log[: t.numel()] = torch.log(-t.float())
        return {name: a_log}
    if e.kind == "res":
        return {name: t, e.sources[1]: torch.ones_like(t).reshape(state[e.sources[1]].shape)}
    if e.kind == "k_b":
        v_b = src.tensor(e.gguf.replace("attn_k_b", "attn_v_b"), lossy)
        kv_b = torch.cat([t.transpose(1, 2), v_b], dim=1)  # [H, N + V, C]
        return {name: kv_b.reshape(-1, kv_b.shape[-1])}
    return {name: t}


def _experts(src: GGUFModel, e: Entry, t: Tensor, state: dict[str, Tensor], lossy: dict[str, int]
             ) -> dict[str, Tensor]:
    packed_model = len(e.sources) == 2
    if src.tensors[e.gguf].type == _T.MXFP4:
        packed, scale = from_ggml(t)
        if packed_model:
            return {e.sources[0]: packed, e.sources[1]: scale}
        return {e.sources[0]: decode(packed, scale, state[e.sources[0]].dtype)}
    if packed_model:  # dense or other-quantized experts kept packed: encoded (lossy)
        packed, scale = encode(t)
        lossy["expert weights re-encoded to MXFP4"] = lossy.get("expert weights re-encoded to MXFP4", 0) + t.numel()
        return {e.sources[0]: packed, e.sources[1]: scale}
    return {e.sources[0]: t}
