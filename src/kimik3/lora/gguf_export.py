"""A LoRA adapter as llama.cpp's LoRA GGUF (`llama-cli --lora`, llama-cpp-python's `lora_path`), where it can be one.

llama.cpp reads `<base tensor>.lora_a` / `.lora_b` beside the base model's GGUF names and scales each pair by
`adapter.lora.alpha / rank`, PEFT's alpha / R. Its `kimi-k3` graph (b10448, llama-cpp-python 0.3.36) multiplies
every dense weight with plain `ggml_mul_mat` and only the routed experts through `build_moe_ffn`, which adds the
adapters (`build_lora_mm_id`). So the format holds K3's expert adapters and llama.cpp applies them, while an adapter
on any other module (attention, shared experts, the latent projections) would load and be ignored: such an adapter
is refused here, with `kimik3 lora merge BASE ADAPTER OUT.gguf` as the way to take it to llama.cpp.

Legend: E experts, R rank, I/O in/out features of one expert's projection (L latent width, F expert width).

    blk.{i}.ffn_gate_exps.weight.lora_a   numpy [E, R, L] F32 (ggml ne [L, R, E])   from w1's A
    blk.{i}.ffn_gate_exps.weight.lora_b   numpy [E, F, R] F32                        from w1's B
    ... ffn_up_exps (w3), ffn_down_exps (w2: A [E, R, F], B [E, L, R])
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
from safetensors import safe_open

from kimik3.checkpoint.gguf_keys import ARCH, gguf
from kimik3.checkpoint.gguf_write import publish_files
from kimik3.lora.peft import NESTING, PREFIX, WEIGHTS, read_config

_EXPERTS = re.compile(re.escape(PREFIX) + r"(?:language_model\.)?model\.layers\.(\d+)\.block_sparse_moe\.experts\."
                      r"(base_layer\.base_layer\.|base_layer\.|)lora_([AB])\.weight$")
_GGUF = {"w1": "ffn_gate_exps", "w3": "ffn_up_exps", "w2": "ffn_down_exps"}
_PROJECTION = {nest: p for p, nest in NESTING.items()}


def export_gguf(adapter: str | Path, out: str | Path, num_experts: int) -> Path:
    """Write the routed-expert adapter at `adapter` (PEFT folder, `kimik3.lora.save`) as a LoRA GGUF at `out`.

    `num_experts`: E of the base model (PEFT stacks the experts' factors as [E*R, I] and [O, R*E]).

    Raises:
        ValueError: the adapter adapts a module llama.cpp's K3 graph would ignore, or `out` is not a .gguf name.
    """
    adapter, out = Path(adapter), Path(out)
    if out.suffix != ".gguf":
        raise ValueError(f"{out}: a LoRA GGUF destination is a file name ending in .gguf")
    cfg = read_config(adapter)
    if not (adapter / WEIGHTS).is_file():
        raise FileNotFoundError(f"{adapter}: not an adapter folder (no {WEIGHTS})")
    with safe_open(adapter / WEIGHTS, framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    others = sorted(k for k in tensors if _EXPERTS.match(k) is None)
    if others:
        module = others[0].removeprefix(PREFIX).rsplit(".lora_", 1)[0]
        raise ValueError(f"{adapter}: llama.cpp's kimi-k3 graph applies LoRA only to the routed experts, and this "
                         f"adapter also adapts {len(others) // 2} other module(s) (e.g. {module}), which it would "
                         "ignore: merge it instead (kimik3 lora merge BASE ADAPTER OUT.gguf)")
    pairs: dict[str, dict[str, np.ndarray]] = {}
    for key, t in sorted(tensors.items()):
        m = _EXPERTS.match(key)
        name = f"blk.{m[1]}.{_GGUF[_PROJECTION[m[2]]]}.weight"
        t = t.float()
        if m[3] == "A":  # [E*R, I] -> [E, R, I]
            pairs.setdefault(name, {})["lora_a"] = t.reshape(num_experts, -1, t.shape[-1]).numpy()
        else:  # [O, R*E], column r*E + e -> [E, O, R]
            pairs.setdefault(name, {})["lora_b"] = t.reshape(t.shape[0], -1, num_experts).permute(2, 0, 1).numpy()

    w = gguf.GGUFWriter(None, ARCH)
    w.add_type(gguf.GGUFType.ADAPTER)
    w.add_string(gguf.Keys.Adapter.TYPE, "lora")
    w.add_float32(gguf.Keys.Adapter.LORA_ALPHA, cfg.alpha)
    for name, ab in pairs.items():
        for part in ("lora_a", "lora_b"):
            data = np.ascontiguousarray(ab[part])
            w.add_tensor_info(f"{name}.{part}", data.shape, data.dtype, data.nbytes)

    def write(tmp: Path) -> None:
        w.write_header_to_file(tmp / out.name)
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for ab in pairs.values():
            for part in ("lora_a", "lora_b"):
                w.write_tensor_data(np.ascontiguousarray(ab[part]))
        w.close()

    return publish_files(out, write)[0]
